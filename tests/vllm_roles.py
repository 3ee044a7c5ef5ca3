"""vLLM's side of the EC connector framework, played by separate processes in the framework's call order
(../shared/research/vllm-ec.md, section 1.2), for tests that need no vLLM: an engine process runs the
connector's scheduler half on a control-only client and starts one process per worker rank, which run
the worker half on a client of their own. The step metadata goes to the ranks pickled, as vLLM's
executor broadcasts it, and their reports come back pickled and aggregated, as vLLM's aggregator does.

An item's "encoder output" is a function of its mm_hash, so any rank can tell whether what it loaded is
the item's own bytes.
"""

from __future__ import annotations

import dataclasses
import gc
import hashlib
import multiprocessing
import os
import signal
from types import SimpleNamespace
from typing import Any, Optional

import torch

from mmfeat.client import Client, Namespace
from mmfeat.client.gpu.dlpack import live_capsules
from mmfeat.integrations.vllm import ConnectorSettings, StepLoads, StepReport
from mmfeat.integrations.vllm.scheduler_side import SchedulerSide
from mmfeat.integrations.vllm.worker_side import WorkerSide

NS = dict(framework="vllm", version="test", model="tiny-qwen2-vl", dtype="bfloat16")


def encoder_output(mm_hash: str, tokens: int = 64) -> torch.Tensor:
    """What the encoder makes of an item: a (tokens, 256) bf16 tensor seeded by its hash (32 KiB), or as
    many tokens as a hash that ends in "@N" names (N x 512 bytes)."""
    if "@" in mm_hash:
        tokens = int(mm_hash.rsplit("@", 1)[1])
    seed = int.from_bytes(hashlib.sha256(mm_hash.encode()).digest()[:8], "little")
    return torch.randn(tokens, 256, generator=torch.Generator().manual_seed(seed)).to(torch.bfloat16)


@dataclasses.dataclass
class Feature:
    identifier: str


@dataclasses.dataclass
class Request:
    request_id: str
    mm_features: list[Feature]
    ec_transfer_params: Optional[dict[str, Any]] = None


def _rank_main(runtime_dir: str, settings: ConnectorSettings, role: tuple[bool, bool], rank: int,
               inbox: Any, outbox: Any) -> None:
    """One worker rank: each step, load what the scheduler held, "encode" the rest, save (rank 0 of a
    producer) and report. Sends ("done", rank, loaded-and-checked count) when told to stop."""
    producer, consumer = role
    with Client(runtime_dir, inline_threshold=0) as client:
        worker = WorkerSide(client, Namespace(**NS, prefix=settings.namespace), settings, producer, consumer,
                            lambda: rank, lambda: torch.device("cpu"))
        cache: dict[str, torch.Tensor] = {}
        checked = 0
        while True:
            msg = inbox.get(timeout=60)
            if msg[0] == "stop":
                worker.close()
                outbox.put(("done", rank, checked))
                return
            if msg[0] in ("die_before_ack", "die"):
                # Not while this rank's queue thread may still hold the outbox's lock on a report it sent
                # earlier: the lock would stay taken and no other rank could report again.
                outbox.close()
                outbox.join_thread()
                os.kill(os.getpid(), signal.SIGKILL)
            if msg[0] == "fork":
                # A child forked with the encoder cache (a compile or data worker, say) drops its copy of
                # every entry and flushes: the views it inherited are not its to ack.
                child = os.fork()
                if child == 0:
                    code = 1
                    try:
                        cache.clear()
                        gc.collect()
                        client.flush()
                        code = 0
                    finally:
                        os._exit(code)
                _, status = os.waitpid(child, 0)
                outbox.put(("forked", rank, os.waitstatus_to_exitcode(status)))
                continue
            if msg[0] == "lock_copy_out":
                # The copy-out thread does not run (a stopped process resumed: which of its threads runs
                # first is the kernel's choice): this thread takes the lock it needs, until "locked_step".
                worker._views._cond.acquire()
                outbox.put(("locked", rank))
                continue
            if msg[0] == "locked_step":
                # A step while the copy-out thread still cannot run: the entries whose bytes are not their
                # item's are reported, not asserted (the rank lives on to report).
                try:
                    worker.start_load_caches(cache, msg[1])
                    wrong = sorted(h for h, t in cache.items() if not torch.equal(t, encoder_output(h)))
                finally:
                    worker._views._cond.release()
                outbox.put(("stepped", rank, wrong, {**worker.counters, **_cache_state(client, worker, cache)}))
                continue
            if msg[0] == "free":
                # The scheduler freed these entries (free_encoder_mm_hashes): the runner pops them, and a
                # view's ack goes with its last reference.
                for h in msg[1]:
                    cache.pop(h, None)
                client.flush()
                outbox.put(("freed", rank, _cache_state(client, worker, cache)))
                continue
            _, meta, compute = msg
            worker.start_save_caches(cache, meta)
            worker.start_load_caches(cache, meta)
            if msg[0] == "load_then_stop":
                os.kill(os.getpid(), signal.SIGSTOP)  # as if this process did not run for a while
            for h in meta.loads:
                if h in cache:
                    assert torch.equal(cache[h], encoder_output(h)), f"rank {rank} loaded wrong bytes for {h}"
                    checked += 1
            for h in compute:
                if h not in cache:
                    cache[h] = encoder_output(h)
                    worker.save_caches(cache, h)
            _check(rank, cache)
            # The daemon has applied this rank's acks before the scheduler reads its report, so a test
            # reads the daemon's books at a point where nothing is still on its way.
            client.flush()
            outbox.put(("report", rank, worker.build_connector_worker_meta(),
                        {**worker.counters, **_cache_state(client, worker, cache)}))


