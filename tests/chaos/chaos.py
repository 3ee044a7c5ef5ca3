"""``make chaos``: producers and consumers SIGKILLed at random under load, the daemon SIGKILLed and
restarted, every byte checked. Prints what was tried and what held; exits 1 if a wrong byte was read,
bytes stayed leased after the TTLs, or the daemon grew fds or memory.

    python -m tests.chaos.chaos --seconds 120 --producers 3 --consumers 3

With ``--nodes 2`` two daemons on 127.0.0.1 play two nodes, meshed: producers on node a, consumer c0
on a and the others on b, which pull every feature they read; either daemon is killed and restarted.
With ``--backend cuda_vmm`` (a GPU node) the pools are in GPU 0's memory and the workers put and check
CUDA tensors (tests/gpu/run.sh runs it).

With ``--staged N`` N more processes read retained features by key into GPU 0's memory, staged from the
host pool's pinned pages behind GPU work, and check every byte (tests/chaos/staged_worker.py); on a
machine without a GPU they run on the fake driver (tests/fake_cuda), built here. With a small
``--pool-mb`` the keyed producers' puts evict retained features all along: the run then fails if no
daemon evicted any, since the staged reads were not under the pressure they are there to meet.
"""

from __future__ import annotations

import argparse
import json
import os
import random
import shutil
import signal
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Optional

from tests.conftest import anon_bytes, fd_count, start_daemon

RESERVE_TTL, ACK_TTL = 3.0, 6.0
# Mid-run the one-node daemon is reloaded (SIGHUP) with these TTLs, and later with the usual ones again:
# leases granted under either keep their deadlines, and producers time their publishes by them.
LOW_RESERVE_TTL, LOW_ACK_TTL = 0.5, 2.0


def _write_config(path: Path, reserve_ttl: float, ack_ttl: float, pool_mb: int) -> None:
    path.write_text(f"[mmfeatd]\npool_mb = {pool_mb}\nreserve_ttl = {reserve_ttl}\nack_ttl = {ack_ttl}\n")


def _spawn(args: list[str], device: str, module: str = "tests.chaos.worker",
           env: Optional[dict[str, str]] = None) -> subprocess.Popen:
    return subprocess.Popen([sys.executable, "-m", module, *args], stdout=subprocess.DEVNULL,
                            stderr=subprocess.DEVNULL, start_new_session=True,
                            env={**os.environ, "MMFEAT_CHAOS_DEVICE": device, **(env or {})})


def _staged_driver(root: Path, backend: str) -> tuple[Optional[dict[str, str]], str]:
    """The environment of the staged GPU readers, and what drives them; None (and why) where they
    cannot run: they read host-pool features, and need CUDA or the fake driver."""
    if backend != "host":
        return None, "skipped: they read host-pool features, and with cuda_vmm the keyed producers put to GPU pools"
    import torch

    if torch.cuda.is_available():
        return {}, "the GPU"
    from tests import fake_cuda

    lib = root / "fake-libcuda"
    reason = fake_cuda.build(lib)
    if reason is not None:
        return None, f"skipped: no GPU, and {reason}"
    return {"LD_LIBRARY_PATH": str(lib), "STUB_LOG": str(root / "fake-cuda.log")}, "the fake driver (tests/fake_cuda)"


def _misuse(log: Path) -> list[str]:
    """The fake driver's complaints: calls the real driver would refuse or that break its rules."""
    if not log.exists():
        return []
    with log.open(errors="replace") as f:
        return [line.strip() for line in f if line.lstrip().startswith("!!")]


def _kill_worker(run: Path, name: str) -> bool:
    """SIGKILL the current process of worker ``name`` (its supervisor forks the next); True if one ran."""
    try:
        pid = int((run / f"{name}.pid").read_text())
        os.kill(pid, signal.SIGKILL)
        return True
    except (OSError, ValueError):
        return False


def _totals(run: Path) -> dict[str, int]:
    out: dict[str, int] = {}
    for f in run.glob("*.json"):
        try:
            for k, v in json.loads(f.read_text()).items():
                out[k] = out.get(k, 0) + v
        except (OSError, ValueError):
            pass
    return out


def _settle(daemon, what: str) -> tuple[int, int]:
    """fds and anonymous memory of the daemon once it has been quiet for a moment."""
    time.sleep(1.0)
    return fd_count(daemon.pid), anon_bytes(daemon.pid)


