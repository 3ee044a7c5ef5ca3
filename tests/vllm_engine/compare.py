"""mmfeat's vLLM EC connector against vLLM's own ECExampleConnector (safetensors files on local disk), both
driven in vLLM's call order on the same items, each half in a process of its own:

    .venv-vllm/bin/python -m tests.vllm_engine.compare --sizes 1K,1M,9M,41M --rounds 5 [--json OUT]
        [--mmfeat-extra '{"view_max_bytes": 0}']

For each connector a producer instance (encode-only: its scheduler and its worker) saves each item, and a
consumer instance (its scheduler and its worker) loads it into its encoder cache and copies it into the
model's input embeddings (the first use, which touches every page). Every item is a fresh random bf16
tensor; each load's digest must be its save's, both taken outside the timed calls. The processes fork
from one server that imported vLLM once (tests/vllm_engine/compare_roles.py has them). Starts its own
mmfeatd and its own folder for the example connector, and prints the medians of the warm rounds (the
first round is not counted) with mmfeat's ratios to the example. ``--profile DIR`` writes a cProfile
of each process's connector calls in the warm rounds (its overhead inflates the timings of that run).

Exits 1 when a load did not return its item's bytes, 2 when the run could not be made.
"""

from __future__ import annotations

import argparse
import json
import multiprocessing
import os
import shutil
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any, Optional

from mmfeat.bench.report import parse_size

from .compare_table import item_shape, render, summarise

CALL_TIMEOUT_S = 300.0  # one call: far past what any takes, so that only a stuck process fails the run


def _serve(conn: Any, kind: str, args: tuple) -> None:
    """A role process's body, imported there: the forkserver imported vLLM once for all of them, and the
    driver never does."""
    from .compare_roles import serve

    serve(conn, kind, args)


class RoleProcess:
    """One of the eight processes (two connectors, two instances, scheduler and worker), called over a pipe."""

    def __init__(self, ctx: Any, label: str, kind: str, args: tuple) -> None:
        self.label = label
        self.conn, child = ctx.Pipe()
        self.proc = ctx.Process(target=_serve, args=(child, kind, args), name=label, daemon=True)
        self.proc.start()
        child.close()

    def ready(self) -> float:
        """Seconds the role took to build (its connector, and a worker's parallel state)."""
        return self._answer("start")

    def call(self, op: str, *args: Any, timeout: float = CALL_TIMEOUT_S) -> Any:
        self.conn.send((op, args))
        return self._answer(op, timeout)

    def _answer(self, op: str, timeout: float = CALL_TIMEOUT_S) -> Any:
        if not self.conn.poll(timeout):
            raise RuntimeError(f"{self.label}: no answer to {op} within {timeout:g} s")
        try:
            status, result = self.conn.recv()
        except EOFError:
            raise RuntimeError(f"{self.label} exited (code {self.proc.exitcode}) during {op}") from None
        if status != "ok":
            raise RuntimeError(f"{self.label} failed in {op}:\n{result}")
        return result

    def close(self) -> None:
        self.proc.join(10)
        if self.proc.is_alive():
            self.proc.kill()
            self.proc.join(10)


