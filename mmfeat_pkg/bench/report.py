"""Turn measurements into rows, ratios, target verdicts, a terminal table, JSON and a plot."""

from __future__ import annotations

import json
import math
import statistics
from pathlib import Path
from typing import Any, Optional

MiB = 1 << 20


def human_size(n: int) -> str:
    for unit, scale in (("G", 1 << 30), ("M", MiB), ("K", 1024)):
        if n >= scale and n % scale == 0:
            return f"{n // scale}{unit}"
    return str(n)


def parse_size(text: str) -> int:
    text = text.strip().upper().removesuffix("B").removesuffix("I")
    scale = {"K": 1024, "M": MiB, "G": 1 << 30}.get(text[-1:], 1)
    return int(float(text.rstrip("KMG")) * scale)


def make_row(mode: str, size: int, consumers: int, latencies: list[float], elapsed: float,
             first_held: Optional[list[float]] = None) -> dict[str, Any]:
    """A row: features/s and p50/p99 from put to the last consumer's read of every byte; with
    ``first_held``, also p50/p99 from put to the first consumer holding the feature as a tensor."""
    lat = sorted(latencies)
    fps = len(lat) / elapsed if elapsed > 0 else float("inf")
    held = {}
    if first_held:
        h = sorted(first_held)
        held = {"held_p50_us": statistics.median(h) * 1e6, "held_p99_us": _p99(h) * 1e6}
    return {
        "mode": mode,
        "size": size,
        "consumers": consumers,
        "features_per_s": fps,
        "seconds": elapsed,
        "gb_per_s": fps * size / 1e9,
        "p50_us": statistics.median(lat) * 1e6,
        "p99_us": _p99(lat) * 1e6,
        **held,
    }


def _p99(ordered: list[float]) -> float:
    return ordered[min(len(ordered) - 1, int(len(ordered) * 0.99))]


def add_ratios(rows: list[dict[str, Any]]) -> None:
    """Each row's features/s over the memcpy limit, over zmq_bytes and over torch_mp at the same size,
    consumers and round: a ratio is taken between runs made minutes apart at most."""
    def key(r: dict[str, Any], *fields: str) -> tuple:
        return tuple(r[f] for f in fields) + (r.get("round", 0),)

    limit = {key(r, "size"): r["features_per_s"] for r in rows if r["mode"] == "memcpy"}
    zmq = {key(r, "size", "consumers"): r["features_per_s"] for r in rows if r["mode"] == "zmq_bytes"}
    tmp = {key(r, "size", "consumers"): r["features_per_s"] for r in rows if r["mode"] == "torch_mp"}
    shm = {key(r, "size", "consumers"): r["features_per_s"] for r in rows if r["mode"] == "shm_ring"}
    for r in rows:
        lim, z, t, ring = (limit.get(key(r, "size")), zmq.get(key(r, "size", "consumers")),
                           tmp.get(key(r, "size", "consumers")), shm.get(key(r, "size", "consumers")))
        r["x_limit"] = r["features_per_s"] / lim if lim else None
        r["x_zmq"] = r["features_per_s"] / z if z else None
        r["x_torch_mp"] = r["features_per_s"] / t if t else None
        r["x_shm_ring"] = r["features_per_s"] / ring if ring else None


def combine_rounds(rows: list[dict[str, Any]], keys: tuple[str, ...] = ("mode", "size", "consumers"),
                   spread: tuple[str, ...] = ("x_zmq", "x_shm_ring")) -> list[dict[str, Any]]:
    """One row per ``keys``: the median of its rounds, number by number, ratios included (each round's
    own ratio, so a round where the whole machine ran slow moves both sides of it), with the lowest and
    highest of each ``spread`` ratio over the rounds. Rows of a single round come back as they are."""
    groups: dict[tuple, list[dict[str, Any]]] = {}
    for r in rows:
        groups.setdefault(tuple(r[k] for k in keys), []).append(r)
    out = []
    for runs in groups.values():
        if len(runs) == 1:
            out.append({k: v for k, v in runs[0].items() if k != "round"})
            continue
        row: dict[str, Any] = {}
        for f in dict.fromkeys(k for r in runs for k in r):
            if f == "round":
                continue
            values = [r.get(f) for r in runs]
            numbers = [v for v in values if isinstance(v, (int, float)) and not isinstance(v, bool)]
            row[f] = (statistics.median(numbers) if f not in keys and numbers
                      else next((v for v in values if v is not None), None))
        for ratio in spread:
            ratios = [r[ratio] for r in runs if r.get(ratio) is not None]
            if ratios:
                row[f"{ratio}_min"], row[f"{ratio}_max"] = min(ratios), max(ratios)
        daemon = [r.get("daemon_cpu_us") for r in runs]
        if all(isinstance(v, (int, float)) for v in daemon) and all(r.get("seconds") for r in runs):
            # mmfeatd's CPU comes in wake-ups every 5-400 ms: a median picks one short row's one or two of
            # them. The rounds together are one longer look (rows of a mode, size and consumers have the
            # same count): their mean, over the sum of their seconds.
            row["daemon_cpu_us"] = statistics.fmean(daemon)
            row["daemon_seconds"] = sum(r["seconds"] for r in runs)
        row["rounds"] = len(runs)
        out.append(row)
    return out


