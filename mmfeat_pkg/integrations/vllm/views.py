"""The retained items a CPU rank hands vLLM as views of the pool, not copies, and how long each stays one.

A view costs no pass over the bytes: vLLM's first read of it (the gather into the input embeddings) is
the load's only one, where a copy writes every byte into fresh pages first and faults each one in. The
view is pool memory, so the item must stay while vLLM can read it. The rank owes the scheduler's hold
its ack and makes it when torch frees the view's storage: vLLM dropped the encoder-cache entry (the
runner pops it when the scheduler frees it) and every slice the model took of it. The view's storage
carries the ack (``client/gpu/dlpack.keep_alive``), so no slice outlives it; on a CPU nothing reads it
after that.

A hold ends after the daemon's ack_ttl even while its holder lives, and vLLM keeps an entry until its
encoder cache needs the room, which may be long after the last request that used it. So a view lives
at most ``view_ttl_s`` (half the ack_ttl, or less): then a thread of this rank copies the item out of
the pool while the hold still protects it, and at the start of the rank's next step, before the model
reads anything, the copy takes the view's place in the encoder cache and the view dies, which acks.
An engine that sits idle meanwhile keeps the copy ready until it steps again. A copy that finds the
hold gone (this process did not run for half an ack_ttl) holds no proof of its bytes: the entry is
dropped instead, and vLLM fails on it rather than reading other bytes. Each step checks every view's
hold too, before the model reads, since a process resumed after a stop may run its step before the
copy-out thread.

While a view lives, its item's bytes stay in the pool whatever the pool needs: eviction cannot take a
held item. vLLM's encoder cache bounds what a rank keeps, but not in pool bytes, so a rank's views keep
at most ``view_max_bytes`` of the pool (a quarter of it by default); a load past that is copied. So
is an item under ``view_min_bytes``: torch gives a small copy memory already faulted in, and the copy
costs less than a view's bookkeeping.
"""

from __future__ import annotations

import collections
import dataclasses
import logging
import math
import os
import threading
import time
import weakref
from typing import Any, Optional

import torch

from mmfeat.client import Descriptor
from mmfeat.client.gpu.dlpack import keep_alive
from mmfeat.client.link.lease_table import STATE_FREE

log = logging.getLogger("mmfeat.integrations.vllm")

STOP_WAIT_S = 5.0  # how long close() waits for a copy-out under way


@dataclasses.dataclass(eq=False)
class _View:
    mm_hash: str
    desc: Descriptor  # the hold's descriptor, which the rank acks once
    source: torch.Tensor  # the pool view get() made: it keeps the pool mapped while vLLM's view lives
    table: Any  # the lease table the hold lives in: whether it still protects the bytes
    due: float  # when the copy-out starts (time.monotonic)
    ref: Optional["weakref.ref[torch.Tensor]"] = None  # the tensor vLLM holds
    taken: bool = False  # the copy-out thread took it
    copy: Optional[torch.Tensor] = None  # the private copy, ready to take the view's place
    lost: bool = False  # the hold ended before the copy was proven: the entry goes
    gone: bool = False  # torch freed the view's storage (and its ack was made)

    def live(self) -> bool:
        d = self.desc
        return self.table.state(d.lease, d.gen, d.pool, d.offset, d.nbytes) > STATE_FREE


class _Ack:
    """The owner a view's storage keeps: torch frees it with the last tensor over those bytes."""

    def __init__(self, views: "Views", record: _View) -> None:
        self._views, self._record = views, record
        self._pid = os.getpid()

    def __del__(self) -> None:
        # Runs wherever torch frees the storage (any thread, inside a garbage collection too): a flag
        # and the client's finaliser ack, which takes no lock. A fork copies the view, not the duty to
        # ack (as a Parcel's): a child dropping its copy would end the hold the rank's view still needs.
        if self._pid == os.getpid():
            self._views._released(self._record)


