"""The ``ray`` mode of ``mmfeat bench``: the same handoff done the way a Ray user does it.

The driver is the producer, as in a Ray application whose main process makes the data: it ``ray.put``s
each feature (a numpy array, which Ray's object store hands back zero-copy; a torch tensor would be
pickled and copied on every get) and calls each consumer actor with the ObjectRef inside a list, so
that the actor receives the reference and ``ray.get``s it itself, as it would a handle in its own
message. The actor reads every byte as the other modes' consumers do and returns (feature, held_at,
read_at), which fill the same row columns. Ray runs privately: started once per bench invocation, out
of the timed region, and shut down at the end.
"""

from __future__ import annotations

import importlib.util
import logging
import os
import time
from pathlib import Path
from typing import Any, Callable, Optional

from .report import MiB, make_row
from .workers import Job, read_every_byte

MODE = "ray"
INSTALL_HINT = "pip install 'mmfeat[ray]' (or drop ray from --modes)"
# Long enough for a 64 MiB feature on a busy two-core machine; a stuck actor ends the bench instead of hanging it.
_WAIT_S = 600.0


def ray_missing() -> Optional[str]:
    """None when Ray can be imported, else why not. Looks Ray up without importing it (seconds)."""
    try:
        found = importlib.util.find_spec("ray") is not None
    except (ImportError, ValueError) as exc:
        return f"ray cannot be imported ({exc})"
    return None if found else "ray is not installed"


class _Consumer:
    """One consumer process: a Ray actor, its methods run one at a time in call order."""

    def __init__(self, threads: int) -> None:
        import warnings

        import torch

        torch.set_num_threads(threads)
        # ray.get hands back a read-only view of the object store; reading it is all this actor does.
        warnings.filterwarnings("ignore", message="The given NumPy array is not writable")

    def pid(self) -> int:
        return os.getpid()

    def cpu_seconds(self) -> float:
        return time.process_time()

    def read(self, boxed: list, i: int) -> tuple[int, float, float]:
        import ray
        import torch

        got = torch.from_numpy(ray.get(boxed[0]))
        held_at = time.monotonic()
        read_every_byte(got)
        del got
        return i, held_at, time.monotonic()


def _children() -> dict[int, list[int]]:
    out: dict[int, list[int]] = {}
    for entry in os.listdir("/proc"):
        if not entry.isdigit():
            continue
        try:
            with open(f"/proc/{entry}/stat") as f:
                ppid = int(f.read().rsplit(")", 1)[1].split()[1])
        except (OSError, ValueError, IndexError):
            continue  # gone since listdir
        out.setdefault(ppid, []).append(int(entry))
    return out


def _descendants(roots: set[int]) -> set[int]:
    children, seen, todo = _children(), set(), list(roots)
    while todo:
        pid = todo.pop()
        if pid not in seen:
            seen.add(pid)
            todo += children.get(pid, [])
    return seen