# The project's reference goals (docs/performance.md), as (mode, baseline, size, lowest ratio of
# features/s), for 1 and 2 consumers: the default client against what it replaces, plain ZeroMQ bytes;
# the pool path against the least a shared-memory transport costs, a plain ring.
RATIO_GOALS = [("client_default", "zmq_bytes", 64 * 1024, 1.0), ("client_default", "zmq_bytes", MiB, 1.3),
               ("client_default", "zmq_bytes", 16 * MiB, 2.0), ("pool_view", "shm_ring", 64 * 1024, 0.8),
               ("pool_view", "shm_ring", MiB, 0.9), ("pool_view", "shm_ring", 16 * MiB, 0.9),
               ("pool_view", "shm_ring", 64 * MiB, 0.9)]
_RATIO_FIELD = {"zmq_bytes": "x_zmq", "shm_ring": "x_shm_ring"}
DAEMON_US_PER_FEATURE = 10.0
# mmfeatd's CPU is mostly its wake-ups (sweeps every 5-400 ms as the rate needs), so over a shorter row
# its column is one or two of them divided by the row's features: the verdict says so.
DAEMON_STEADY_ROW_S = 1.0


def targets(rows: list[dict[str, Any]], control: list[dict[str, Any]]) -> list[tuple[str, bool, str]]:
    """(target, met, what was measured) for each target the issues set that this run covers."""
    by = {(r["mode"], r["size"], r["consumers"]): r for r in rows}
    out: list[tuple[str, bool, str]] = []
    for mode, baseline, size, goal in RATIO_GOALS:
        field = _RATIO_FIELD[baseline]
        for n in (1, 2):
            r = by.get((mode, size, n))
            if r is None or r.get(field) is None:
                continue
            x = r[field]
            spread = f" (rounds {r[field + '_min']:.2f}-{r[field + '_max']:.2f}x)" if field + "_min" in r else ""
            out.append((f"{human_size(size)} x{n}: {mode} >= {goal}x {baseline}", x >= goal, f"{x:.2f}x{spread}"))
    for (mode, size, n), r in sorted(by.items()):
        if mode != "pool_view":
            continue
        if size >= MiB and r.get("x_torch_mp") is not None:
            x = r["x_torch_mp"]
            out.append((f"{human_size(size)} x{n}: pool zero-copy >= 10x torch_mp", x >= 10, f"{x:.2f}x"))
        if size >= 16 * MiB and n == 1 and r.get("x_limit") is not None:
            out.append((f"{human_size(size)} x{n}: pool zero-copy >= 0.7x memcpy", r["x_limit"] >= 0.7,
                        f"{r['x_limit']:.2f}x"))
        if r.get("daemon_cpu_us") is not None:
            us, rounds = r["daemon_cpu_us"], r.get("rounds", 1)
            seconds = r.get("daemon_seconds", r.get("seconds"))
            short = ""
            if seconds is not None and seconds < DAEMON_STEADY_ROW_S:
                steady = math.ceil(DAEMON_STEADY_ROW_S * r["features_per_s"] / rounds / 100) * 100
                over = (f"a row of {seconds:.2f} s" if rounds == 1
                        else f"{rounds} rounds' rows of {seconds:.2f} s in all")
                short = (f" over {over}, too short for the daemon's wake-ups to average out: --count {steady} "
                         "or more measures its steady state")
            out.append((f"{human_size(size)} x{n}: mmfeatd CPU <= {DAEMON_US_PER_FEATURE:g} us per feature",
                        us <= DAEMON_US_PER_FEATURE, f"{us:.0f} us{short}"))
    for c in control:
        x = c["mmfeat"]["p50_us"] / c["echo"]["p50_us"]
        out.append((f"control p50 with {c['clients']} client(s) <= 1.5x bare echo", x <= 1.5, f"{x:.2f}x"))
    return out


