"""The connector's scheduler half: which items the pool has, holds for the ranks that will load them,
and what to do with the workers' reports. It runs in vLLM's EngineCore process on a control-only
client, which maps no pool.

Per step, vLLM takes its requests one by one: ``ensure_cache_available`` for a request, then
``has_cache_item`` for each of its items in this step's token window that its own encoder cache
lacks, then ``update_state_after_alloc`` for each item it allocated encoder-cache space for (to load
or to encode), and ``build_connector_meta`` once after the last request. A True from
``has_cache_item`` commits the scheduler (the item gets no encoder budget and the runner will not
encode it), so it must be honest until the ranks have copied the item: a request's first
``ensure_cache_available`` looks its items up and holds the live ones in one request (``hold_many``),
so the answer comes with the hold that protects the item from eviction and from its TTL until each
rank acked it. What each load still owes the item is kept in ``LoadBooks`` (books.py), which settles it
by the load's own step's report whatever order vLLM finishes requests and applies reports in.

Round trips: one per new request with items to ask for (vLLM asks ``ensure_cache_available`` request
by request, answering each before it takes the next, so requests cannot share one), none for a running
request's later steps, and one per item that a request's later chunk first reaches. Holds of items
vLLM did not allocate (its own encoder cache had them, or the request did not run this step) are given
back at ``build_connector_meta``, as acks in the lease table: no round trip. A producer asks nothing
per item unless its daemon is meshed (``request_finished``). An item another node saved is pulled here
and held before the request is scheduled (pulls.py): one round trip per such item per step it waits.
"""

from __future__ import annotations

import base64
import logging
import time
from collections import Counter
from typing import Any, Optional, Protocol, Sequence

from mmfeat.client import MAX_LOOKUP_KEYS, Descriptor, MmfeatError

from .books import LoadBooks, Release
from .metadata import StepLoads, StepReport
from .pulls import PARAMS_KEY, Pulls
from .settings import ConnectorSettings

log = logging.getLogger("mmfeat.integrations.vllm")

__all__ = ["PARAMS_KEY", "SchedulerSide", "has_many"]
RETRY_S = 5.0  # how often an absent daemon is asked again for its node and mesh


class Feature(Protocol):  # vllm.multimodal.inputs.MultiModalFeatureSpec, as far as we read it
    identifier: str  # and mm_position (offset, length), where it has one


class Request(Protocol):  # vllm.v1.request.Request, as far as we read it
    request_id: str
    mm_features: Sequence[Feature]
    ec_transfer_params: Optional[dict[str, Any]]


def has_many(client: Any, keys: list[str]) -> list[bool]:
    """``client.has_many`` over any number of keys: one round trip per MAX_LOOKUP_KEYS of them."""
    return [hit for i in range(0, len(keys), MAX_LOOKUP_KEYS)
            for hit in client.has_many(keys[i:i + MAX_LOOKUP_KEYS])]


def _ahead(feature: Feature, num_computed_tokens: int) -> bool:
    """Whether vLLM may still want the item: its placeholders do not all lie in tokens already computed
    (vLLM's window starts there). One without a position may always be wanted."""
    pos = getattr(feature, "mm_position", None)
    return pos is None or pos.offset + pos.length > num_computed_tokens


