"""mmfeat's connector with a trap between the scheduler's lookup and the ranks' load, for the real-engine
tests of an item that goes away in that window.

``TrappedMmfeatECConnector`` is ``MmfeatECConnector`` itself, loaded by vLLM from this module. Once the
scheduler half has built a step's metadata (its lookup and hold are done; the metadata has not gone to
the ranks) it springs the trap the test armed, if any, on the items the step loads, through a client
of its own (another session, as another instance's would be), and writes what it did to the
connector's report_file:

- ``evict``: ``Client.evict`` of the item's key, as an operator or another instance may do.
- ``take``: the key evicted, then what protects the ranks' read is taken away by acks of the
  descriptor the ranks were given: a retained item's pin released (or its hold ended) early, as the
  daemon's ``ack_ttl`` would end it, a counted item's remaining count used up (as a reader beyond its
  ``consumers`` would), so the bytes are freed before the ranks read them.

The test arms the trap by writing ``{"action": "evict"|"take", "items": N}`` to the file named by
``$MMFEAT_VLLM_TRAP``; the trap acts on the next N items loaded and then removes the file.
"""

import json
import os
import time

from mmfeat.client import Client, MmfeatError
from mmfeat.integrations.vllm.connector import MmfeatECConnector

MAX_ACKS = 4096  # a hold's or a counted item's largest count
TAKE_S = 30.0


class TrappedMmfeatECConnector(MmfeatECConnector):
    def build_connector_meta(self, scheduler_output):
        meta = super().build_connector_meta(scheduler_output)
        path = os.environ.get("MMFEAT_VLLM_TRAP")
        if path and meta.loads and os.path.exists(path):
            with open(path) as f:
                trap = json.load(f)
            hit = list(meta.loads)[:trap["items"]]
            for h in hit:
                self._spring(trap["action"], h, meta.loads[h])
            if trap["items"] > len(hit):
                with open(path, "w") as f:
                    json.dump({**trap, "items": trap["items"] - len(hit)}, f)
            else:
                os.unlink(path)
        return meta

    @staticmethod
    def _take(other: Client, blob: bytes) -> dict:
        """Ack the descriptor the ranks were given, in the lease table, until the daemon has freed what
        it names (a pin's reads released, a hold's or a counted item's count used up: the daemon frees it
        at its next sweep), within TAKE_S."""
        acks, deadline = 0, time.monotonic() + TAKE_S
        while True:
            try:
                other.get(blob, copy=True)
            except MmfeatError as e:
                return {"acks": acks, "gone": True, "why": getattr(e, "code", str(e))}
            if time.monotonic() > deadline:
                return {"acks": acks, "gone": False}
            if acks < MAX_ACKS:
                try:
                    other.ack(blob)
                    acks += 1
                except MmfeatError:
                    pass  # it ended since the get above (the client refuses a repeated ack of an ended one)
            else:
                time.sleep(0.01)  # every read released: waiting for the daemon's sweep to free it

    def _spring(self, action: str, mm_hash: str, blob: bytes) -> None:
        if action not in ("evict", "take"):
            raise ValueError(f"unknown trap action {action!r}")
        with Client(self._settings.runtime_dir, name="vllm-ec-trap") as other:
            done = {"evicted": other.evict(self._ns.key(mm_hash))}
            if action == "take":
                done.update(self._take(other, blob))
        line = {"op": "trap", "action": action, "mm_hash": mm_hash, "t": time.time(), **done}
        with open(self._settings.report_file, "a") as f:
            f.write(json.dumps(line) + "\n")
