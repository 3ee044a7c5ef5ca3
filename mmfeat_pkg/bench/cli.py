"""``mmfeat bench``: arguments, the daemon it measures, and the order of the runs."""

from __future__ import annotations

import argparse
import os
import shutil
import signal
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any, Optional

from mmfeat.testing import worker_context

from .control import run_control
from .report import (MiB, add_ratios, combine_rounds, human_size, make_row, parse_size, plot, plot_unavailable, render,
                     render_burst, targets, write_json)
from .ray_mode import INSTALL_HINT as RAY_HINT
from .ray_mode import MODE as RAY
from .ray_mode import RaySession, ray_missing
from .remote import REMOTE_MODES
from .remote_verdict import REMOTE_ROUNDS
from .workers import MODES, Job, consumer_main, producer_main, ring_path


# ray is an optional extra: by default it runs where it is installed, so a plain `mmfeat bench` works anywhere.
DEFAULT_MODES = MODES + ((RAY,) if ray_missing() is None else ())


def add_bench_args(p: argparse.ArgumentParser) -> None:
    p.add_argument("--sizes", default="64K,1M,16M,64M", help="feature sizes, K, M or G (default: %(default)s)")
    p.add_argument("--consumers", default="1,2,4", help="consumer process counts (default: %(default)s)")
    p.add_argument("--modes", default=",".join(DEFAULT_MODES),
                   help=f"which modes to run, comma-separated (default: all of {', '.join(MODES)}, and {RAY} "
                        f"where Ray is installed ({RAY_HINT.split(' (')[0]}); "
                        f"with --remote, all of {', '.join(REMOTE_MODES)})")
    p.add_argument("--count", type=int, default=None,
                   help="features per run (default: by size, 256 MiB worth, at least 100 and at most 1000)")
    p.add_argument("--window", type=int, default=4, help="features in flight at most (default: %(default)s)")
    p.add_argument("--rounds", type=_at_least_one, default=None,
                   help="run every size and mode this many times, interleaved, and report medians: on a shared "
                        f"machine one run of a baseline can be off by 2x (default: 1; with --remote, {REMOTE_ROUNDS})")
    p.add_argument("--threads", type=int, default=1, help="torch threads per process (default: %(default)s)")
    p.add_argument("--ack", choices=("background", "sync"), default="background",
                   help="background: consumers ack with wait=False, as a server does; sync: they wait for each ack "
                        "(default: %(default)s)")
    p.add_argument("--control-clients", default="1,4,16",
                   help="concurrent clients for the control-plane run; '' skips it (default: %(default)s)")
    p.add_argument("--control-seconds", type=float, default=2.0,
                   help="seconds of each control-plane run (default: %(default)s)")
    p.add_argument("--json", type=Path, help="write one record per row here (default: none)")
    p.add_argument("--plot", type=Path,
                   help="write throughput against size here (PNG, needs matplotlib; not with --remote) (default: none)")
    p.add_argument("--targets", action="store_true",
                   help="after the results, compare them with the project's reference goals, which were set for "
                        "its reference machine (docs/performance.md): a smaller machine may miss them")
    p.add_argument("--burst", type=int, default=0, metavar="N",
                   help="also put N features of each size through the pool as fast as the producer can, ahead of "
                        "its consumer (a tokenizer's burst), and N paced by --window, and report mmfeatd's CPU per "
                        "feature of the burst over the paced one; the private daemon's pool and arenas are sized to "
                        "hold the burst (default: no burst rows)")
    p.add_argument("--use-running", action="store_true",
                   help="measure the daemon at --runtime-dir instead of a private one")
    p.add_argument("--steps", action="store_true",
                   help="instead of the handoff between processes, time the client's steps (put, to_bytes, "
                        "from_bytes, get, ack) for one feature at a time in this process, pool and inline, at each "
                        "--sizes (--count features, default 2000)")
    p.add_argument("--keys", action="store_true",
                   help="instead of the handoff, have a scheduler process look up (has_many, lookup) and hold (then "
                        "ack) retained features under keys, of the first of --sizes, --count times each (default "
                        "2000), and report mmfeatd's CPU per request")
    p.add_argument("--remote", action="store_true",
                   help="features pulled between two private daemons meshed on 127.0.0.1, against a bare NIXL READ "
                        "and plain ZMQ TCP bytes (needs mmfeat[mesh])")
    p.add_argument("--netns", action="store_true",
                   help="with --remote: each node in a network namespace of its own, joined by a veth, UCX on TCP, "
                        "as two machines without RDMA (needs root and iproute2)")


