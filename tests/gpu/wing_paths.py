"""Rewrites, in place, the client module paths of scripts written before the client had wings
(``mmfeat.client.dlpack`` becomes ``mmfeat.client.gpu.dlpack``), for tests/gpu/run.sh's copies of the
review's probes; and a stand-in a probe patches in for a function whose signature has grown since
(``wait_for_current_stream`` takes its bound: gpu_probe.py's c6nowait replaces it with a one-argument
lambda, which would raise where it should do nothing).

    python tests/gpu/wing_paths.py FILE...
"""

import re
import sys
from pathlib import Path

WINGS = {
    "link": "channel fd_transport fd_channel transport session arenas lease_table mapping daemon_lock fd_budget "
            "async_failures in_flight",
    "gpu": "cuda_import dlpack stream_wait gpu_order",
    "produce": "producer reservations put_in_flight fallbacks keyed packing",
    "consume": "consumer ack_routes ack_thread acked_leases pinned inline_base",
}
WING_OF = {module: wing for wing, modules in WINGS.items() for module in modules.split()}
_DOTTED = re.compile(r"\bmmfeat\.client\.(" + "|".join(WING_OF) + r")\b")
_FROM = re.compile(r"^(\s*)from mmfeat\.client import (" + "|".join(WING_OF) + r")\b", re.M)


_STAND_IN = re.compile(r"(\.wait_for_current_stream = lambda dev): None")


def rewrite(text: str) -> str:
    text = _DOTTED.sub(lambda m: f"mmfeat.client.{WING_OF[m.group(1)]}.{m.group(1)}", text)
    text = _STAND_IN.sub(r"\1, *_: None", text)
    return _FROM.sub(lambda m: f"{m.group(1)}from mmfeat.client.{WING_OF[m.group(2)]} import {m.group(2)}", text)


if __name__ == "__main__":
    for name in sys.argv[1:]:
        path = Path(name)
        path.write_text(rewrite(path.read_text()))
