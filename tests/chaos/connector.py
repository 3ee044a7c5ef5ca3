"""The vLLM connector's books under random schedules (part of ``make chaos``): counted and retained
consumer instances of one or two ranks (tests/vllm_roles.py) load the same items, and their requests
end the way vLLM ends them: in the step that loaded them, before or after vLLM applies that step's
report; later, once the report is in; or aborted while the step is on the ranks. Steps are sent a step
ahead of their reports (async scheduling), and a rank sometimes dies before it acks.

Every load is checked against the item's own bytes, no instance may find an item gone that was made
for it, and after each round the daemon's books must balance: a counted item freed by exactly the
acks of the instances it was made for, a retained one once evicted, no hold, lease or key left, no
over-ack and nothing expired. Prints what it tried; exits 1 if anything did not hold.

    python -m tests.chaos.connector --seconds 120 --seed 1
"""

from __future__ import annotations

import argparse
import json
import random
import shutil
import sys
import tempfile
import time
from collections import Counter
from pathlib import Path

from mmfeat.client import Client, Namespace
from mmfeat.integrations.vllm import ConnectorSettings
from mmfeat.testing import worker_context
from tests.conftest import start_daemon
from tests.vllm_roles import NS, Engine, Feature, Request

RETAIN_S = 600.0  # past the run: a retained item ends by its eviction, never by its TTL


def _check(ok: bool, what: str) -> None:
    if not ok:
        raise AssertionError(what)


def _instance(cons: Engine, prefix: str, hashes: list[str], rng: random.Random, tried: Counter) -> int:
    """One consumer instance loads ``hashes`` (one request per item) in one step or two; returns how many
    loads each of its ranks made."""
    reqs = [Request(f"{prefix}-{i}", [Feature(h)]) for i, h in enumerate(hashes)]
    cut = rng.randint(1, len(reqs) - 1) if len(reqs) > 1 and rng.random() < 0.5 else len(reqs)
    steps = [reqs[:cut], reqs[cut:]] if cut < len(reqs) else [reqs]
    sent = []
    for i, step in enumerate(steps):
        meta, compute = cons.schedule(step)
        _check(compute == [] and sorted(meta.loads) == sorted(f.identifier for r in step for f in r.mm_features),
               f"{prefix}: an item made for this instance was gone ({compute} encoded)")
        aborted = [r for r in step if rng.random() < 0.2]
        cons.finish(aborted)  # aborted while the step is on the ranks: they load it all the same
        tried["aborted_in_flight"] += len(aborted)
        last = i == len(steps) - 1
        ranks = len(cons.procs)
        kill = rng.randrange(ranks) if last and ranks > 1 and rng.random() < 0.15 else None
        tried["ranks_killed"] += kill is not None
        report = cons.run(meta, compute, kill_rank=kill, apply=False)
        _check(not report.failed, f"{prefix}: a load failed: {report.failed}")
        sent.append((step, aborted, report))
        tried["steps_ahead_of_reports"] += len(sent) > 1
    loads = 0
    for step, aborted, report in sent:
        ending = [r for r in step if r not in aborted and rng.random() < 0.7]  # the rest live on
        finish_first = rng.random() < 0.5
        tried["finish_before_report" if finish_first and ending else "report_before_finish"] += 1
        cons.end_step(ending, report, finish_first)
        cons.finish([r for r in step if r not in aborted and r not in ending])
        loads += len(report.loaded)
    _check(cons.side.unsettled_loads() == 0, f"{prefix}: loads left in the scheduler's books")
    _check(cons.side.counters["hold_misses"] == 0 and cons.side.counters["load_failures"] == 0,
           f"{prefix}: {dict(cons.side.counters)}")
    return loads


def _round(daemon, rt: str, n: int, ctx, rng: random.Random, tried: Counter) -> None:
    lifetime = rng.choice(["counted", "retained"])
    ranks, instances = rng.choice([1, 2]), rng.choice([2, 3])
    hashes = [f"r{n}-img{i}" for i in range(rng.randint(1, 3))]
    keys = [Namespace(**NS).key(h) for h in hashes]
    settings = ConnectorSettings(lifetime=lifetime, consumers=ranks * instances, retain_ttl_s=RETAIN_S)
    tried[f"{lifetime}_rounds"] += 1
    prod = Engine(rt, settings, producer=True, consumer=False, ctx=ctx)
    made = [Request(f"e{n}-{i}", [Feature(h)]) for i, h in enumerate(hashes)]
    prod.step(made)
    prod.finish(made)
    prod.close()
    for k in range(instances):
        cons = Engine(rt, settings, producer=False, consumer=True, ranks=ranks, ctx=ctx)
        try:
            loads = _instance(cons, f"r{n}-pd{k}", hashes, rng, tried)
        finally:
            alive = sum(p.is_alive() for p in cons.procs)
            checked = cons.close()
        _check(checked == loads * alive, f"round {n} instance {k}: {checked} loads checked, not {loads} x {alive}")
        tried["loads_checked"] += checked
        if lifetime == "counted" and k < instances - 1:
            with Client(rt, map_pools=False) as c:
                _check(all(c.has_many(keys)), f"round {n}: instance {k} took a later instance's count")
    if lifetime == "retained":
        with Client(rt, map_pools=False) as c:
            for key in keys:
                c.evict(key)
    s = daemon.wait_for(lambda s: s["pools"][0]["used"] == 0 and sum(s["leases"].values()) == 0
                        and s["holds"] == 0, timeout=30, what=f"round {n}'s books to balance")
    _check(s["counters"]["over_acks"] == 0 and s["counters"]["expired"] == 0
           and s["counters"]["holds_expired"] == 0, f"round {n}: {s['counters']}")


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--seconds", type=float, default=120.0)
    p.add_argument("--seed", type=int, default=1)
    args = p.parse_args(argv)
    rng = random.Random(args.seed)
    root = Path(tempfile.mkdtemp(prefix="mmf-chaos-connector-", dir="/tmp"))
    runtime = root / "rt"
    runtime.mkdir(mode=0o700)
    daemon = start_daemon(runtime, "--pool-mb", "64", log=root / "mmfeatd.log")
    ctx = worker_context()
    tried: Counter[str] = Counter()
    rounds, failure = 0, None
    try:
        end = time.monotonic() + args.seconds
        while time.monotonic() < end:
            _round(daemon, str(runtime), rounds, ctx, rng, tried)
            rounds += 1
    except Exception as e:  # a rank that read wrong bytes dies, and its step's report never comes
        failure = f"{type(e).__name__}: {e}"
    finally:
        daemon.stop()
        daemon.proc.communicate()
        shutil.rmtree(root, ignore_errors=True)
    print(json.dumps({"seconds": args.seconds, "seed": args.seed, "rounds": rounds, "tried": dict(tried),
                      "failure": failure}, indent=2))
    ok = failure is None and rounds > 0
    print("connector chaos: " + ("held" if ok else "FAILED"))
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
