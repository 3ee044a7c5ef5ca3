"""Inline fallbacks: counted, warned about once per reason, reported to the daemon without loss, and a
daemon that stopped answering is noticed once and then probed in the background.

When the daemon is down every put would otherwise wait its whole timeout before going inline. After
one failure puts go inline at once, and a background thread pings the daemon at most once a second
until it answers. The same thread reports the fallback counts with a request it waits for, so a
report is forgotten only once the daemon has confirmed it.
"""

from __future__ import annotations

import logging
import os
import threading
from collections import Counter
from typing import Optional

from mmfeat.protos.errors import FdLimitError, MmfeatError
from mmfeat.protos.messages import FallbackReason

from ..link.channel import ControlChannel
from ..fork_locks import renew_in_child

log = logging.getLogger("mmfeat.client")

PROBE_EVERY_S = 1.0
_KEYS = {reason: reason.value for reason in FallbackReason}


class FallbackTracker:
    def __init__(self, endpoint: str, timeout: float) -> None:
        self.counts: Counter[str] = Counter()  # every fallback of this client, by reason
        self._endpoint = endpoint
        self._timeout = timeout
        self._unreported: Counter[str] = Counter()
        self._warned: set[str] = set()
        self._lock = threading.Lock()
        self._down = False
        self._stop = threading.Event()
        self._thread: Optional[threading.Thread] = None
        self._pid = os.getpid()
        renew_in_child(self)  # a forked child's puts count their fallbacks here

    @property
    def daemon_down(self) -> bool:
        """True from a failure until the background probe gets an answer (in this process)."""
        return self._down and self._pid == os.getpid()

    def record(self, reason: FallbackReason, detail: str, inline_threshold: int) -> None:
        key = _KEYS[reason]  # every small feature passes here: an enum's .value is a slow descriptor call
        with self._lock:
            self.counts[key] += 1
            self._unreported[key] += 1
            first = key not in self._warned
            if first:
                self._warned.add(key)
        if first:
            if reason is FallbackReason.BELOW_THRESHOLD:
                log.info("features under %d B travel inline (inline_threshold); counted in stats", inline_threshold)
            else:
                log.warning("mmfeat pool unavailable (%s: %s); sending features inline. Warned once; counted in stats",
                            reason.value, detail)
        if self._thread is None or self._pid != os.getpid():
            self._ensure_thread()

    def mark_down(self) -> None:
        self._down = True
        self._ensure_thread()

    def _ensure_thread(self) -> None:
        if self._thread is not None and self._pid == os.getpid():
            return
        with self._lock:
            if self._pid != os.getpid():  # forked: the parent's thread and counts are not ours
                self._pid, self._thread = os.getpid(), None
                self._unreported.clear()
                self._down = False
            if self._thread is None:
                self._thread = threading.Thread(target=self._run, name="mmfeat-fallbacks", daemon=True)
                self._thread.start()

    def _run(self) -> None:
        channel = ControlChannel(self._endpoint, min(self._timeout, PROBE_EVERY_S))
        try:
            while not self._stop.wait(PROBE_EVERY_S):
                self._probe_and_report(channel)
        finally:
            channel.close()

    def _probe_and_report(self, channel: ControlChannel) -> bool:
        """One ping when the daemon is down, then the counts not yet confirmed; True if it answered."""
        try:
            if self._down:
                channel.call("ping")
                self._down = False
                log.info("mmfeatd answers again; features go through the pool")
            with self._lock:
                pending = dict(self._unreported)
            for reason, n in pending.items():
                channel.call("fallback", reason=reason, count=n)
                with self._lock:
                    self._unreported[reason] -= n
                    if self._unreported[reason] <= 0:
                        del self._unreported[reason]
            return True
        except FdLimitError:
            return False  # this process is short of fds, not the daemon gone: try again next round
        except MmfeatError:
            self._down = True
            return False

    def close(self, timeout: float) -> None:
        """Stop the thread and report what is left, if the daemon answers within ``timeout``."""
        self._stop.set()
        if self._thread is not None and self._pid == os.getpid():
            self._thread.join(timeout)
        if self._unreported and self._pid == os.getpid():
            channel = ControlChannel(self._endpoint, min(self._timeout, timeout, 0.5))
            try:
                if not self._probe_and_report(channel):
                    log.warning("closing with %d fallback(s) the daemon never confirmed",
                                sum(self._unreported.values()))
            finally:
                channel.close()
