"""The figures of tests/vllm_engine/compare.py: medians of the warm rounds per connector and item size,
mmfeat's ratios to vLLM's example connector, the targets the next work is judged by (printed, never
asserted), and the table."""

from __future__ import annotations

import statistics
from typing import Any

HIDDEN = 512  # an item is (bytes / 1 KiB) tokens of 512 bf16 values
MiB = 1 << 20

# The targets: save <= 1.0x the example from 1 MiB and <= 2x below; load + first use <= 1.0x at every size;
# each of mmfeat's scheduler halves <= 0.3 ms per item.
SAVE_TARGET_SMALL, SAVE_TARGET, LOAD_TARGET, SCHEDULER_TARGET_S = 2.0, 1.0, 1.0, 0.3e-3

COLUMNS = {  # column -> (process, the calls summed; None: every call of that process)
    "save": ("producer_worker", ["save_caches"]),
    "load": ("consumer_worker", ["load_and_first_use"]),
    "producer_scheduler": ("producer_scheduler", None),
    "consumer_scheduler": ("consumer_scheduler", None),
}


def item_shape(size: int) -> tuple[int, int]:
    if size <= 0 or size % (2 * HIDDEN):
        raise ValueError(f"an item's size must be a positive multiple of {2 * HIDDEN} bytes, not {size}")
    return size // (2 * HIDDEN), HIDDEN


def size_label(n: int) -> str:
    return f"{n // MiB} MiB" if n >= MiB and n % MiB == 0 else f"{n // 1024} KiB" if n % 1024 == 0 else f"{n} B"


def _value(record: dict[str, Any], column: str) -> float:
    proc, calls = COLUMNS[column]
    seconds = record["seconds"][proc]
    return sum(seconds.values()) if calls is None else sum(seconds[c] for c in calls)


def summarise(result: dict[str, Any]) -> dict[str, Any]:
    warm = [r for r in result["records"] if r["round"] >= 1]
    checked = [r for r in result["records"]]
    rows = []
    for size in result["sizes"]:
        row: dict[str, Any] = {"size": size}
        for name in ("mmfeat", "example"):
            mine = [r for r in warm if r["connector"] == name and r["size"] == size]
            for column in COLUMNS:
                row[f"{name}_{column}_s"] = statistics.median(_value(r, column) for r in mine)
        for column in ("save", "load"):
            row[f"{column}_ratio"] = row[f"mmfeat_{column}_s"] / row[f"example_{column}_s"]
        rows.append(row)
    calls: dict[str, dict[str, dict[str, float]]] = {}
    for name in ("mmfeat", "example"):
        calls[name] = {}
        for proc in ("producer_scheduler", "consumer_scheduler", "producer_worker", "consumer_worker"):
            mine = [r["seconds"][proc] for r in warm if r["connector"] == name]
            ops = list(dict.fromkeys(op for s in mine for op in s))  # in the order of the calls
            calls[name][proc] = {op: statistics.median(s.get(op, 0.0) for s in mine) for op in ops}
    matched = sum(1 for r in checked if r["loaded"] is not None and r["loaded"] == r["saved"])
    return {"rows": rows, "calls": calls, "digests": {"checked": len(checked), "matched": matched,
                                                      "mismatched": [(r["connector"], r["size"], r["round"])
                                                                     for r in checked if r["loaded"] != r["saved"]]}}


def _ms(s: float) -> str:
    ms = s * 1e3
    return f"{ms:.3f}" if ms < 1 else f"{ms:.2f}" if ms < 10 else f"{ms:.1f}"


def _verdict(ok: bool) -> str:
    return "met" if ok else "missed"


def render(result: dict[str, Any]) -> str:
    summary, m = result["summary"], result["machine"]
    warm = result["rounds"]
    lines = [f"vLLM EC connectors: mmfeat against vLLM's ECExampleConnector, ms per item, medians of {warm} warm "
             f"round{'s' if warm != 1 else ''} (1 more not counted)",
             f"machine: {m['cores']} cores, {m['cpu']}, load average {m['load_1m']:.1f} at the end; "
             f"processes started in {result['start_s']:.0f} s",
             f"command: {result['command']}", "",
             "| item | save: mmfeat / example | load + first use: mmfeat / example | producer's scheduler half: "
             "mmfeat / example | consumer's scheduler half: mmfeat / example |",
             "|---|---|---|---|---|"]
    for row in summary["rows"]:
        cells = [size_label(row["size"])]
        for column in ("save", "load"):
            cells.append(f"{_ms(row[f'mmfeat_{column}_s'])} / {_ms(row[f'example_{column}_s'])} "
                         f"({row[f'{column}_ratio']:.2f}x)")
        for column in ("producer_scheduler", "consumer_scheduler"):
            cells.append(f"{_ms(row[f'mmfeat_{column}_s'])} / {_ms(row[f'example_{column}_s'])}")
        lines.append("| " + " | ".join(cells) + " |")
    d = summary["digests"]
    lines += ["", f"digests: {d['matched']} of {d['checked']} loads had their save's bytes"
              + (f"; mismatched: {d['mismatched']}" if d["mismatched"] else "")]
    counts = result.get("daemon")
    if counts:
        lines.append(f"mmfeat's consumer lookups, every round: {counts['items']} items, "
                     f"{counts['hold_keys']} hold_keys "
                     f"round trips, {counts['table_pins']} reads pinned in the lease table (the key feed's hits)")
    lines.append("")
    saves, loads, halves = [], [], []
    for row in summary["rows"]:
        limit = SAVE_TARGET if row["size"] >= MiB else SAVE_TARGET_SMALL
        label = size_label(row["size"])
        saves.append(f"{label} {row['save_ratio']:.2f}x {_verdict(row['save_ratio'] <= limit)}")
        loads.append(f"{label} {row['load_ratio']:.2f}x {_verdict(row['load_ratio'] <= LOAD_TARGET)}")
        both = row["mmfeat_producer_scheduler_s"] + row["mmfeat_consumer_scheduler_s"]
        halves.append(f"{label} {_ms(both)} ms {_verdict(both <= SCHEDULER_TARGET_S)}")
    lines += ["targets (printed, not asserted):",
              f"  save <= {SAVE_TARGET:g}x the example from 1 MiB, <= {SAVE_TARGET_SMALL:g}x below: "
              + "; ".join(saves),
              f"  load + first use <= {LOAD_TARGET:g}x the example: " + "; ".join(loads),
              f"  mmfeat's scheduler halves <= {SCHEDULER_TARGET_S * 1e3:g} ms per item (both together): "
              + "; ".join(halves), ""]
    lines.append("the other calls, µs per item, median over the warm items of every size (later_: the request's "
                 "next step):")
    in_table = {c for _, calls in COLUMNS.values() for c in calls or ()}
    for name, procs in summary["calls"].items():
        for proc, ops in procs.items():
            lines.append(f"  {name} {proc.replace('_', ' ')}: "
                         + ", ".join(f"{op} {s * 1e6:.0f}" for op, s in ops.items() if op not in in_table))
    return "\n".join(lines)