class RaySession:
    """A private local Ray for one bench invocation, and its consumer actors for one consumer count."""

    def __init__(self, max_size: int, window: int, threads: int, temp_dir: Path,
                 cpu_seconds: Callable[[int], Optional[float]]) -> None:
        """``cpu_seconds(pid)``: the CPU time of every thread of a process, as the bench reads mmfeatd's."""
        # Before ray is imported: it reads its configuration once, at import.
        os.environ.setdefault("RAY_USAGE_STATS_ENABLED", "0")  # no prompt, no report home from a benchmark
        # Ray's default for a new local cluster (a token in ~/.ray), said explicitly so it does not warn.
        os.environ.setdefault("RAY_AUTH_MODE", "token")
        import ray

        self._ray, self._threads, self._cpu_seconds = ray, threads, cpu_seconds
        self._actors: list[Any] = []
        self._actor_pids: set[int] = set()
        before = _descendants({os.getpid()})
        try:
            ray.init(
                address="local",  # never a cluster this machine happens to run
                num_cpus=os.cpu_count() or 1,
                # The window twice over (a feature's object is freed once its last reader returns) and room
                # for Ray's own objects; Ray refuses less than 75 MiB.
                object_store_memory=max(96 * MiB, max_size * (2 * window + 4)),
                include_dashboard=False,
                log_to_driver=False,
                logging_level=logging.WARNING,
                _temp_dir=str(temp_dir),
            )
        except Exception as exc:  # Ray raises what its failing part raised; the bench says what it was doing
            ray.shutdown()  # what did start, stopped
            raise SystemExit(f"mmfeat bench: could not start a private Ray in {temp_dir}: {exc}") from None
        # gcs_server, raylet (with the object store), their agents; workers the raylet starts later descend from it.
        self._ray_roots = _descendants({os.getpid()}) - before

    def _consumers(self, n: int) -> list[Any]:
        """``n`` actors, made once per consumer count: each start is a new process."""
        if len(self._actors) != n:
            for a in self._actors:
                self._ray.kill(a)
            # num_cpus=0: consumers share the cores as the other modes' processes do, whatever their count.
            cls = self._ray.remote(num_cpus=0)(_Consumer)
            self._actors = [cls.remote(self._threads) for _ in range(n)]
            self._actor_pids = set(self._get([a.pid.remote() for a in self._actors]))
        return self._actors

    def _get(self, refs: list) -> list:
        return self._ray.get(refs, timeout=_WAIT_S)

    def _ray_cpu(self, pids: Optional[set[int]] = None) -> dict[int, float]:
        """CPU seconds of each of Ray's own processes (not the driver, not the consumers), or of ``pids``
        of them: they are to the ray row what mmfeatd is to the pool's rows."""
        if pids is None:
            pids = _descendants(self._ray_roots) - self._actor_pids
        return {pid: s for pid in pids if (s := self._cpu_seconds(pid)) is not None}

    def row(self, job: Job, n: int) -> dict[str, Any]:
        """One row of ``job`` handed to ``n`` consumer actors, columns as the other modes fill them."""
        try:
            return self._row(job, n)
        except self._ray.exceptions.RayError as exc:
            raise SystemExit(f"mmfeat bench: the ray mode failed at {job.size} bytes, {n} consumer(s): {exc}") from None

    def _row(self, job: Job, n: int) -> dict[str, Any]:
        import torch

        ray = self._ray
        actors = self._consumers(n)
        payload = torch.randint(0, 255, (job.size,), dtype=torch.uint8)
        total = job.count + job.warmup
        sent_at: list[float] = []
        held_at: dict[int, list[float]] = {}
        read_at: dict[int, list[float]] = {}
        pending: list[Any] = []
        acked = 0

        def collect() -> None:
            """Wait for a consumer's result, then take every result that is in."""
            nonlocal pending, acked
            ready, pending = ray.wait(pending, num_returns=1, timeout=_WAIT_S)
            more, pending = ray.wait(pending, num_returns=len(pending), timeout=0) if pending else ([], [])
            ready += more
            if not ready:
                raise SystemExit(f"mmfeat bench: a ray consumer returned nothing in {_WAIT_S:.0f} s")
            for i, th, t1 in self._get(ready):
                held_at.setdefault(i, []).append(th)
                read_at.setdefault(i, []).append(t1)
            while len(read_at.get(acked, ())) == n:
                acked += 1

        cpu0, consumers0, ray0 = 0.0, [], {}
        for i in range(total):
            if i == job.warmup:
                while acked < i:
                    collect()
                # The CPU columns start once every consumer has read the warm-up, as the other modes' do.
                consumers0 = self._get([a.cpu_seconds.remote() for a in actors])
                ray0, cpu0 = self._ray_cpu(), time.process_time()
            while i - acked >= job.window:
                collect()
            t0 = time.monotonic()
            ref = ray.put(payload.numpy())
            # Inside a list: each actor gets the reference, not the array, and fetches it itself.
            pending += [a.read.remote([ref], i) for a in actors]
            del ref  # the calls hold it now: Ray frees the object once the last reader has returned
            # Results are collected only when the window is full: each carries its own read time, and
            # polling Ray every feature would charge the producer for calls a user's loop need not make.
            sent_at.append(t0)
        while acked < total:
            collect()
        # The processes Ray had at the warm-up's end: one it started since would bring its start-up along.
        cpu1, ray1 = time.process_time(), self._ray_cpu(set(ray0))
        consumers1 = self._get([a.cpu_seconds.remote() for a in actors])
        first = job.warmup
        row = make_row(MODE, job.size, n, [max(read_at[i]) - sent_at[i] for i in range(first, total)],
                       max(max(read_at[i]) for i in range(first, total)) - sent_at[first],
                       [min(held_at[i]) - sent_at[i] for i in range(first, total)])
        row["producer_cpu_us"] = (cpu1 - cpu0) / job.count * 1e6
        row["consumer_cpu_us"] = sum(b - a for a, b in zip(consumers0, consumers1)) / n / job.count * 1e6
        row["daemon_cpu_us"] = sum(ray1[p] - ray0[p] for p in ray1) / job.count * 1e6 if ray1 else None
        return row

    def close(self) -> None:
        self._ray.shutdown()
