"""The connector's scheduler half: which items the pool has, holds for the ranks that will load them,
and what to do with the workers' reports. It runs in vLLM's EngineCore process on a control-only
client, which maps no pool.

Per step, vLLM asks ``ensure_cache_available`` for each request, then ``has_cache_item`` for each of
its items it would otherwise encode, then ``update_state_after_alloc`` for each item it allocated
encoder-cache space for, then ``build_connector_meta`` once. A True from ``has_cache_item`` commits
the scheduler (the item gets no encoder budget and the runner will not encode it), so it must be
honest until the ranks have copied the item: the hold taken at allocation protects it from eviction
and from its TTL until each rank acked it, and an item gone by then fails its request cleanly
(``take_unavailable_requests``) instead of feeding the model bytes it does not have. What each load
still owes the item is kept in ``LoadBooks`` (books.py), which settles it by the load's own step's
report whatever order vLLM finishes requests and applies reports in.
"""

from __future__ import annotations

import base64
import logging
import time
from collections import Counter, OrderedDict
from typing import Any, Optional, Protocol, Sequence

from mmfeat.client import MAX_LOOKUP_KEYS, Descriptor, MmfeatError

from .books import LoadBooks, Release
from .metadata import StepLoads, StepReport
from .settings import ConnectorSettings

log = logging.getLogger("mmfeat.integrations.vllm")

PARAMS_KEY = "mmfeat"  # the key of our entry in each item of ec_transfer_params
MAX_SAVED = 65536  # saved descriptors kept for request_finished; a request that never finishes drops out


class Feature(Protocol):  # vllm.multimodal.inputs.MultiModalFeatureSpec, as far as we read it
    identifier: str


class Request(Protocol):  # vllm.v1.request.Request, as far as we read it
    request_id: str
    mm_features: Sequence[Feature]
    ec_transfer_params: Optional[dict[str, Any]]


def has_many(client: Any, keys: list[str]) -> list[bool]:
    """``client.has_many`` over any number of keys: one round trip per MAX_LOOKUP_KEYS of them."""
    return [hit for i in range(0, len(keys), MAX_LOOKUP_KEYS)
            for hit in client.has_many(keys[i:i + MAX_LOOKUP_KEYS])]