def render(rows: list[dict[str, Any]], control: list[dict[str, Any]], verdicts: list[tuple[str, bool, str]]) -> str:
    lines = [
        f"{'':>9} {'':>6} {'':<15} {'':>10} {'':>8} {'':>10} {'':>10} {'':>8} {'':>7} {'':>7}"
        f"  {'CPU us per feature':^25}",
        f"{'consumers':>9} {'size':>6} {'mode':<15} {'feat/s':>10} {'GB/s':>8} {'p50 us':>10} {'p99 us':>10}"
        f" {'x limit':>8} {'x zmq':>7} {'x shm':>7}"
        f"  {'producer':>8} {'consumer':>8} {'mmfeatd':>7}",
    ]
    order = {m: i for i, m in enumerate(("memcpy", "floor", "shm_ring", "pool_view", "pool_copy", "client_default",
                                         "inline", "zmq_bytes", "torch_mp", "ray", "burst_paced", "burst"))}
    for r in sorted(rows, key=lambda r: (r["consumers"], r["size"], order.get(r["mode"], 99))):
        xl = f"{r['x_limit']:.2f}" if r.get("x_limit") is not None else "-"
        xz = f"{r['x_zmq']:.2f}" if r.get("x_zmq") is not None else "-"
        xs = f"{r['x_shm_ring']:.2f}" if r.get("x_shm_ring") is not None else "-"
        lines.append(
            f"{r['consumers']:>9} {human_size(r['size']):>6} {r['mode']:<15} {r['features_per_s']:>10.0f}"
            f" {r['gb_per_s']:>8.2f}"
            f" {r['p50_us']:>10.0f} {r['p99_us']:>10.0f} {xl:>8} {xz:>7} {xs:>7}"
            f"  {_us(r.get('producer_cpu_us')):>8} {_us(r.get('consumer_cpu_us')):>8} {_us(r.get('daemon_cpu_us')):>7}"
        )
    if any(r["mode"] == "ray" for r in rows):
        lines.append("ray: producer is the Ray driver; its mmfeatd column is Ray's own processes (GCS, raylet with "
                     "the object store, their agents and idle workers)")
    lines += _held_lines(rows, order)
    if control:
        lines += ["", "control plane: reserve+publish+ack cycles/s, and per round trip p50/p99 (us)"]
        lines.append(f"{'clients':>7} {'mmfeat cyc/s':>13} {'p50':>7} {'p99':>7} {'echo cyc/s':>11} {'p50':>7}"
                     f" {'p99':>7} {'p50 ratio':>10}")
        for c in control:
            m, e = c["mmfeat"], c["echo"]
            lines.append(
                f"{c['clients']:>7} {m['cycles_per_s']:>13.0f} {m['p50_us']:>7.0f} {m['p99_us']:>7.0f}"
                f" {e['cycles_per_s']:>11.0f}"
                f" {e['p50_us']:>7.0f} {e['p99_us']:>7.0f} {m['p50_us'] / e['p50_us']:>10.2f}"
            )
    if verdicts:
        lines += ["", "the project's reference goals (set for its reference machine, docs/performance.md; "
                      "a smaller or busier machine may miss them):"]
        lines += [f"  {'met   ' if ok else 'MISSED'} {name}: {got}" for name, ok, got in verdicts]
    return "\n".join(lines)