def _check(rank: int, cache: dict[str, torch.Tensor]) -> None:
    """Every entry (a view, a copy swapped in for one, an encoder output) holds its item's own bytes.
    A function, so that no loop variable keeps a view alive after the rank dropped it."""
    for h, t in cache.items():
        assert torch.equal(t, encoder_output(h)), f"rank {rank} holds wrong bytes for {h}"


def _cache_state(client: Client, worker: WorkerSide, cache: dict[str, torch.Tensor]) -> dict[str, Any]:
    """What the rank's encoder cache holds: which entries lie in the pool's mapping (views), the views
    the connector counts as not yet freed, with their bytes, the rank's open fds, and the tensors over
    memory torch does not own that it has not freed (each view is one)."""
    pools = [m.tensor for (_, device), m in client.session.mappings.items() if device == -1]
    in_pool = sorted(h for h, t in cache.items()
                     if any(p.data_ptr() <= t.data_ptr() < p.data_ptr() + p.numel() for p in pools))
    held, held_bytes = worker.views_held()
    return {"cached": sorted(cache), "in_pool": in_pool, "views_held": held, "view_bytes_held": held_bytes,
            "fds": len(os.listdir("/proc/self/fd")), "capsules": live_capsules()}


class Engine:
    """One vLLM instance: the scheduler half here, ``ranks`` worker processes beside it."""

    def __init__(self, runtime_dir: str, settings: ConnectorSettings, producer: bool, consumer: bool,
                 ranks: int = 1, ctx: Any = None, feed: bool = False) -> None:
        ctx = ctx or multiprocessing.get_context("spawn")
        # ``feed``: the scheduler follows the key feed of its namespace, as the connector's consumer does.
        prefix = Namespace(**NS, prefix=settings.namespace).id + "/" if feed else None
        self.client = Client(runtime_dir, map_pools=False, key_feed=prefix)
        self.side = SchedulerSide(self.client, Namespace(**NS, prefix=settings.namespace), settings, producer,
                                  consumer, ranks)
        self.outbox = ctx.Queue()
        self.inboxes = [ctx.Queue() for _ in range(ranks)]
        self.procs = [ctx.Process(target=_rank_main, args=(runtime_dir, settings, (producer, consumer), r,
                                                           self.inboxes[r], self.outbox), daemon=True)
                      for r in range(ranks)]
        for p in self.procs:
            p.start()
        self.counters: dict[int, dict[str, int]] = {}

    def schedule(self, requests: list[Request]) -> tuple[StepLoads, list[str]]:
        """The scheduler's part of one step, as vLLM calls it: ensure, has, alloc, build."""
        compute: list[str] = []
        scheduled: dict[str, int] = {}
        for req in requests:
            if not self.side.ensure_cache_available(req, 0):
                continue
            for i, f in enumerate(req.mm_features):
                if not self.side.has_cache_item(f.identifier):
                    compute.append(f.identifier)
                self.side.update_state_after_alloc(req, i)
            scheduled[req.request_id] = 1
        # What the connector reads of vLLM's SchedulerOutput: the requests that ran this step.
        so = SimpleNamespace(num_scheduled_tokens=scheduled, preempted_req_ids=set())
        return self.side.build_connector_meta(so), compute

    def decode(self, requests: list[Request]) -> StepLoads:
        """A later step of requests that run on: vLLM asks ensure_cache_available of each, and nothing
        more of their items (its encoder cache has them, or their tokens are computed), then builds
        the step's metadata."""
        for req in requests:
            assert self.side.ensure_cache_available(req, 1 << 20)
        so = SimpleNamespace(num_scheduled_tokens={r.request_id: 1 for r in requests}, preempted_req_ids=set())
        return self.side.build_connector_meta(so)

    def run(self, meta: StepLoads, compute: list[str], kill_rank: Optional[int] = None,
            apply: bool = True) -> StepReport:
        """The ranks' part of one step and (``apply``) the scheduler's reading of their aggregated
        reports; without ``apply`` the caller hands the report to the scheduler when it chooses."""
        for r, box in enumerate(self.inboxes):
            box.put(("die_before_ack",) if r == kill_rank else ("step", meta, compute))
        report = StepReport()
        for _ in range(len(self.inboxes) - (kill_rank is not None)):
            _, rank, part, counters = self.outbox.get(timeout=60)
            self.counters[rank] = counters
            if part is not None:
                report = report.aggregate(part)
        if kill_rank is not None:
            self.procs[kill_rank].join(60)
        if apply:
            self.side.update_connector_output(report)
        return report

    def free(self, hashes: list[str], ranks: Optional[list[int]] = None) -> None:
        """The scheduler frees these encoder-cache entries: the runners of ``ranks`` (all) pop them."""
        ranks = list(range(len(self.inboxes))) if ranks is None else ranks
        for r in ranks:
            self.inboxes[r].put(("free", hashes))
        for _ in ranks:
            _, rank, state = self.outbox.get(timeout=60)
            self.counters[rank] = {**self.counters.get(rank, {}), **state}

    def kill(self, rank: int) -> None:
        """SIGKILL one rank between steps, whatever its encoder cache holds."""
        self.inboxes[rank].put(("die",))
        self.procs[rank].join(60)

    def step(self, requests: list[Request]) -> StepReport:
        meta, compute = self.schedule(requests)
        return self.run(meta, compute)

    def finish(self, requests: list[Request]) -> list[Optional[dict[str, Any]]]:
        out = [self.side.request_finished(r)[1] for r in requests]
        self.client.flush()  # what the scheduler gave back is in the daemon's books before the next event
        return out

    def end_step(self, requests: list[Request], report: StepReport, finish_first: bool) -> None:
        """The end of a step in which ``requests`` loaded and finished (a prefill-only instance's):
        vLLM's update_from_output finishes them before it applies the step's report
        (``finish_first``); a request that lives on, or one aborted later, sees the report first."""
        if finish_first:
            self.finish(requests)
            self.side.update_connector_output(report)
            self.client.flush()
        else:
            self.side.update_connector_output(report)
            self.finish(requests)

    def close(self) -> int:
        """Stops the ranks; the number of loads they checked against the item's own bytes."""
        checked = 0
        alive = [r for r, p in enumerate(self.procs) if p.is_alive()]
        for r in alive:
            self.inboxes[r].put(("stop",))
        for _ in alive:
            msg = self.outbox.get(timeout=60)
            if msg[0] == "done":
                checked += msg[2]
        for p in self.procs:
            p.join(30)
        self.client.close()
        return checked
