"""The target `mmfeat bench --remote` judges, and when its rounds are too few or too far apart to judge it.

On a shared machine one round's ratio of a pull to the bare NIXL READ has been off by 2-3x: a verdict
from one round says which way the machine's load went, not how pulls compare. The bench runs
REMOTE_ROUNDS rounds unless told otherwise, and judges only the median of at least that many whose
lowest and highest ratios are within SPREAD_LIMIT of each other.
"""

from __future__ import annotations

from typing import Any

REMOTE_ROUNDS = 3
# Rounds whose ratios differ by more than this (highest over lowest) leave a median at the 0.8x target
# that another run could put on either side of it.
SPREAD_LIMIT = 1.5
TARGET = 0.8  # 16 MiB pulls, each against the bare NIXL READ of its own round


def verdict(mode: str, row: dict[str, Any]) -> str:
    """One line for a 16 MiB ``mode`` row of ratios_to_nixl_read: MET or MISSED, or why it cannot say."""
    ratio = row["x_nixl_read"]
    rounds = row.get("rounds", 1)
    what = f"16M: {mode} >= {TARGET}x the bare NIXL READ: {ratio:.2f}x"
    if rounds < REMOTE_ROUNDS:
        return (f"TOO FEW ROUNDS to judge {what} ({rounds} round{'s' if rounds > 1 else ''}; "
                f"run --rounds {REMOTE_ROUNDS} or more)")
    low, high = row["x_nixl_read_min"], row["x_nixl_read_max"]
    spread = f" (rounds {low:.2f}-{high:.2f}x)"
    if low <= 0 or high / low > SPREAD_LIMIT:
        return (f"SPREAD TOO WIDE TO JUDGE {what}{spread}: the rounds differ by more than {SPREAD_LIMIT}x; "
                f"run on a quieter machine or with more --rounds")
    return f"{'MET' if ratio >= TARGET else 'MISSED'} {what}{spread}"
