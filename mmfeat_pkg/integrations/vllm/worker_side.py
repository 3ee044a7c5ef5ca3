"""The connector's worker half: each rank loads the items the scheduler held for it into vLLM's encoder
cache, and the producer's first rank saves each encoder output into the pool under its key.

On a CPU rank a retained item (not a small one) is loaded as a view of the pool (views.py): no copy,
and the rank owes the scheduler's hold its ack until torch frees the view (vLLM dropped the entry), or
until the view is copied out before the hold's ack_ttl. Any other load is a private copy into the
encoder cache on the rank's device (``get(copy=True, device=...)``: device to device from a GPU pool),
acked behind that copy on the rank's current stream. A GPU rank copies even from a GPU pool on its own
device: the copy's memory comes from torch's caching allocator, already mapped, so a view would save
no page faults, only a pass at the GPU's bandwidth, while it kept pool bytes and owed an ack that must
wait for every stream that read it. A failed load is reported, never filled in. Every load the
metadata names is acked once, loaded or not, and the report counts the acks made or owed by a view,
and of which step, so that the scheduler gives back exactly the rest (books.py). A save is one
``put`` by the producer's first rank: the other ranks hold the same output.
"""

from __future__ import annotations

import hashlib
import json
import logging
import os
import time
from typing import Any, Callable, Optional

import torch

from mmfeat.client import Descriptor, MmfeatError
from mmfeat.protos import DescriptorError

from .metadata import StepLoads, StepReport
from .scheduler_side import has_many
from .settings import ConnectorSettings
from .views import Views

log = logging.getLogger("mmfeat.integrations.vllm")