class _Nodes:
    """One daemon, or two meshed ones (a and b) that keep their runtime dirs across restarts."""

    def __init__(self, root: Path, runtime: Path, daemon_args: tuple[str, ...], n: int, backend: str) -> None:
        self.root, self.args, self.backend = root, daemon_args, backend
        self.cluster = None
        self.evictions = 0  # of the daemons killed so far: their counters die with them
        if n == 1:
            self.daemons = [start_daemon(runtime, *daemon_args, backend=backend, log=root / "mmfeatd.log")]
            return
        from tests.cluster import Cluster

        self.cluster = Cluster(root / "mesh")
        (root / "mesh").mkdir()
        self.names = ["a", "b"]
        for name in self.names:
            self.cluster.node(name)
        rt_b = root / "rt-b"
        rt_b.mkdir(mode=0o700)
        self.runtimes = [runtime, rt_b]
        self.daemons = [self._start(i) for i in range(2)]

    def _start(self, i: int):
        name = self.names[i]
        return self.cluster.start(name, [m for m in self.names if m != name], *self.args, runtime=self.runtimes[i],
                                  backend=self.backend, log=self.root / f"mmfeatd-{name}.log")

    def runtime_for_consumer(self, k: int) -> Path:
        return self.daemons[0].runtime_dir if self.cluster is None or k == 0 else self.runtimes[1]

    def kill_and_restart(self, i: int) -> None:
        d = self.daemons[i]
        try:
            self.evictions += d.stats()["counters"]["evictions"]
        except Exception:
            pass  # a daemon too busy to answer: its evictions go uncounted
        if self.cluster is None:
            d.proc.kill()
            d.proc.communicate()
            self.daemons[i] = start_daemon(d.runtime_dir, *self.args, backend=self.backend,
                                           log=self.root / "mmfeatd.log")
            return
        self.cluster.stop(self.names[i], signal.SIGKILL, keep_runtime=True)
        self.daemons[i] = self._start(i)

    def close(self) -> None:
        for d in self.daemons:
            if d.proc.poll() is None:
                d.proc.send_signal(signal.SIGTERM)
                d.proc.communicate(timeout=30)


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--seconds", type=float, default=120.0)
    p.add_argument("--producers", type=int, default=3)
    p.add_argument("--consumers", type=int, default=3)
    p.add_argument("--keyed", type=int, default=1, help="producers of retained features under keys")
    p.add_argument("--holders", type=int, default=2, help="processes that hold keys and read and ack the holds")
    p.add_argument("--late", type=int, default=1, help="producers that write and publish past their reservations")
    p.add_argument("--staged", type=int, default=0,
                   help="processes that read retained features by key into a GPU, staged behind GPU work")
    p.add_argument("--pool-mb", type=int, default=256, help="the pool's size: small, to keep evicting")
    p.add_argument("--kill-every", type=float, default=0.2, help="seconds between worker kills")
    p.add_argument("--daemon-kill-every", type=float, default=20.0, help="seconds between daemon kills")
    p.add_argument("--seed", type=int, default=1)
    p.add_argument("--nodes", type=int, choices=(1, 2), default=1, help="2: two meshed daemons, consumers on both")
    p.add_argument("--backend", choices=("host", "cuda_vmm"), default="host",
                   help="cuda_vmm: pools in GPU 0's memory, CUDA tensors put and checked")
    args = p.parse_args(argv)
    device = "cuda:0" if args.backend == "cuda_vmm" else "cpu"
    rng = random.Random(args.seed)
    root = Path(tempfile.mkdtemp(prefix="mmf-chaos-", dir="/tmp"))
    runtime, run = root / "rt", root / "run"
    runtime.mkdir(mode=0o700)
    run.mkdir()
    config = root / "mmfeatd.toml"
    _write_config(config, RESERVE_TTL, ACK_TTL, args.pool_mb)
    staged_env, staged_on = _staged_driver(root, args.backend) if args.staged else (None, "none asked for")
    if args.staged and staged_env is None:
        print(f"staged GPU readers {staged_on}")
    # One node: the TTLs come from a file that a reload reads again (flags would override it). The mesh's
    # daemons take their files from tests/cluster.py, and their TTLs from flags.
    daemon_args = (("--config", str(config)) if args.nodes == 1 else
                   ("--pool-mb", str(args.pool_mb), "--reserve-ttl", str(RESERVE_TTL), "--ack-ttl", str(ACK_TTL)))
    nodes = _Nodes(root, runtime, daemon_args, args.nodes, args.backend)
    daemon = nodes.daemons[0]
    endpoints = [f"ipc://{root}/consumer{i}.sock" for i in range(args.consumers)]
    workers: dict[str, subprocess.Popen] = {}

    def start(name: str) -> None:
        if name.startswith("k"):
            workers[name] = _spawn(["keyed", str(runtime), str(run), name, str(args.seconds * 2)], device)
        elif name.startswith("s"):
            workers[name] = _spawn(["staged", str(runtime), str(run), name], device, env=staged_env)
        elif name.startswith("h"):
            workers[name] = _spawn(["holder", str(runtime), str(run), name], device)
        elif name.startswith("l"):
            workers[name] = _spawn([str(runtime), str(run), name, str(args.seconds * 2)], device,
                                   "tests.chaos.late_worker")
        elif name.startswith("p"):
            workers[name] = _spawn(["producer", str(runtime), str(run), name, str(args.seconds * 2),
                                    ",".join(endpoints)], device)
        else:
            rt = nodes.runtime_for_consumer(int(name[1:]))
            workers[name] = _spawn(["consumer", str(rt), str(run), name, endpoints[int(name[1:])]], device)

    names = [f"p{i}" for i in range(args.producers)] + [f"c{i}" for i in range(args.consumers)]
    names += [f"k{i}" for i in range(args.keyed)] + [f"h{i}" for i in range(args.holders)]
    names += [f"l{i}" for i in range(args.late)]
    names += [f"s{i}" for i in range(args.staged if staged_env is not None else 0)]
    roles = {"p": "producer", "c": "consumer", "k": "keyed", "h": "holder", "l": "late", "s": "staged"}
    kills = {"producer": 0, "consumer": 0, "keyed": 0, "holder": 0, "late": 0, "staged": 0, "daemon": 0}
    reloads: list[str] = []

    def reload(reserve_ttl: float, ack_ttl: float) -> None:
        _write_config(config, reserve_ttl, ack_ttl, args.pool_mb)
        nodes.daemons[0].proc.send_signal(signal.SIGHUP)
        reloads.append(f"reserve_ttl {reserve_ttl:g} s, ack_ttl {ack_ttl:g} s")
    try:
        for n in names:
            start(n)
        time.sleep(3)  # workers import torch and connect
        end = time.monotonic() + args.seconds
        next_daemon_kill = time.monotonic() + args.daemon_kill_every
        # (when, reserve_ttl, ack_ttl): lower at a third of the run, back at two thirds.
        pending_reloads = ([(end - args.seconds * 2 / 3, LOW_RESERVE_TTL, LOW_ACK_TTL),
                            (end - args.seconds / 3, RESERVE_TTL, ACK_TTL)] if args.nodes == 1 else [])
        while time.monotonic() < end:
            if pending_reloads and time.monotonic() >= pending_reloads[0][0]:
                reload(*pending_reloads.pop(0)[1:])
            time.sleep(rng.uniform(0.5, 1.5) * args.kill_every)
            victim = rng.choice(names)
            if _kill_worker(run, victim):
                kills[roles[victim[0]]] += 1
            if time.monotonic() >= next_daemon_kill:
                nodes.kill_and_restart(rng.randrange(len(nodes.daemons)))
                kills["daemon"] += 1
                daemon = nodes.daemons[0]
                next_daemon_kill = time.monotonic() + args.daemon_kill_every
        # The last daemon's baseline: measured with its clients connected and busy.
        fds_busy, _ = _settle(daemon, "busy")
        for w in workers.values():
            os.killpg(w.pid, signal.SIGKILL)
            w.wait()
        deadline = time.monotonic() + RESERVE_TTL + ACK_TTL + 10
        while True:
            every = [d.stats() for d in nodes.daemons]
            s = every[0]
            if all(x["pools"][0]["used"] == 0 and x["clients"] == 0 for x in every) or time.monotonic() > deadline:
                break
            time.sleep(0.5)
        fds_end, anon_end = _settle(daemon, "end")
        fresh = start_daemon(root / "fresh", "--pool-mb", str(args.pool_mb), backend=args.backend)
        fds_fresh, anon_fresh = _settle(fresh, "fresh")
        fresh.stop()
        fresh.proc.communicate()
        totals = _totals(run)
        wrong_lines = (run / "WRONG").read_text().splitlines() if (run / "WRONG").exists() else []
        leaked = sum(x["pools"][0]["used"] for x in every)
        evictions = nodes.evictions + sum(x["counters"]["evictions"] for x in every)
        misuse = _misuse(root / "fake-cuda.log")
        report = {
            "seconds": args.seconds,
            "backend": args.backend,
            "kills": kills,
            "reloads": reloads,
            "features_put": totals.get("put", 0),
            "features_inline": totals.get("inline", 0),
            "keyed_puts": totals.get("keyed_put", 0),
            "holds_taken": totals.get("held", 0),
            "hold_misses": totals.get("hold_missed", 0),
            "reads_checked": totals.get("checked", 0),
            # Views whose bytes changed while they were read later than the shortest ack_ttl after
            # their publish: the contract ends there, so these are not wrong reads.
            "views_read_past_ack_ttl": totals.get("views_past_ack_ttl", 0),
            "bytes_checked": totals.get("checked_bytes", 0),
            "wrong_reads": len(wrong_lines),
            "wrong_examples": wrong_lines[:5],
            "staged": {"on": staged_on, "batches": totals.get("staged_batches", 0),
                       "reads_checked": totals.get("staged_checked", 0), "bytes_checked": totals.get("staged_bytes", 0),
                       "driver_misuse": misuse[:5]},
            "evictions_all_daemons": evictions,
            "modes": {"grad_puts": totals.get("grad_puts", 0), "inference_gets": totals.get("inference_gets", 0)},
            "refused_reads": {k[8:]: v for k, v in totals.items() if k.startswith("refused_")},
            "put_errors": {k[10:]: v for k, v in totals.items() if k.startswith("put_error_")},
            "late_producer": {k[5:]: v for k, v in totals.items() if k.startswith("late_")},
            "bytes_leased_after_ttls": leaked,
            "leases_after_ttls": s["leases"],
            "daemon_counters": {k: s["counters"][k] for k in ("expired", "reclaimed_on_disconnect", "late_requests",
                                                              "stale", "not_found", "dedups", "holds",
                                                              "holds_reclaimed", "holds_expired", "evictions",
                                                              "retained_expired")},
            "holds_after_ttls": [x["holds"] for x in every],
            "daemon_fds": {"fresh_daemon": fds_fresh, "busy": fds_busy, "end": fds_end},
            "daemon_anon_mib": {"fresh_daemon": round(anon_fresh / 2**20, 1), "end": round(anon_end / 2**20, 1)},
        }
        if args.nodes == 2:
            mesh = every[1]["mesh"]["peers"][0]
            report["pulled_by_b"] = {k: mesh[k] for k in ("pulls", "bytes_pulled", "pull_failures", "shared_gets",
                                                          "acks_relayed", "acks_dropped")}
            report["used_after_ttls"] = [x["pools"][0]["used"] for x in every]
        print(json.dumps(report, indent=2))
        # A daemon that served the run may hold a little more than a fresh one (allocator pools, caches):
        # fds must come back to a fresh daemon's count, memory within 64 MiB of it.
        # A meshed daemon holds more fds than a fresh plain one (UCX's sockets and event fds, the ZAP
        # thread's): there, the end must come back to what it held while busy.
        fd_base = fds_fresh if args.nodes == 1 else fds_busy
        ok = (not wrong_lines and leaked == 0 and not any(x["holds"] for x in every) and fds_end <= fd_base
              and anon_end - anon_fresh < 64 << 20 and not misuse)
        if staged_env is not None and args.staged and (not evictions or not totals.get("staged_checked")):
            print("chaos: the staged reads were not under eviction pressure (no eviction) or read nothing checked")
            ok = False
        print("chaos: " + ("held" if ok else "FAILED"))
        return 0 if ok else 1
    finally:
        for w in workers.values():
            try:
                os.killpg(w.pid, signal.SIGKILL)
            except OSError:
                pass
        nodes.close()
        shutil.rmtree(root, ignore_errors=True)


if __name__ == "__main__":
    sys.exit(main())
