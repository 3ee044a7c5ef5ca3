"""Acknowledgements that must wait: ``ack(desc, after=stream_or_event)`` returns at once and a thread
sends the ack once the consumer's GPU work is done; a ``wait=False`` ack whose fd channel is full (the
daemon is behind) is handed over here too, so the caller never blocks.

The GPU work is waited for on blocking events (client/gpu/stream_wait.py): a thread sleeps in the driver
until the GPU signals, neither spinning a core nor polling, and the ack goes out as soon as it wakes. At
most the daemon's ``ack_ttl`` and ``ready_ttl``: by then the daemon has ended the feature and let go any
READY word a stream of ours waits on, and work that has not finished (a stream stuck on something else)
is recorded as a failed ack (``ack TIMED_OUT``).
One lane (a queue and its thread) per stream the work was queued on, and one for acks with nothing to
wait for: within a stream work completes in order, so a lane waits for nothing that is not ahead of it,
and an ack behind a long kernel delays no ack on another stream. The threads send on the client's fd
channel, like every background ack.
"""

from __future__ import annotations

import logging
import os
import queue
import threading
import time
from typing import Any, Callable, Hashable, Optional

from mmfeat.protos.errors import MmfeatError

from ..link.async_failures import AsyncFailures

log = logging.getLogger("mmfeat.client")


Send = Callable[[dict[str, Any], int, bytes], None]
Sync = Callable[[float], bool]
Bound = Callable[[], float]

# Lanes beyond this share threads (by stream): a process rarely uses more streams than this.
MAX_LANES = 16


class Acker:
    def __init__(self, send: Send, sync: Sync, failures: AsyncFailures, bound: Optional[Bound] = None) -> None:
        self._send = send
        self._sync = sync
        self._bound = bound if bound is not None else (lambda: 300.0)  # seconds a lane waits for GPU work
        self._failures = failures
        self._lanes: dict[Hashable, tuple[queue.Queue, threading.Thread]] = {}
        self._pending = 0
        # Re-entrant: a finaliser (a Parcel's ack, a dropped reservation) may run inside this very lock.
        self._cond = threading.Condition(threading.RLock())
        self.pid = os.getpid()  # threads do not survive fork: a child needs its own acker
        self._lane(None)

    def _lane(self, key: Hashable) -> queue.Queue:
        with self._cond:
            lane = self._lanes.get(key)
            if lane is None:
                if key is not None and len(self._lanes) > MAX_LANES:
                    key = ("shared", hash(key) % MAX_LANES)
                    lane = self._lanes.get(key)
            if lane is None:
                q: queue.Queue = queue.Queue()
                name = "mmfeat-acker" if key is None else f"mmfeat-acker-{len(self._lanes)}"
                thread = threading.Thread(target=self._run, args=(q,), name=name, daemon=True)
                lane = self._lanes[key] = (q, thread)
                thread.start()
            return lane[0]

    def submit(self, fields: dict[str, Any], count: int, ack_id: bytes, fence: Optional[Any]) -> None:
        """``fields``: the ack request's lease (and owner node, for another node's feature); ``fence``:
        what completes when the work to wait for is done (a gpu_order.Fence: ``wait()`` and ``lane``),
        or None."""
        self.run_after(fence, lambda: self._send(fields, count, ack_id), "ack",
                       f"lease {fields['lease'].get('lease')}")

    def run_after(self, fence: Optional[Any], action: Callable[[], None], kind: str, what: str) -> None:
        """Run ``action`` on a lane once ``fence`` is done (at once without one); its failure is
        recorded as ``kind`` for ``what``. Safe from a finaliser: it takes only re-entrant locks."""
        with self._cond:
            self._pending += 1
        self._lane(getattr(fence, "lane", None) if fence is not None else None).put((fence, action, kind, what))

    def _run(self, q: queue.Queue) -> None:
        from ..gpu.gpu_order import Fence, relaxed
        from ..gpu.stream_wait import wait_for

        while (item := q.get()) is not None:
            fence, action, kind, what = item
            try:
                if isinstance(fence, Fence):
                    relaxed()  # before this thread's first query: another thread may be capturing a graph
                    # Sleeps until the GPU work that may touch the memory is done, for a bound.
                    wait_for(fence, self._bound(), f"the GPU work the {kind} of {what} waits for", spin=0)
                elif fence is not None:
                    fence.wait()
                action()
            except MmfeatError as exc:
                code = exc.code.value if exc.code is not None else "UNAVAILABLE"
                self._failures.record(kind, code, f"{what}: {exc.message}")
            except Exception as exc:  # never let the thread die: later acks would hang flush()
                self._failures.record(kind, type(exc).__name__, f"{what}: {exc}", exc_info=True)
            with self._cond:
                self._pending -= 1
                self._cond.notify_all()

    def flush(self, timeout: float) -> bool:
        """Wait until every submitted ack has been sent and the daemon has handled it; False on timeout."""
        deadline = time.monotonic() + timeout
        with self._cond:
            while self._pending:
                left = deadline - time.monotonic()
                if left <= 0:
                    return False
                self._cond.wait(left)
        return self._sync(max(0.0, deadline - time.monotonic()))

    def stop(self) -> None:
        """End every lane's thread once it has sent what was submitted to it before."""
        with self._cond:
            lanes = list(self._lanes.values())
        for q, _ in lanes:
            q.put(None)

    def close(self, timeout: float) -> None:
        if not self.flush(timeout):
            log.warning("closing with %d acknowledgement(s) unsent; those leases will expire after ack_ttl",
                        self._pending)
        with self._cond:
            lanes = list(self._lanes.values())
        for q, _ in lanes:
            q.put(None)
        deadline = time.monotonic() + timeout
        for _, thread in lanes:
            thread.join(max(0.0, deadline - time.monotonic()))