def render_burst(rows: list[dict[str, Any]], burst: int) -> str:
    """mmfeatd's CPU per feature for a burst put ahead of its consumer over the same features paced by
    the window, per size and consumer count: the cost of a producer that runs ahead."""
    lines = ["", f"burst: {burst} features put as fast as the producer can, against {burst} paced by the window "
             "(pool_view); mmfeatd CPU us per feature",
             f"{'consumers':>9} {'size':>6} {'paced':>8} {'burst':>8} {'ratio':>7}"]
    paced = {(r["size"], r["consumers"]): r.get("daemon_cpu_us") for r in rows if r["mode"] == "burst_paced"}
    for r in sorted((r for r in rows if r["mode"] == "burst"), key=lambda r: (r["consumers"], r["size"])):
        p, b = paced.get((r["size"], r["consumers"])), r.get("daemon_cpu_us")
        ratio = f"{b / p:.2f}" if p and b is not None else "-"
        lines.append(f"{r['consumers']:>9} {human_size(r['size']):>6} {_us(p):>8} {_us(b):>8} {ratio:>7}")
        if r.get("fallbacks"):
            lines.append(f"{'':>9} {'':>6} the burst fell back inline: {r['fallbacks']}")
    return "\n".join(lines)


def _held_lines(rows: list[dict[str, Any]], order: dict[str, int]) -> list[str]:
    """The latency table: put -> the first consumer holds the tensor, against zmq_bytes in the same run
    (x zmq: zmq_bytes's p50 over the mode's, so above 1 is sooner)."""
    held = [r for r in rows if r.get("held_p50_us") is not None]
    if not held:
        return []
    zmq = {(r["size"], r["consumers"]): r["held_p50_us"] for r in held if r["mode"] == "zmq_bytes"}
    lines = ["", "latency: put -> first consumer holds the tensor (us)",
             f"{'consumers':>9} {'size':>6} {'mode':<15} {'p50 us':>10} {'p99 us':>10} {'x zmq':>7}"]
    for r in sorted(held, key=lambda r: (r["consumers"], r["size"], order.get(r["mode"], 99))):
        z = zmq.get((r["size"], r["consumers"]))
        xz = f"{z / r['held_p50_us']:.2f}" if z and r["held_p50_us"] > 0 else "-"
        lines.append(f"{r['consumers']:>9} {human_size(r['size']):>6} {r['mode']:<15} {r['held_p50_us']:>10.0f}"
                     f" {r['held_p99_us']:>10.0f} {xz:>7}")
    return lines


def _us(v: Optional[float]) -> str:
    return "-" if v is None else f"{v:.0f}"


def json_records(rows: list[dict[str, Any]], control: list[dict[str, Any]]) -> list[dict[str, Any]]:
    records = [dict(r) for r in rows]
    for c in control:
        for side in ("mmfeat", "echo"):
            v = c[side]
            records.append(
                {"mode": f"control_{side}", "size": 0, "consumers": c["clients"], "features_per_s": v["cycles_per_s"],
                 "gb_per_s": 0.0, "p50_us": v["p50_us"], "p99_us": v["p99_us"]}
            )
    return records


def write_json(path: Path, rows: list[dict[str, Any]], control: list[dict[str, Any]]) -> None:
    path.write_text(json.dumps(json_records(rows, control), indent=1) + "\n")


def _pyplot() -> Any:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    return plt


def plot_unavailable() -> Optional[str]:
    """None when ``plot`` can draw, else why not."""
    try:
        _pyplot()
    except ImportError:
        return "matplotlib is not installed: pip install matplotlib (mmfeat's [plot] extra)"
    return None


def plot(path: Path, rows: list[dict[str, Any]]) -> Optional[str]:
    """Throughput against size, one line per mode, one panel per consumer count. None, or why not."""
    why_not = plot_unavailable()
    if why_not:
        return why_not
    plt = _pyplot()
    counts = sorted({r["consumers"] for r in rows if r["mode"] != "memcpy"}) or [1]
    fig, axes = plt.subplots(1, len(counts), figsize=(5 * len(counts), 4), squeeze=False)
    for ax, n in zip(axes[0], counts):
        for mode in sorted({r["mode"] for r in rows}):
            pts = sorted((r["size"], r["gb_per_s"]) for r in rows
                         if r["mode"] == mode and (r["consumers"] == n or mode == "memcpy"))
            if pts:
                ax.plot([p[0] for p in pts], [p[1] for p in pts], marker="o", label=mode,
                        linestyle="--" if mode == "memcpy" else "-")
        ax.set_xscale("log", base=2)
        ax.set_yscale("log")
        ax.set_xlabel("feature size (bytes)")
        ax.set_ylabel("GB/s (payload, to the last consumer)")
        ax.set_title(f"{n} consumer(s)")
        ax.grid(True, which="both", alpha=0.3)
    axes[0][0].legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    return None
