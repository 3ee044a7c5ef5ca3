"""The MMFEAT_* environment variables that are not mmfeatd settings, and who reads them.

mmfeatd reads ``MMFEAT_<SETTING>`` for each of its settings and warns about any other ``MMFEAT_*``
name, since a typo (an underscore left out) would otherwise be ignored without a word. The client and the
shared top package read the names below; they live here, on the side both ends import, so that the
daemon's warning never flags them. tests/test_cli.py checks that every MMFEAT_ name in the sources is a
setting's or one of these.
"""

from __future__ import annotations

from .paths import RUNTIME_DIR_ENV

READ_OUTSIDE_SETTINGS: frozenset[str] = frozenset({
    RUNTIME_DIR_ENV,            # the client's runtime dir (protos/paths.py)
    "MMFEAT_TIMEOUT",           # the client's default call timeout
    "MMFEAT_INLINE_THRESHOLD",  # the client's inline/pool size threshold
    "MMFEAT_INLINE_MAX",        # the client's cap on the inline fallback
    "MMFEAT_NNODES",            # the client's transport policy
    "MMFEAT_ATOMICS",           # mmfeat.atomics: force libatomic for loads and stores
    "MMFEAT_NO_ATOMICS",        # mmfeat.atomics: run the message path on purpose
    "MMFEAT_CHAOS_DEVICE",      # tests/chaos: the device its workers use
    "MMFEAT_TEST_ONLY_FABRIC",  # mmfeat.cuda_driver: a test's stand-in for NVML's fabric answer
    "MMFEAT_TEST_ONLY_IMEX_CHANNELS",  # mmfeat.cuda_driver: a test's IMEX channel directory
    "MMFEAT_VLLM_VENV",         # tests/test_vllm_engine.py: the vLLM venv `make test-vllm` built
    "MMFEAT_VLLM_TIMINGS",      # tests/vllm_engine: where the timed connectors write their timings
    "MMFEAT_VLLM_SUMMARY",      # tests/test_vllm_engine.py: where to write the connectors' comparison
    "MMFEAT_VLLM_TRAP",         # tests/vllm_engine/trap_connector.py: the trap a test armed between lookup and load
})