class Views:
    def __init__(self, client: Any, view_ttl_s: Optional[float], view_max_bytes: Optional[int],
                 view_min_bytes: int, counters: dict[str, int]) -> None:
        self._client = client
        self._ttl = view_ttl_s
        self._max_bytes, self._min_bytes = view_max_bytes, view_min_bytes
        self._counters = counters  # the worker's: views_over_bound counts loads copied for the bound
        self._live: list[_View] = []  # views handed over and not yet freed; under _cond
        self._ready: collections.deque[_View] = collections.deque()  # copied out (or lost), to be swapped
        self._cond = threading.Condition()
        self._thread: Optional[threading.Thread] = None
        self._wake_at = -math.inf  # when the copy-out thread wakes by itself (inf: only when notified)
        self._closed = False

    def load(self, mm_hash: str, desc: Descriptor) -> Optional[torch.Tensor]:
        """A view of the held item ``desc`` names, whose storage acks the hold when torch frees it; None
        where the rank copies instead (another node's item, an inline one, a GPU pool, several tensors,
        one under ``view_min_bytes``, or views already keeping ``view_max_bytes`` of the pool). Raises
        what get raises for an item that is gone."""
        if desc.is_inline or desc.many or desc.nbytes < self._min_bytes:
            return None
        session = self._client.session
        pool = session.pools.get(desc.pool)
        if desc.node != session.node or pool is None or pool.kind != "host":
            return None
        bound = pool.size // 4 if self._max_bytes is None else self._max_bytes
        if self.held()[1] + desc.nbytes > bound:
            self._counters["views_over_bound"] = self._counters.get("views_over_bound", 0) + 1
            return None
        source = self._client.get(desc)
        ttl = session.ack_ttl / 2 if self._ttl is None else min(self._ttl, session.ack_ttl / 2)
        record = _View(mm_hash, desc, source, session.table, time.monotonic() + ttl)
        view = keep_alive(source, _Ack(self, record))
        record.ref = weakref.ref(view)
        with self._cond:
            self._live = [r for r in self._live if not r.gone]
            self._live.append(record)
            if self._thread is None:
                self._thread = threading.Thread(target=self._copy_out_when_due, name="mmfeat-vllm-views",
                                                daemon=True)
                self._thread.start()
            elif record.due < self._wake_at:
                # Only then: a thread woken at each load costs the runner's thread a switch per load.
                self._cond.notify()
        return view

    def swap(self, encoder_cache: dict[str, torch.Tensor]) -> tuple[int, int]:
        """On the runner's thread, before the step reads the encoder cache: each view copied out gives
        its place to its copy (a lost one's entry goes). The numbers of copies swapped in and of entries
        dropped."""
        copied = lost = 0
        while self._ready:
            record = self._ready.popleft()
            copy, record.copy = record.copy, None
            view = record.ref() if record.ref is not None else None
            if view is not None and encoder_cache.get(record.mm_hash) is view:
                if copy is not None:
                    encoder_cache[record.mm_hash] = copy
                    copied += 1
                else:
                    del encoder_cache[record.mm_hash]
                    lost += 1
            del view  # may be the last reference: its storage's owner acks the hold now
        # A view whose hold ended before the copy-out thread got to it: a process that did not run for
        # an ack_ttl wakes with both threads ready, and the kernel may run this one first. The model
        # must not read it (the pool may have given its bytes to another item): its entry goes now.
        with self._cond:
            pending = [r for r in self._live if not r.gone and r.copy is None and not r.lost]
        for record in pending:
            if record.live():
                continue
            record.lost = True
            view = record.ref() if record.ref is not None else None
            if view is not None and encoder_cache.get(record.mm_hash) is view:
                del encoder_cache[record.mm_hash]
                lost += 1
                log.error("mmfeat: the hold on %s ended while its view was in the encoder cache (this process did "
                          "not run for the daemon's ack_ttl); its entry is dropped, and a request that needs it "
                          "fails", record.mm_hash)
            del view
        return copied, lost

    def held(self) -> tuple[int, int]:
        """Views not yet freed, and the pool bytes they keep."""
        with self._cond:
            live = [r for r in self._live if not r.gone]
        return len(live), sum(r.desc.nbytes for r in live)

    def close(self) -> None:
        """Stop the copy-out thread. Views still in vLLM's cache stay valid: each acks when it is freed."""
        with self._cond:
            self._closed = True
            self._cond.notify()
            thread = self._thread
        if thread is not None:
            thread.join(STOP_WAIT_S)
        self._ready.clear()

    def _released(self, record: _View) -> None:
        record.gone = True
        try:
            # Not an ack of a hold that already ended (its ack_ttl passed while the engine was idle): the
            # daemon would count it as one too many.
            if record.live():
                self._client._ack_in_finalizer(record.desc)
        except Exception:
            pass  # interpreter shutdown or a gone daemon: the hold ends with the scheduler's session

    def _copy_out_when_due(self) -> None:
        while True:
            with self._cond:
                self._live = [r for r in self._live if not r.gone]
                if self._closed:
                    return
                now = time.monotonic()
                waiting = [r for r in self._live if not r.taken]
                due = [r for r in waiting if r.due <= now]
                if not due:
                    self._wake_at = min((r.due for r in waiting), default=math.inf)
                    self._cond.wait(None if self._wake_at == math.inf else self._wake_at - now)
                    self._wake_at = -math.inf  # awake: it reads the list again before it waits
                    continue
                for r in due:
                    r.taken = True
            for r in due:
                self._copy_out(r)

    def _copy_out(self, record: _View) -> None:
        if record.gone or record.lost:
            return  # freed, or its entry already dropped by a step (swap)
        copy = record.source.clone()  # while the hold protects the bytes
        if record.gone:
            return  # vLLM let the view go meanwhile: the copy is not needed
        if record.live():
            record.copy = copy
        else:
            record.lost = True
            log.error("mmfeat: the hold on %s ended before its view was copied out (this process did not run "
                      "for half the daemon's ack_ttl); its encoder-cache entry is dropped, and a request that "
                      "needs it fails", record.mm_hash)
        self._ready.append(record)