class Instances:
    """A connector's producer and consumer instances: scheduler and worker processes of each."""

    def __init__(self, ctx: Any, connector: str, extra: dict[str, Any], max_size: int, profile: bool) -> None:
        from mmfeat.testing import free_tcp_port

        self.name = connector
        self.procs = {}
        for side, role in (("producer", "ec_producer"), ("consumer", "ec_consumer")):
            self.procs[f"{side}_scheduler"] = RoleProcess(ctx, f"{connector} {side} scheduler", "scheduler",
                                                          (connector, role, extra, profile))
            self.procs[f"{side}_worker"] = RoleProcess(ctx, f"{connector} {side} worker", "worker",
                                                       (connector, role, extra, free_tcp_port(), max_size, profile))

    def ready(self) -> dict[str, float]:
        return {key: p.ready() for key, p in self.procs.items()}

    def warm(self, warm: bool) -> None:
        for p in self.procs.values():
            p.call("warm", warm)

    def item(self, h: str, size: int, seed: int) -> dict[str, Any]:
        """One item through both instances, in vLLM's order; the seconds of each call, by process, and
        the two digests."""
        tokens = item_shape(size)[0]
        ps, pw = self.procs["producer_scheduler"], self.procs["producer_worker"]
        cs, cw = self.procs["consumer_scheduler"], self.procs["consumer_worker"]
        t: dict[str, dict[str, float]] = {}
        # What passes between the processes is pickled bytes, as vLLM's executor ships a SchedulerOutput to
        # its workers and their outputs back; the driver never unpickles it, so it never imports vLLM.
        so, found, t["producer_scheduler"] = ps.call("schedule", f"e-{h}", h, tokens, None)
        if found:
            raise RuntimeError(f"{self.name}: the producer found {h} before it encoded it")
        out, saved, t["producer_worker"] = pw.call("encode", so, h, size, seed)
        params, more = ps.call("first_output", f"e-{h}", out)
        t["producer_scheduler"].update(more)
        # The orchestrator hands the producer's params to the consumer's request, as vLLM's EPD proxy does.
        so, found, t["consumer_scheduler"] = cs.call("schedule", f"pd-{h}", h, tokens, params)
        if not found:
            raise RuntimeError(f"{self.name}: the consumer did not find {h} after the producer saved it")
        out, loaded, t["consumer_worker"] = cw.call("load", so, h)
        _, more = cs.call("first_output", f"pd-{h}", out)
        t["consumer_scheduler"].update(more)
        so, more = cs.call("later_step", f"pd-{h}")
        t["consumer_scheduler"].update(more)
        out, more = cw.call("later_step", so)
        t["consumer_worker"].update(more)
        _, more = cs.call("last_output", f"pd-{h}", out)
        t["consumer_scheduler"].update(more)
        for w in (pw, cw):
            w.call("free", h)
        cs.call("clean", h)
        return {"seconds": t, "saved": saved, "loaded": loaded}

    def stop(self, profile_dir: Optional[str]) -> None:
        for key, p in self.procs.items():
            try:
                p.call("stop", os.path.join(profile_dir, f"{self.name}-{key}.prof") if profile_dir else None,
                       timeout=30)
            except (RuntimeError, OSError) as e:
                print(f"compare: {e}", file=sys.stderr)
            p.close()


def machine() -> dict[str, Any]:
    model = ""
    try:
        model = next(ln.split(":", 1)[1].strip() for ln in open("/proc/cpuinfo") if ln.startswith("model name"))
    except (OSError, StopIteration):
        pass
    return {"cores": os.cpu_count(), "cpu": model, "load_1m": os.getloadavg()[0]}


