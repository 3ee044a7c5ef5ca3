"""Both connectors under test, each with its save and load timed per item, for the real-engine run.

Loaded by vLLM itself (``ec_connector_module_path``) in its scheduler and worker processes; each
timing is one JSON line appended to ``$MMFEAT_VLLM_TIMINGS``."""

import json
import os
import time

from vllm.distributed.ec_transfer.ec_connector.example_connector import ECExampleConnector

from mmfeat.integrations.vllm.connector import MmfeatECConnector


def _log(name: str, op: str, seconds: float, items: int) -> None:
    path = os.environ.get("MMFEAT_VLLM_TIMINGS")
    if path and items:
        with open(path, "a") as f:
            f.write(json.dumps({"connector": name, "op": op, "seconds": seconds, "items": items}) + "\n")


def _timed(base: type, name: str) -> type:
    class Timed(base):
        def save_caches(self, encoder_cache, mm_hash, **kwargs):
            t = time.perf_counter()
            super().save_caches(encoder_cache, mm_hash, **kwargs)
            _log(name, "save", time.perf_counter() - t, 1)

        def start_load_caches(self, encoder_cache, **kwargs):
            before = set(encoder_cache)
            t = time.perf_counter()
            super().start_load_caches(encoder_cache, **kwargs)
            _log(name, "load", time.perf_counter() - t, len(set(encoder_cache) - before))

    Timed.__name__ = Timed.__qualname__ = f"Timed{base.__name__}"
    return Timed


TimedMmfeatECConnector = _timed(MmfeatECConnector, "mmfeat")
TimedECExampleConnector = _timed(ECExampleConnector, "example")