def _at_least_one(text: str) -> int:
    n = int(text)
    if n < 1:
        raise argparse.ArgumentTypeError(f"must be at least 1, not {n}")
    return n


def _count_for(size: int, override: Optional[int]) -> int:
    """256 MiB worth, between 100 and 1000 features. Not fewer: a row's p99 and its mmfeatd column
    (the daemon's CPU over the row, shared by its features) mean little over a few dozen."""
    if override:
        return override
    return max(100, min(1000, (256 * MiB) // size))


def _progress(text: str) -> None:
    if sys.stderr.isatty():
        sys.stderr.write("\r\x1b[K" + text)
    else:
        sys.stderr.write(text + "\n")
    sys.stderr.flush()


def _start_daemon(runtime_dir: Path, pool_mb: int, extra: tuple[str, ...] = ()) -> subprocess.Popen:
    from mmfeat.testing import DaemonStartError, spawn_daemon

    try:
        return spawn_daemon(runtime_dir, ["--backend", "host", "--pool-mb", str(pool_mb), "--log-level", "WARNING",
                                          *extra], timeout=30)
    except DaemonStartError as exc:
        raise SystemExit(f"mmfeat bench: could not start a private mmfeatd: {exc}") from None


def _memcpy_row(size: int, count: int, threads: int, device: str) -> dict[str, Any]:
    """The limit: one copy of the payload inside one process (device to device for a GPU pool)."""
    import torch

    torch.set_num_threads(threads)
    src = torch.randint(0, 255, (size,), dtype=torch.uint8).to(device)
    dst = torch.empty_like(src)
    dst.copy_(src)  # first touch outside the clock

    def sync() -> None:
        if dst.is_cuda:
            torch.cuda.synchronize(dst.device)

    sync()
    lat = []
    t_start = time.monotonic()
    for _ in range(count):
        t0 = time.monotonic()
        dst.copy_(src)
        sync()
        lat.append(time.monotonic() - t0)
    return make_row("memcpy", size, 1, lat, time.monotonic() - t_start)


BURST_MODES = ("burst_paced", "burst")
_ARENA_MB = 64  # mmfeatd's default arena_mb


def _burst_daemon(pool_mb: int, size: int, burst: int) -> tuple[int, tuple[str, ...]]:
    """A pool and arenas that hold a burst of ``burst`` features of ``size`` in one session's arenas,
    as a server sizes them for its bursts: past its arenas a producer reserves each feature (two
    requests), and the row would measure that path instead."""
    pool_mb = max(pool_mb, 4 * burst * size // MiB)
    arena = min(_ARENA_MB, pool_mb // 16) * MiB
    per_arena = max(1, arena // max(size, 1) - 1)  # a ring never fills its last feature's room
    arenas = -(-(burst + 16) // per_arena) + 1
    return pool_mb, ("--arenas-per-session", str(max(4, arenas)))


def _daemon_facts(runtime_dir: Path) -> tuple[str, int]:
    """(payload device, daemon pid): cuda:N when the daemon's first pool is in GPU memory, else cpu."""
    from mmfeat.client.link.channel import ControlChannel
    from mmfeat.protos.paths import control_endpoint

    ch = ControlChannel(control_endpoint(runtime_dir), 5.0)
    try:
        stats, pools = ch.call("stats"), ch.call("pool_info")["pools"]
    finally:
        ch.close()
    if pools and pools[0]["kind"] == "cuda":
        from mmfeat.cuda_driver import local_ordinal

        ordinal = local_ordinal(pools[0])  # the pool's GPU as this process numbers it
        if ordinal is None:
            raise SystemExit(f"the daemon's GPU pool is on {pools[0].get('uuid')}, which this process cannot see")
        return f"cuda:{ordinal}", stats["pid"]
    return "cpu", stats["pid"]


def _cpu_seconds(pid: int) -> Optional[float]:
    """CPU time of every thread of ``pid`` (ZeroMQ's I/O thread included); None if /proc does not say."""
    total = 0
    try:
        for tid in os.listdir(f"/proc/{pid}/task"):
            with open(f"/proc/{pid}/task/{tid}/schedstat") as f:
                total += int(f.read().split()[0])  # nanoseconds on a CPU
    except (OSError, ValueError, IndexError):
        return None
    return total / 1e9


def _run_data_plane(
    runtime_dir: Path, sock_dir: Path, n: int, sizes: list[int], modes: list[str], args: argparse.Namespace,
    device: str,
    daemon_pid: int,
    ray_session: Optional[RaySession] = None,
) -> list[dict[str, Any]]:
    import torch.multiprocessing as tmp

    tmp.set_sharing_strategy("file_descriptor")
    ctx = worker_context(tmp)
    mp_queues = [ctx.Queue() for _ in range(n)]
    pipes = [ctx.Pipe() for _ in range(n + 1)]
    procs = [ctx.Process(target=producer_main,
                         args=(n, str(runtime_dir), str(sock_dir), args.threads, pipes[0][1], mp_queues))]
    procs += [
        ctx.Process(target=consumer_main,
                    args=(r, str(runtime_dir), str(sock_dir), args.threads, pipes[r + 1][1], mp_queues[r]))
        for r in range(n)
    ]
    rows = []
    for p in procs:
        p.start()
    try:
        if not pipes[0][0].poll(60):
            raise SystemExit("mmfeat bench: the producer process did not start")
        pipes[0][0].recv()
        burst_modes = BURST_MODES if args.burst and n == min(int(c) for c in args.consumers.split(",") if c) else ()
        for rnd, size, mode in ((rnd, size, mode) for rnd in range(args.rounds) for size in sizes
                                for mode in (*modes, *burst_modes)):
            _progress(f"bench: {n} consumer(s), {human_size(size)}, {mode} on {device}"
                      f"{f', round {rnd + 1}/{args.rounds}' if args.rounds > 1 else ''} ...")
            count = _count_for(size, args.count)
            if mode == RAY:
                job = Job(mode, size, count, warmup=max(2, args.window, count // 20), window=args.window, device=device)
                rows.append({**ray_session.row(job, n), "round": rnd})
                continue
            # At least a window of warm-up: every slot of shm_ring's ring and of a pool's arenas is touched
            # (its pages faulted in) before the clock starts.
            job = Job(mode, size, count, warmup=max(2, args.window, count // 20), window=args.window, device=device,
                      ack=args.ack)
            if mode in BURST_MODES:
                # The burst: no window, so the producer runs as far ahead of its consumer as it can.
                job = Job("pool_view", size, args.burst, warmup=args.window, device=device, ack=args.ack,
                          window=args.burst + args.window if mode == "burst" else args.window,
                          burst=mode == "burst")
            for parent, _ in pipes:
                parent.send(job)
            # mmfeatd's CPU is sampled once the warm-up is read: every worker has connected (and closed
            # the other modes' clients) and the producer holds its arenas, as a running server does.
            if not pipes[0][0].poll(600) or pipes[0][0].recv() != "warm":
                raise SystemExit(f"mmfeat bench: {mode} at {human_size(size)} did not finish its warm-up in 600 s")
            daemon_cpu0 = _cpu_seconds(daemon_pid)
            pipes[0][0].send("go")
            if not pipes[0][0].poll(600):
                raise SystemExit(f"mmfeat bench: {mode} at {human_size(size)} did not finish in 600 s")
            res = pipes[0][0].recv()
            consumer_cpu = [parent.recv()["cpu_s"] for parent, _ in pipes[1:]]
            daemon_cpu1 = _cpu_seconds(daemon_pid)
            row = make_row(mode, size, n, res["latencies"], res["elapsed"], res["first_held"])
            if mode in BURST_MODES:
                row["fallbacks"] = res["fallbacks"]
            # CPU per feature after the warm-up: steadier than time on a shared machine.
            row["producer_cpu_us"] = res["cpu_s"] / job.count * 1e6
            row["consumer_cpu_us"] = sum(consumer_cpu) / n / job.count * 1e6
            row["daemon_cpu_us"] = (
                (daemon_cpu1 - daemon_cpu0) / job.count * 1e6
                if daemon_cpu0 is not None and daemon_cpu1 is not None else None
            )
            row["round"] = rnd
            rows.append(row)
        for parent, _ in pipes:
            parent.send(None)
        for p in procs:
            p.join(30)
    finally:
        for p in procs:
            if p.is_alive():
                p.kill()
    return rows


def run_bench(args: argparse.Namespace) -> int:
    if args.plot:  # before anything runs: a bench takes minutes, and then could not draw its plot
        if args.remote:
            raise SystemExit("mmfeat bench: --plot draws the local bench only; drop --plot or --remote")
        why_not = plot_unavailable()
        if why_not:
            raise SystemExit(f"mmfeat bench: cannot --plot: {why_not}")
    if args.remote:
        from .remote import run_remote_bench

        return run_remote_bench(args)
    args.rounds = args.rounds or 1
    sizes = [parse_size(s) for s in args.sizes.split(",") if s]
    counts = [int(c) for c in args.consumers.split(",") if c]
    modes = [m for m in args.modes.split(",") if m]
    unknown = set(modes) - set(MODES) - {RAY}
    if unknown:
        raise SystemExit(f"mmfeat bench: unknown modes {sorted(unknown)}; choose from {','.join(MODES + (RAY,))}")
    if RAY in modes and ray_missing() and not args.steps:
        raise SystemExit(f"mmfeat bench: the {RAY} mode needs Ray, and {ray_missing()}: {RAY_HINT}")
    control_clients = [int(c) for c in args.control_clients.split(",") if c]
    work = Path(tempfile.mkdtemp(prefix="mmfb-", dir="/tmp"))
    daemon = ray_session = None
    try:
        if args.use_running:
            from mmfeat.protos.paths import default_runtime_dir

            runtime_dir = args.runtime_dir or default_runtime_dir()
        else:
            runtime_dir = work / "rt"
            runtime_dir.mkdir()
            # Room for the window twice over (an ack may land after its consumer reported), and for
            # arenas (a sixteenth of the pool each) that take two of the largest feature, as a server
            # sizes its pool for its features.
            pool_mb = max(256, (max(sizes) * (2 * args.window + 2)) // MiB + 64, 32 * max(sizes) // MiB)
            extra: tuple[str, ...] = ()
            if args.burst:
                pool_mb, extra = _burst_daemon(pool_mb, max(sizes), args.burst)
            daemon = _start_daemon(runtime_dir, pool_mb, extra)
        device, daemon_pid = _daemon_facts(runtime_dir)
        if args.steps:
            from .steps import render_steps, run_steps

            count = args.count or 2000
            print(render_steps(run_steps(runtime_dir, sizes, count), count))
            return 0
        if args.keys:
            from .keyed import render_keyed, run_keyed

            print(render_keyed(run_keyed(runtime_dir, sizes[0], args.count or 2000, args.rounds, daemon_pid,
                                         _cpu_seconds)))
            return 0
        if RAY in modes and device != "cpu":
            # Ray's actors would need GPUs of their own and its object store holds host memory only.
            raise SystemExit(f"mmfeat bench: the {RAY} mode measures host pools only, and this daemon's pool is on "
                             f"{device}: drop {RAY} from --modes, or measure a host-pool daemon")
        rows = [{**_memcpy_row(size, _count_for(size, args.count), args.threads, device), "round": rnd}
                for rnd in range(args.rounds) for size in sizes]
        if RAY in modes:
            _progress("bench: starting a private Ray ...")  # seconds, once, before any row's clock
            ray_session = RaySession(max(sizes), args.window, args.threads, work / "ray", _cpu_seconds)
        for n in counts:
            rows += _run_data_plane(runtime_dir, work, n, sizes, modes, args, device, daemon_pid, ray_session)
        control = []
        if control_clients:
            _progress("bench: control plane ...")
            control = run_control(runtime_dir, work, control_clients, args.control_seconds)
        _progress("")
        add_ratios(rows)
        rows = combine_rounds(rows)
        verdicts = targets(rows, control) if args.targets else []
        rounds_note = (f"; medians of {args.rounds} interleaved rounds "
                       "(ratios: of each round its own; mmfeatd: the rounds pooled)" if args.rounds > 1 else "")
        print(f"payloads on {device}; limit: one {'device-to-device' if device != 'cpu' else 'host'} copy; "
              f"consumers ack {'with wait=False' if args.ack == 'background' else 'and wait'}"
              f"{rounds_note}\n")
        print(render(rows, control, verdicts))
        if args.burst:
            print(render_burst(rows, args.burst))
        if args.json:
            write_json(args.json, rows, control)
        if args.plot:
            why_not = plot(args.plot, rows)
            if why_not:
                print(f"no plot: {why_not}", file=sys.stderr)
        return 0
    finally:
        if ray_session is not None:
            ray_session.close()
        if daemon is not None:
            daemon.send_signal(signal.SIGTERM)
            daemon.wait(15)
        shutil.rmtree(work, ignore_errors=True)
        Path(ring_path(str(work))).unlink(missing_ok=True)  # a producer killed mid-run leaves it