class SchedulerSide:
    def __init__(self, client: Any, namespace: Any, settings: ConnectorSettings, is_producer: bool,
                 is_consumer: bool, loading_ranks: int) -> None:
        self._client, self._ns, self._settings = client, namespace, settings
        self._producer, self._consumer, self._ranks = is_producer, is_consumer, loading_ranks
        # This step's answers, mm_hash -> (descriptor bytes, held) or None for a miss: the descriptor is a
        # hold's (held) or a counted item's own.
        self._answers: dict[str, Optional[tuple[bytes, bool]]] = {}
        self._asked: set[str] = set()  # requests whose items were asked; their later steps ask nothing
        self._asked_now: set[str] = set()  # of those, the ones asked this step
        self.counters: Counter[str] = Counter()
        self._pulls = Pulls(client, settings, loading_ranks, self.counters)  # other nodes' items, pulled here
        self._delivered: dict[str, set[str]] = {}  # request id -> pulled items its ranks were sent to load
        self._loads: dict[str, bytes] = {}  # this step's loads, mm_hash -> the descriptor bytes its ranks ack
        self._saves: list[str] = []
        # Not reset per step: reports may come a step late (vLLM's async scheduling builds the next step
        # before the last one's output is in), and a request may end before its step's report.
        self._books = LoadBooks(loading_ranks)
        # Producer: what its running requests encode here (request id -> mm_hashes, and how many of them
        # want each), and the descriptors the workers reported saving for them, until they finish.
        self._saving: dict[str, set[str]] = {}
        self._wanted: Counter[str] = Counter()
        self._saved: dict[str, bytes] = {}
        self._node_id: Optional[str] = None
        self._meshed = False
        self._retry_at = 0.0
        self._unavailable: set[str] = set()
        self._start()

    def _start(self) -> None:
        """Open the session and learn the daemon's node and mesh now, not in the first step: the first
        hold pays for no handshake, and request_finished knows without asking whether a descriptor is
        worth asking for. A daemon that is away is no reason to stop the engine: it is asked again when
        needed, and meanwhile the model encodes its items itself."""
        try:
            self._client.connect()
        except MmfeatError as e:
            log.warning("mmfeat EC connector: no daemon yet (%s); lookups will retry", e)
            return
        self._daemon_known()

    def _daemon_known(self) -> bool:
        """Whether this daemon's node id and mesh are known, asking it (at most every RETRY_S) if not."""
        if self._node_id is not None:
            return True
        now = time.monotonic()
        if now < self._retry_at:
            return False
        self._retry_at = now + RETRY_S
        try:
            s = self._client.stats()
        except MmfeatError as e:
            log.warning("mmfeat: the daemon did not say its node (%s); asking again in %.0f s", e, RETRY_S)
            return False
        self._node_id, self._meshed = str(s["node"]), s.get("mesh") is not None
        return True

    # --- lookups ---------------------------------------------------------------------------------

    def ensure_cache_available(self, request: Request, num_computed_tokens: int) -> bool:
        if not self._consumer:
            return True
        rid = request.request_id
        if rid in self._unavailable:
            return False  # it fails at this step's end
        if request.ec_transfer_params:
            self._pulls.note(request, self._node_id if self._daemon_known() else None)
        wanted = dict.fromkeys(f.identifier for f in request.mm_features if _ahead(f, num_computed_tokens))
        # Another node's items first: until they are here and held, the request is not scheduled, and
        # nothing of this node's is held for it in vain.
        delivered = self._delivered.get(rid, ())
        pulls = [h for h in wanted if h in self._pulls.owners and h not in self._answers and h not in delivered]
        if pulls:
            held = self._pulls.wait(rid, pulls, self._answers)
            if held is None:
                self._unavailable.add(rid)
            if not held:
                return False
        if rid not in self._asked:
            self._asked.add(rid)
            self._asked_now.add(rid)
            ask = [h for h in wanted if h not in self._answers and h not in self._pulls.owners
                   and h not in self._pulls.inline]
            if ask:
                self._ask(ask)
        return True

    def has_cache_item(self, identifier: str) -> bool:
        if not self._consumer:
            return False
        if identifier in self._pulls.inline:
            return True
        if identifier not in self._answers:
            if identifier in self._pulls.owners:
                # Reached by a later chunk, its hold of an earlier step unused: here since, or pulled again.
                return bool(self._pulls.wait(None, [identifier], self._answers))
            self._ask([identifier])  # a running request's item that this step's chunk reaches first
        return self._answers[identifier] is not None

    def _ask(self, hashes: list[str]) -> None:
        """Look ``hashes`` up and hold the live ones for this step's loads: one round trip per
        MAX_LOOKUP_KEYS of them."""
        for i in range(0, len(hashes), MAX_LOOKUP_KEYS):
            part = hashes[i:i + MAX_LOOKUP_KEYS]
            # Saved here by its producer (its params said so): the key feed is about to bring it.
            wait = self._settings.feed_wait_s if any(h in self._pulls.saved_here for h in part) else 0.0
            try:
                found = self._client.hold_many([self._ns.key(h) for h in part], count=self._ranks, feed_wait=wait)
            except MmfeatError as e:
                # The daemon is away, or refused the holds (OVER_QUOTA, POOL_FULL): none was taken, and
                # the model encodes these items itself.
                log.warning("mmfeat: lookup failed (%s); encoding locally", e)
                found = [None] * len(part)
            for h, hit in zip(part, found):
                self._answers[h] = None if hit is None else (hit[0].to_bytes(), hit[1])
                self.counters["hits" if hit else "misses"] += 1

    # --- allocation and the step's metadata ------------------------------------------------------

    def update_state_after_alloc(self, request: Request, index: int) -> None:
        h = request.mm_features[index].identifier
        if self._producer and not self._consumer:
            self._saves.append(h)
            self._note_save(request.request_id, h)
            return
        if h in self._pulls.inline:
            self._add_load(request, h, self._pulls.inline[h].to_bytes(), held=False)
            return
        answer = self._answers.get(h)
        if answer is None:
            if self._producer:
                self._note_save(request.request_id, h)  # encoded here, then saved by the first rank
            return
        if h in self._loads:
            self._books.add(request.request_id, h, None)  # another request of this step loads it
            if h in self._pulls.owners:
                self._delivered.setdefault(request.request_id, set()).add(h)
            return
        # A hold (retained), or a counted item's own descriptor: each rank's ack is one of its consumers,
        # so the ranks read the item's descriptor and nothing else protects it.
        self.counters["holds"] += 1
        self._add_load(request, h, answer[0], held=True)
        owner = self._pulls.owners.get(h)
        if owner is not None:
            self._delivered.setdefault(request.request_id, set()).add(h)
            if self._settings.lifetime == "counted":
                # The ranks read and ack the hold on this node's copy; the owner's count of this load is
                # theirs, acked for them (relayed) now that the load is theirs.
                self._release(h, owner.to_bytes(), self._ranks, "owner_acks")

    def _add_load(self, request: Request, h: str, blob: bytes, held: bool) -> None:
        self._loads[h] = blob
        self._books.add(request.request_id, h, blob if held else None)

    def build_connector_meta(self, scheduler_output: Any) -> StepLoads:
        meta = StepLoads(loads=dict(self._loads), saves=list(self._saves), step=self._books.send())
        for h, answer in self._answers.items():
            if answer is not None and answer[1] and h not in self._loads:
                self._release(h, answer[0], self._ranks, "holds_unused")
        # A request asked this step that did not run asks again when it does: its holds went back. One
        # preempted starts over (vLLM freed its encoder cache entries).
        scheduled = getattr(scheduler_output, "num_scheduled_tokens", None)
        if scheduled is not None:
            self._asked.difference_update(self._asked_now.difference(scheduled))
        preempted = getattr(scheduler_output, "preempted_req_ids", None) or ()
        self._asked.difference_update(preempted)
        for rid in preempted:
            self._delivered.pop(rid, None)
        self._pulls.end_step()
        self._loads.clear()
        self._saves.clear()
        self._answers.clear()
        self._asked_now.clear()
        return meta

    # --- the workers' reports --------------------------------------------------------------------

    def update_connector_output(self, report: Optional[StepReport]) -> None:
        if not report:
            return
        # Only what a running request will ask for: vLLM finishes an encode-only request before it reads
        # the report of the step that saved its items.
        for h, blob in report.saved.items():
            if h in self._wanted:
                self._saved[h] = blob
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
            self._release(r.mm_hash, r.blob, r.units, "holds_released")

    def _release(self, h: str, blob: bytes, units: int, counter: str) -> None:
        try:
            self._client.ack(blob, count=units)  # into the lease table: no round trip
            self.counters[counter] += 1
        except MmfeatError as e:
            log.info("mmfeat: release of the hold on %s: %s", h, e)

    def unsettled_loads(self) -> int:
        """Held loads whose units are neither acked nor given back yet: none once the scheduler is idle."""
        return self._books.pending()

    def kept_descriptors(self) -> int:
        """Saved items' descriptors kept for producer requests still running: none once they finished."""
        return len(self._saved)

    def take_unavailable_requests(self) -> set[str]:
        out, self._unavailable = self._unavailable, set()
        return out

    def request_finished(self, request: Request) -> tuple[bool, Optional[dict[str, Any]]]:
        # vLLM finishes a request that stopped in the step that loaded it before it applies that step's
        # report (Scheduler.update_from_output), and an abort may come while a step that loads for it is
        # on the ranks: the books give back now only what a report already settled.
        self._give_back(self._books.finish(request.request_id))
        self._asked.discard(request.request_id)
        self._delivered.pop(request.request_id, None)
        self._unavailable.discard(request.request_id)
        self._pulls.finished(request)
        if not self._producer:
            return False, None
        items: dict[str, Any] = {}
        encoded = self._saving.get(request.request_id, ())
        for h in dict.fromkeys(f.identifier for f in request.mm_features):
            blob = self._saved.get(h)
            if blob is None and self._daemon_known() and self._meshed:
                blob = self._lookup_saved(h)
            if blob is not None:
                items[h] = {PARAMS_KEY: {"desc": base64.b64encode(blob).decode("ascii"),
                                         "node": Descriptor.from_bytes(blob).node}}
            elif h in encoded and self._node_id is not None:
                # Saved here by a step whose report has not come back: a consumer on this node finds it by
                # its key (the key feed), and knows to wait for the feed rather than ask the daemon.
                items[h] = {PARAMS_KEY: {"node": self._node_id}}
        for h in self._saving.pop(request.request_id, ()):
            self._wanted[h] -= 1
            if not self._wanted[h]:
                del self._wanted[h]
                self._saved.pop(h, None)
        return False, items or None

    def _note_save(self, rid: str, h: str) -> None:
        saving = self._saving.setdefault(rid, set())
        if h not in saving:
            saving.add(h)
            self._wanted[h] += 1

    def _lookup_saved(self, h: str) -> Optional[bytes]:
        """The descriptor of an item saved by a step whose report has not come back (vLLM finishes an
        encode-only request in the step that encoded it, before it reads the workers' reports), for a
        consumer on another node, which can reach this one only through a mesh: one round trip per
        item. A consumer on this node looks the key up itself."""
        try:
            desc = self._client.lookup(self._ns.key(h))
        except MmfeatError as e:
            log.info("mmfeat: lookup of saved %s: %s", h, e)
            return None
        return None if desc is None else desc.to_bytes()

    def has_pending_push_work(self) -> bool:
        return False
