"""Acknowledgements that must wait: ``ack(desc, after=stream_or_event)`` returns at once and a thread
sends the ack once the consumer's GPU work is done; a ``wait=False`` ack whose fd channel is full (the
daemon is behind) is handed over here too, so the caller never blocks.

The GPU work is waited for in a blocking event's ``synchronize()`` (ack_routes.py records one): the thread
sleeps in the driver until the GPU signals the event, so it neither spins a core nor polls, and the
ack goes out as soon as the thread wakes. The thread sends on the client's fd channel, like every
background ack.
"""

from __future__ import annotations

import logging
import os
import queue
import threading
import time
from typing import Any, Callable, Optional

from mmfeat.protos.errors import MmfeatError

from ..link.async_failures import AsyncFailures

log = logging.getLogger("mmfeat.client")


Send = Callable[[dict[str, Any], int, bytes], None]
Sync = Callable[[float], bool]


class Acker:
    def __init__(self, send: Send, sync: Sync, failures: AsyncFailures) -> None:
        self._send = send
        self._sync = sync
        self._failures = failures
        self._queue: queue.Queue = queue.Queue()
        self._pending = 0
        self._cond = threading.Condition()
        self.pid = os.getpid()  # threads do not survive fork: a child needs its own acker
        self._thread = threading.Thread(target=self._run, name="mmfeat-acker", daemon=True)
        self._thread.start()

    def submit(self, fields: dict[str, Any], count: int, ack_id: bytes, event: Optional[Any]) -> None:
        """``fields``: the ack request's lease (and owner node, for another node's feature); ``event``:
        a blocking CUDA event that completes when the work to wait for is done, or None."""
        with self._cond:
            self._pending += 1
        self._queue.put((fields, count, ack_id, event))

    def _run(self) -> None:
        while (item := self._queue.get()) is not None:
            fields, count, ack_id, event = item
            try:
                if event is not None:
                    event.synchronize()  # sleeps until the GPU work that read the feature is done
                self._send(fields, count, ack_id)
            except MmfeatError as exc:
                code = exc.code.value if exc.code is not None else "UNAVAILABLE"
                self._failures.record("ack", code, f"lease {fields['lease'].get('lease')}: {exc.message}")
            except Exception as exc:  # never let the thread die: later acks would hang flush()
                self._failures.record("ack", type(exc).__name__, f"lease {fields['lease'].get('lease')}: {exc}",
                                      exc_info=True)
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
        """End the thread once it has sent what was submitted before."""
        self._queue.put(None)

    def close(self, timeout: float) -> None:
        if not self.flush(timeout):
            log.warning("closing with %d acknowledgement(s) unsent; those leases will expire after ack_ttl",
                        self._pending)
        self._queue.put(None)
        self._thread.join(timeout)
