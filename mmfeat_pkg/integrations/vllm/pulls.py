"""Items another node's producer saved, as a consumer's scheduler waits for them.

A request whose ``ec_transfer_params`` name another node's descriptor is scheduled only once each of
those items is in this node's pool and held there for the ranks that load it: the scheduler asks its
daemon to pull the item (one pull per node, shared by every rank and every instance on the node) and
to hold the copy (``Client.hold_remote``), so that ``has_cache_item`` says True only for bytes that are
here, and the ranks read a feature of their own node. A request waits for that in
``ensure_cache_available``, a bounded time per step (``pull_wait_s``, all of the step's requests
together: other requests are scheduled meanwhile), and is deferred to the next step while a pull is
under way; past ``load_wait_s`` from its first wait, or at once where waiting cannot help (the feature
is gone, or the owner refused it), the request fails (``take_unavailable_requests``) rather than feed
the model bytes it does not have.
"""

from __future__ import annotations

import base64
import logging
import time
from collections import Counter
from typing import Any, Callable, Optional

from mmfeat.client import Descriptor, MmfeatError
from mmfeat.protos.errors import ErrorCode

from .settings import ConnectorSettings

log = logging.getLogger("mmfeat.integrations.vllm")

PARAMS_KEY = "mmfeat"  # the key of our entry in each item of ec_transfer_params
MAX_PULL_S = 600.0  # the longest wait_s a remote_get takes
# A wait of at least this much: a copy already here answers at once; one still on its way answers then.
_LOOK_S = 1e-3
# Errors of a pull that a later try may not meet: the pull failed or has not landed yet, the pool had no
# room, the daemon is away or being replaced. Anything else (the feature ended, the owner refused the
# descriptor, no transport) fails the request at once.
_RETRY = (ErrorCode.TIMED_OUT, ErrorCode.PEER_UNAVAILABLE, ErrorCode.POOL_FULL, ErrorCode.OVER_QUOTA,
          ErrorCode.DRAINING, None)


class Pulls:
    def __init__(self, client: Any, settings: ConnectorSettings, ranks: int, counters: Counter[str],
                 clock: Callable[[], float] = time.monotonic) -> None:
        self._client, self._settings, self._ranks, self._clock = client, settings, ranks, clock
        self.owners: dict[str, Descriptor] = {}  # mm_hash -> another node's descriptor a request names
        self.inline: dict[str, Descriptor] = {}  # mm_hash -> a descriptor that carries the bytes itself
        # mm_hashes their producer saved on this node (it said so, with no descriptor): the key feed brings them
        self.saved_here: set[str] = set()
        self._started: dict[str, float] = {}  # mm_hash -> when its pull was asked for
        self._since: dict[str, float] = {}  # request id -> when it first waited for a pull
        self._step_ends: Optional[float] = None  # when this step's wait for pulls is spent
        self.counters = counters  # the scheduler's: pulls_held, pulls_waited, pulls_failed

    def note(self, request: Any, node: Optional[str]) -> None:
        """The other nodes' descriptors that ``request``'s params name (``node``: this one's, None while
        the daemon is away: then no descriptor is taken for another node's)."""
        for h, item in (request.ec_transfer_params or {}).items():
            ours = item.get(PARAMS_KEY) if isinstance(item, dict) else None
            if not isinstance(ours, dict) or h in self.owners or h in self.inline:
                continue
            if "desc" not in ours:
                if node is not None and ours.get("node") == node:
                    self.saved_here.add(h)
                continue
            try:
                desc = Descriptor.from_bytes(base64.b64decode(ours["desc"], validate=True))
            except (KeyError, TypeError, ValueError, MmfeatError) as e:
                log.warning("mmfeat: request %s names item %s with an unreadable descriptor (%s); ignored",
                            request.request_id, h, e)
                continue
            if desc.is_inline:
                self.inline[h] = desc
            elif node is not None and desc.node != node:
                self.owners[h] = desc

    def wait(self, rid: Optional[str], hashes: list[str], answers: dict[str, Any]) -> Optional[bool]:
        """Hold each of ``hashes`` here for the ranks, waiting for their pulls within what is left of this
        step's ``pull_wait_s``; each one held goes into ``answers`` as a hold (mm_hash -> (descriptor
        bytes, True)). True: all are held. False: not yet; defer the request. None: request ``rid``
        cannot have them (its ``load_wait_s`` passed, or a pull failed for good): fail it."""
        now = self._clock()
        since = self._since.setdefault(rid, now) if rid is not None else now
        deadline = since + self._settings.load_wait_s
        if self._step_ends is None:
            self._step_ends = now + self._settings.pull_wait_s
        for h in hashes:
            if h not in self._started:
                self._started[h] = now
                # The pull goes on for as long as the request may wait, whatever each look below waits.
                self._prefetch(h, min(MAX_PULL_S, max(deadline - now, _LOOK_S)))
        missing: Optional[MmfeatError] = None
        for h in hashes:
            now = self._clock()
            wait_s = max(min(self._step_ends, deadline) - now, _LOOK_S)
            try:
                desc = self._client.hold_remote(self.owners[h], count=self._ranks, wait_s=wait_s)
            except MmfeatError as e:
                if e.code not in _RETRY:
                    return self._failed(rid, h, e)
                if e.code is not ErrorCode.TIMED_OUT:
                    self._started.pop(h, None)  # this pull failed: the next look starts another
                missing = e
                continue
            answers[h] = (desc.to_bytes(), True)
            self.counters["pulls_held"] += 1
        if missing is None:
            self._since.pop(rid, None)
            return True
        if self._clock() >= deadline:
            return self._failed(rid, None, missing)
        self.counters["pulls_waited"] += 1
        return False

    def end_step(self) -> None:
        self._step_ends = None

    def finished(self, request: Any) -> None:
        self._since.pop(request.request_id, None)
        for f in request.mm_features:
            for known in (self.owners, self.inline, self._started):
                known.pop(f.identifier, None)
            self.saved_here.discard(f.identifier)

    def _prefetch(self, h: str, wait_s: float) -> None:
        try:
            self._client.prefetch(self.owners[h], wait_s=wait_s)
        except MmfeatError as e:
            log.info("mmfeat: the pull of %s could not start (%s); the hold will ask again", h, e)

    def _failed(self, rid: Optional[str], h: Optional[str], e: MmfeatError) -> None:
        self.counters["pulls_failed"] += 1
        self._since.pop(rid, None)
        if h is None:
            log.warning("mmfeat: request %s: another node's item did not land within load_wait_s (%.3g s; last: "
                        "%s); it fails and may be retried", rid, self._settings.load_wait_s, e)
        else:
            log.warning("mmfeat: request %s: another node's item %s cannot be pulled (%s); it fails and may be "
                        "retried", rid, h, e)
        return None