class SchedulerSide:
    def __init__(self, client: Any, namespace: Any, settings: ConnectorSettings, is_producer: bool,
                 is_consumer: bool, loading_ranks: int) -> None:
        self._client, self._ns, self._settings = client, namespace, settings
        self._producer, self._consumer, self._ranks = is_producer, is_consumer, loading_ranks
        self._known: dict[str, bool] = {}  # this step's answers, mm_hash -> in the pool
        self._remote: dict[str, Descriptor] = {}  # another node's descriptors named by a request's params
        self._prefetched: dict[str, float] = {}  # mm_hash -> when its pull was started
        self._loads: dict[str, bytes] = {}  # this step's holds, mm_hash -> hold descriptor bytes
        self._saves: list[str] = []
        # Not reset per step: reports may come a step late (vLLM's async scheduling builds the next step
        # before the last one's output is in), and a request may end before its step's report.
        self._books = LoadBooks(loading_ranks)
        self._saved: OrderedDict[str, bytes] = OrderedDict()  # producer: what the workers saved, until asked
        self._node_id: Optional[str] = None
        self._unavailable: set[str] = set()
        self.counters: Counter[str] = Counter()

    # --- lookups ---------------------------------------------------------------------------------

    def ensure_cache_available(self, request: Request, num_computed_tokens: int) -> bool:
        if not self._consumer:
            return True
        self._note_remote(request)
        wanted = [f.identifier for f in request.mm_features
                  if f.identifier not in self._known and f.identifier not in self._remote]
        if wanted:
            self._lookup(wanted)
        # A pull another node serves starts here, a step before the ranks read it: the request waits one
        # step for it, then the ranks' gets find it under way or done (each waits up to load_wait_s).
        now = time.monotonic()
        started = [h for f in request.mm_features if (h := f.identifier) in self._remote and h not in self._prefetched]
        for h in started:
            self._prefetched[h] = now
            try:
                self._client.prefetch(self._remote[h])
            except MmfeatError as e:
                log.warning("mmfeat: the pull of %s could not start (%s); the ranks will try again", h, e)
        return not started

    def has_cache_item(self, identifier: str) -> bool:
        if not self._consumer:
            return False
        if identifier in self._remote:
            return True
        if identifier not in self._known:
            self._lookup([identifier])
        return self._known[identifier]

    def _lookup(self, hashes: list[str]) -> None:
        try:
            found = has_many(self._client, [self._ns.key(h) for h in hashes])
        except MmfeatError as e:
            # The daemon is away: nothing is in the pool, and the model encodes its items itself.
            log.warning("mmfeat: lookup failed (%s); encoding locally", e)
            found = [False] * len(hashes)
        for h, hit in zip(hashes, found):
            self._known[h] = hit
            self.counters["hits" if hit else "misses"] += 1

    def _note_remote(self, request: Request) -> None:
        for h, item in (request.ec_transfer_params or {}).items():
            ours = item.get(PARAMS_KEY) if isinstance(item, dict) else None
            if not isinstance(ours, dict) or h in self._remote:
                continue
            try:
                desc = Descriptor.from_bytes(base64.b64decode(ours["desc"], validate=True))
            except (KeyError, TypeError, ValueError, MmfeatError) as e:
                log.warning("mmfeat: request %s names item %s with an unreadable descriptor (%s); ignored",
                            request.request_id, h, e)
                continue
            if desc.is_inline or desc.node != self._node():
                self._remote[h] = desc

    def _node(self) -> str:
        if self._node_id is None:
            self._node_id = str(self._client.ping()["node"])
        return self._node_id

    # --- allocation and the step's metadata ------------------------------------------------------

    def update_state_after_alloc(self, request: Request, index: int) -> None:
        h = request.mm_features[index].identifier
        if self._producer and not self._consumer:
            self._saves.append(h)
            return
        if h in self._remote:
            self._add_load(request, h, self._remote[h].to_bytes(), held=False)
            return
        if not self._known.get(h):
            return  # vLLM encodes it here
        if h in self._loads:
            self._books.add(request.request_id, h, None)  # another request of this step loads it
            return
        try:
            if self._settings.lifetime == "retained":
                hold = self._client.hold(self._ns.key(h), count=self._ranks)
            else:
                # A counted item is freed by its consumers' acks: each rank's ack is one of them, so the
                # ranks read the item's own descriptor and nothing else protects it.
                hold = self._client.lookup(self._ns.key(h))
        except MmfeatError as e:
            log.warning("mmfeat: hold of %s failed (%s)", h, e)
            hold = None
        if hold is None:
            # Gone between the lookup and now (evicted, expired, its daemon restarted): the scheduler is
            # committed to loading it, so the request fails cleanly and a retry encodes it.
            self.counters["hold_misses"] += 1
            self._unavailable.add(request.request_id)
            return
        self.counters["holds"] += 1
        self._add_load(request, h, hold.to_bytes(), held=True)

    def _add_load(self, request: Request, h: str, blob: bytes, held: bool) -> None:
        self._loads[h] = blob
        self._books.add(request.request_id, h, blob if held else None)

    def build_connector_meta(self, scheduler_output: Any) -> StepLoads:
        meta = StepLoads(loads=dict(self._loads), saves=list(self._saves), step=self._books.send())
        self._loads.clear()
        self._saves.clear()
        self._known.clear()
        return meta

    # --- the workers' reports --------------------------------------------------------------------

    def update_connector_output(self, report: Optional[StepReport]) -> None:
        if not report:
            return
        self._saved.update(report.saved)
        while len(self._saved) > MAX_SAVED:
            self._saved.popitem(last=False)
        self.counters["loads"] += sum(report.loaded.values())
        waiting, releases = self._books.report(report.step, report.acked) if report.step else ({}, [])
        for h, why in report.failed.items():
            self.counters["load_failures"] += 1
            for rid in waiting.get(h, ()):
                log.warning("mmfeat: request %s could not load %s (%s); it fails and may be retried", rid, h, why)
                self._unavailable.add(rid)
        self._give_back(releases)

    def _give_back(self, releases: list[Release]) -> None:
        """Units of holds that no rank acked (a rank died, or never ran the step), so that no hold
        outlives its request and no counted item waits for a load that will not come."""
        for r in releases:
            try:
                self._client.ack(r.blob, count=r.units)
                self.counters["holds_released"] += 1
            except MmfeatError as e:
                log.info("mmfeat: release of the hold on %s: %s", r.mm_hash, e)

    def unsettled_loads(self) -> int:
        """Held loads whose units are neither acked nor given back yet: none once the scheduler is idle."""
        return self._books.pending()

    def take_unavailable_requests(self) -> set[str]:
        out, self._unavailable = self._unavailable, set()
        return out

    def request_finished(self, request: Request) -> tuple[bool, Optional[dict[str, Any]]]:
        # vLLM finishes a request that stopped in the step that loaded it before it applies that step's
        # report (Scheduler.update_from_output), and an abort may come while a step that loads for it is
        # on the ranks: the books give back now only what a report already settled.
        self._give_back(self._books.finish(request.request_id))
        for f in request.mm_features:
            self._remote.pop(f.identifier, None)
            self._prefetched.pop(f.identifier, None)
        if not self._producer:
            return False, None
        items: dict[str, Any] = {}
        for f in request.mm_features:
            blob = self._saved.pop(f.identifier, None) or self._lookup_saved(f.identifier)
            if blob is not None:
                items[f.identifier] = {PARAMS_KEY: {"desc": base64.b64encode(blob).decode("ascii"),
                                                    "node": self._node()}}
        return False, items or None

    def _lookup_saved(self, h: str) -> Optional[bytes]:
        """The descriptor of an item saved by a step whose report has not come back: vLLM finishes an
        encode-only request in the step that encoded it, before it reads the workers' reports."""
        try:
            desc = self._client.lookup(self._ns.key(h))
        except MmfeatError as e:
            log.info("mmfeat: lookup of saved %s: %s", h, e)
            return None
        return None if desc is None else desc.to_bytes()

    def has_pending_push_work(self) -> bool:
        return False