def run(args: argparse.Namespace) -> dict[str, Any]:
    from mmfeat.testing import DaemonStartError, spawn_daemon

    sizes = [parse_size(s) for s in args.sizes.split(",")]
    work = Path(tempfile.mkdtemp(prefix="mmf-eccompare-"))
    runtime, store = work / "run", work / "example-store"
    runtime.mkdir()
    store.mkdir()
    # The daemon's own default at least: the connector's views may keep a quarter of the pool, as deployed.
    pool_mb = args.pool_mb or max(1024, 2 * sum(sizes) // (1 << 20) + 32)
    daemon = None
    groups: list[Instances] = []
    try:
        try:
            daemon = spawn_daemon(runtime, ["--backend", "host", "--pool-mb", str(pool_mb), "--log-level", "WARNING"],
                                  timeout=60)
        except DaemonStartError as e:
            raise RuntimeError(f"could not start mmfeatd: {e}") from None
        os.environ.setdefault("VLLM_LOGGING_LEVEL", "WARNING")
        os.environ["HF_HUB_OFFLINE"] = "1"
        ctx = multiprocessing.get_context("forkserver")
        ctx.set_forkserver_preload(["tests.vllm_engine.compare_roles"])
        t0 = time.monotonic()
        extras = {"mmfeat": {**args.mmfeat_extra, "runtime_dir": str(runtime)},
                  "example": {"shared_storage_path": str(store)}}
        groups = [Instances(ctx, name, extras[name], max(sizes), args.profile is not None) for name in extras]
        built = {g.name: g.ready() for g in groups}
        started_s = time.monotonic() - t0
        rounds: list[dict[str, Any]] = []
        for r in range(args.rounds + 1):
            if r == 1:
                for g in groups:
                    g.warm(True)
            order = groups if r % 2 == 0 else groups[::-1]  # neither connector always runs first
            for size in sizes:
                for g in order:
                    h = f"{g.name}-{size}-r{r}-{os.getpid()}"
                    rec = g.item(h, size, seed=r * 1000 + sizes.index(size))
                    rounds.append({"round": r, "connector": g.name, "size": size, **rec})
        command = " ".join(["python -m tests.vllm_engine.compare", *sys.argv[1:]])
        return {"machine": machine(), "command": command, "sizes": sizes, "rounds": args.rounds,
                "start_s": started_s, "built_s": built, "records": rounds, "daemon": _daemon_counts(runtime, rounds)}
    finally:
        for g in groups:
            g.stop(args.profile)
        if daemon is not None:
            daemon.terminate()
            try:
                daemon.wait(30)
            except subprocess.TimeoutExpired:
                daemon.kill()
                daemon.wait(10)
        shutil.rmtree(work, ignore_errors=True)


def _daemon_counts(runtime: Path, rounds: list[dict[str, Any]]) -> dict[str, int]:
    """What mmfeatd saw of mmfeat's consumer lookups, every round: the items, the ``hold_keys`` round trips
    (a key the feed had not brought yet, or one the lease table could not pin), and the reads pinned in
    the lease table without one."""
    from mmfeat.client import Client

    with Client(runtime, map_pools=False) as c:
        counters = c.stats()["counters"]
    return {"items": sum(1 for r in rounds if r["connector"] == "mmfeat"),
            "hold_keys": int(counters["requests_by_op"].get("hold_keys", 0)), "table_pins": int(counters["table_pins"])}


def main(argv: Optional[list[str]] = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0], prog="python -m tests.vllm_engine.compare")
    ap.add_argument("--sizes", default="1K,1M,9M,41M", help="item sizes, K/M in KiB/MiB (default 1K,1M,9M,41M)")
    ap.add_argument("--rounds", type=int, default=5, help="warm rounds counted, after one that is not (default 5)")
    ap.add_argument("--json", help="write the table's figures and every round's timings here")
    ap.add_argument("--pool-mb", type=int, default=0,
                    help="mmfeatd's pool (default: 1024, or twice the items of a round)")
    ap.add_argument("--profile", metavar="DIR", help="write a cProfile of each process's connector calls here")
    ap.add_argument("--mmfeat-extra", metavar="JSON", type=json.loads, default={},
                    help="more of mmfeat's ec_connector_extra_config, as JSON (e.g. '{\"view_max_bytes\": 0}': "
                         "every load a copy)")
    args = ap.parse_args(argv)
    if not isinstance(args.mmfeat_extra, dict):
        ap.error("--mmfeat-extra must be a JSON object")
    if args.rounds < 1:
        ap.error("--rounds must be at least 1")
    if args.profile:
        os.makedirs(args.profile, exist_ok=True)
    try:
        result = run(args)
    except RuntimeError as e:
        print(f"compare: {e}", file=sys.stderr)
        return 2
    result["summary"] = summarise(result)
    print(render(result))
    if args.json:
        Path(args.json).write_text(json.dumps(result, indent=1, default=str))
    return 0 if result["summary"]["digests"]["matched"] == result["summary"]["digests"]["checked"] else 1


if __name__ == "__main__":
    sys.exit(main())