class WorkerSide:
    def __init__(self, client: Any, namespace: Any, settings: ConnectorSettings, is_producer: bool,
                 is_consumer: bool, rank: Callable[[], int], device: Callable[[], torch.device]) -> None:
        self._client, self._ns, self._settings = client, namespace, settings
        self._producer, self._consumer = is_producer, is_consumer
        self._rank, self._device = rank, device
        self._report = StepReport()
        self.counters: dict[str, int] = {"saves": 0, "saves_inline": 0, "save_failures": 0, "loads": 0,
                                         "load_failures": 0, "bytes_saved": 0, "bytes_loaded": 0, "views": 0,
                                         "views_over_bound": 0, "views_copied_out": 0, "views_lost": 0}
        self._views = Views(client, settings.view_ttl_s, settings.view_max_bytes, settings.view_min_bytes,
                            self.counters)

    def save_caches(self, encoder_cache: dict[str, torch.Tensor], mm_hash: str) -> None:
        if not self._producer or self._rank() != 0:
            return
        self._save(encoder_cache[mm_hash], mm_hash)

    def start_save_caches(self, encoder_cache: dict[str, torch.Tensor], meta: Optional[StepLoads]) -> None:
        """Items the scheduler allocated that this rank already holds from an earlier step: vLLM will not
        encode them again, so ``save_caches`` never fires for them; save any the pool no longer has."""
        if not self._producer or meta is None or not meta.saves or self._rank() != 0:
            return
        cached = [h for h in meta.saves if h in encoder_cache]
        if not cached:
            return
        try:
            present = has_many(self._client, [self._ns.key(h) for h in cached])
        except MmfeatError as e:
            log.warning("mmfeat: lookup before saving again failed (%s)", e)
            return
        for h, there in zip(cached, present):
            if not there:
                self._save(encoder_cache[h], h)

    def _save(self, tensor: torch.Tensor, mm_hash: str) -> None:
        key = self._ns.key(mm_hash)
        try:
            # Waits for nothing: into the rank's arena, its key bound by a message the daemon reads before
            # it answers any lookup sent after this (so before the request's end, and any consumer's).
            if self._settings.lifetime == "retained":
                desc = self._client.put(tensor, key=key, retain_ttl=self._settings.retain_ttl_s, wait=False)
            else:
                desc = self._client.put(tensor, key=key, consumers=self._settings.consumers, wait=False)
        except MmfeatError as e:
            # The consumer then finds no item and encodes it itself: slower, never wrong.
            self.counters["save_failures"] += 1
            log.warning("mmfeat: save of %s failed (%s); consumers will encode it", mm_hash, e)
            return
        self.counters["saves"] += 1
        self.counters["bytes_saved"] += tensor.numel() * tensor.element_size()
        if desc.is_inline:
            # The pool did not take it (full of held items, daemon away): the bytes travel in the
            # descriptor, which reaches consumers only through ec_transfer_params.
            self.counters["saves_inline"] += 1
        self._report.saved[mm_hash] = desc.to_bytes()
        self._trace("save", mm_hash, tensor)

    def start_load_caches(self, encoder_cache: dict[str, torch.Tensor], meta: Optional[StepLoads]) -> None:
        if not self._consumer:
            return
        copied, lost = self._views.swap(encoder_cache)  # every step, before the model reads the cache
        self.counters["views_copied_out"] += copied
        self.counters["views_lost"] += lost
        if meta is None or not meta.loads:
            return
        device = self._device()
        stream = torch.cuda.current_stream(device) if device.type == "cuda" else None
        # The scheduler held a retained item for each rank; a counted one is protected by its consumer
        # count, whose clock started at the producer's publish, which no rank sees: it is copied.
        viewable = device.type == "cpu" and self._settings.lifetime == "retained"
        self._report.step = meta.step
        for h, blob in meta.loads.items():
            if h in encoder_cache:
                self._release(h, blob, stream)  # vLLM has it already (another request loaded it)
                self._report.loaded[h] = self._report.loaded.get(h, 0) + 1
                continue
            try:
                desc = Descriptor.from_bytes(blob)
                tensor = self._views.load(h, desc) if viewable else None
                viewed = tensor is not None
                if tensor is None:
                    tensor = self._client.get(desc, copy=True, device=device if device.type == "cuda" else None)
            except (MmfeatError, DescriptorError) as e:
                self.counters["load_failures"] += 1
                self._report.failed[h] = f"{e.code}: {e}" if hasattr(e, "code") else str(e)
                self._release(h, blob, stream)
                continue
            encoder_cache[h] = tensor
            if viewed:
                # Owed, not made: torch makes it when vLLM frees the view. The scheduler gives back
                # only what no rank acked or owes.
                self.counters["views"] += 1
                self._report.acked[h] = self._report.acked.get(h, 0) + 1
            else:
                self._release(h, blob, stream)
            self.counters["loads"] += 1
            self.counters["bytes_loaded"] += tensor.numel() * tensor.element_size()
            self._report.loaded[h] = self._report.loaded.get(h, 0) + 1
            self._trace("load", h, tensor)

    def _release(self, h: str, blob: bytes, stream: Any) -> None:
        try:
            self._client.ack(blob, after=stream)
        except MmfeatError as e:
            log.info("mmfeat: ack of %s: %s", h, e)
            return
        self._report.acked[h] = self._report.acked.get(h, 0) + 1

    def views_held(self) -> tuple[int, int]:
        """Views vLLM has not freed yet, and the pool bytes they keep."""
        return self._views.held()

    def close(self) -> None:
        self._views.close()

    def build_connector_worker_meta(self) -> Optional[StepReport]:
        report, self._report = self._report, StepReport()
        return report or None

    def _trace(self, op: str, mm_hash: str, tensor: torch.Tensor) -> None:
        """One JSON line per save and load, with a digest of the bytes, where ``report_file`` is set: how
        a test knows the loaded bytes are the saved ones without trusting our own counters."""
        path = self._settings.report_file
        if path is None:
            return
        data = tensor.detach().to("cpu").contiguous().view(torch.uint8).numpy().tobytes()
        line = {"op": op, "mm_hash": mm_hash, "pid": os.getpid(), "t": time.time(), "shape": list(tensor.shape),
                "dtype": str(tensor.dtype).removeprefix("torch."), "sha256": hashlib.sha256(data).hexdigest(),
                "counters": self.counters}
        with open(path, "a") as f:
            f.write(json.dumps(line) + "\n")
