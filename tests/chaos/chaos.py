"""``make chaos``: producers and consumers SIGKILLed at random under load, the daemon SIGKILLed and
restarted, every byte checked. Prints what was tried and what held; exits 1 if a wrong byte was read,
bytes stayed leased after the TTLs, or the daemon grew fds or memory.

    python -m tests.chaos.chaos --seconds 120 --producers 3 --consumers 3
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

from tests.conftest import anon_bytes, fd_count, start_daemon

RESERVE_TTL, ACK_TTL = 3.0, 6.0


def _spawn(args: list[str]) -> subprocess.Popen:
    return subprocess.Popen([sys.executable, "-m", "tests.chaos.worker", *args], stdout=subprocess.DEVNULL,
                            stderr=subprocess.DEVNULL, start_new_session=True)


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


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--seconds", type=float, default=120.0)
    p.add_argument("--producers", type=int, default=3)
    p.add_argument("--consumers", type=int, default=3)
    p.add_argument("--kill-every", type=float, default=0.2, help="seconds between worker kills")
    p.add_argument("--daemon-kill-every", type=float, default=20.0, help="seconds between daemon kills")
    p.add_argument("--seed", type=int, default=1)
    args = p.parse_args(argv)
    rng = random.Random(args.seed)
    root = Path(tempfile.mkdtemp(prefix="mmf-chaos-", dir="/tmp"))
    runtime, run = root / "rt", root / "run"
    runtime.mkdir(mode=0o700)
    run.mkdir()
    daemon_args = ("--pool-mb", "256", "--reserve-ttl", str(RESERVE_TTL), "--ack-ttl", str(ACK_TTL))
    daemon = start_daemon(runtime, *daemon_args, log=root / "mmfeatd.log")
    endpoints = [f"ipc://{root}/consumer{i}.sock" for i in range(args.consumers)]
    workers: dict[str, subprocess.Popen] = {}

    def start(name: str) -> None:
        if name.startswith("p"):
            workers[name] = _spawn(["producer", str(runtime), str(run), name, str(args.seconds * 2), ",".join(endpoints)])
        else:
            workers[name] = _spawn(["consumer", str(runtime), str(run), name, endpoints[int(name[1:])]])

    names = [f"p{i}" for i in range(args.producers)] + [f"c{i}" for i in range(args.consumers)]
    kills = {"producer": 0, "consumer": 0, "daemon": 0}
    try:
        for n in names:
            start(n)
        time.sleep(3)  # workers import torch and connect
        end = time.monotonic() + args.seconds
        next_daemon_kill = time.monotonic() + args.daemon_kill_every
        while time.monotonic() < end:
            time.sleep(rng.uniform(0.5, 1.5) * args.kill_every)
            victim = rng.choice(names)
            if _kill_worker(run, victim):
                kills["producer" if victim.startswith("p") else "consumer"] += 1
            if time.monotonic() >= next_daemon_kill:
                daemon.proc.kill()
                daemon.proc.communicate()
                kills["daemon"] += 1
                daemon = start_daemon(runtime, *daemon_args, log=root / "mmfeatd.log")
                next_daemon_kill = time.monotonic() + args.daemon_kill_every
        # The last daemon's baseline: measured with its clients connected and busy.
        fds_busy, _ = _settle(daemon, "busy")
        for w in workers.values():
            os.killpg(w.pid, signal.SIGKILL)
            w.wait()
        deadline = time.monotonic() + RESERVE_TTL + ACK_TTL + 10
        while True:
            s = daemon.stats()
            if (s["pools"][0]["used"] == 0 and s["clients"] == 0) or time.monotonic() > deadline:
                break
            time.sleep(0.5)
        fds_end, anon_end = _settle(daemon, "end")
        fresh = start_daemon(root / "fresh", "--pool-mb", "256")
        fds_fresh, anon_fresh = _settle(fresh, "fresh")
        fresh.stop()
        fresh.proc.communicate()
        totals = _totals(run)
        wrong_lines = (run / "WRONG").read_text().splitlines() if (run / "WRONG").exists() else []
        leaked = s["pools"][0]["used"]
        report = {
            "seconds": args.seconds,
            "kills": kills,
            "features_put": totals.get("put", 0),
            "features_inline": totals.get("inline", 0),
            "reads_checked": totals.get("checked", 0),
            "bytes_checked": totals.get("checked_bytes", 0),
            "wrong_reads": len(wrong_lines),
            "refused_reads": {k[8:]: v for k, v in totals.items() if k.startswith("refused_")},
            "put_errors": {k[10:]: v for k, v in totals.items() if k.startswith("put_error_")},
            "bytes_leased_after_ttls": leaked,
            "leases_after_ttls": s["leases"],
            "daemon_counters": {k: s["counters"][k] for k in ("expired", "reclaimed_on_disconnect", "late_requests", "stale", "not_found")},
            "daemon_fds": {"fresh_daemon": fds_fresh, "busy": fds_busy, "end": fds_end},
            "daemon_anon_mib": {"fresh_daemon": round(anon_fresh / 2**20, 1), "end": round(anon_end / 2**20, 1)},
        }
        print(json.dumps(report, indent=2))
        # A daemon that served the run may hold a little more than a fresh one (allocator pools, caches):
        # fds must come back to a fresh daemon's count, memory within 64 MiB of it.
        ok = not wrong_lines and leaked == 0 and fds_end <= fds_fresh and anon_end - anon_fresh < 64 << 20
        print("chaos: " + ("held" if ok else "FAILED"))
        return 0 if ok else 1
    finally:
        for w in workers.values():
            try:
                os.killpg(w.pid, signal.SIGKILL)
            except OSError:
                pass
        if daemon.proc.poll() is None:
            daemon.proc.send_signal(signal.SIGTERM)
            daemon.proc.communicate(timeout=30)
        shutil.rmtree(root, ignore_errors=True)


if __name__ == "__main__":
    sys.exit(main())
