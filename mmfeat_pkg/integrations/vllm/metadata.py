"""What the connector's two halves tell each other each step. Both travel between processes by
vLLM's own serialisation (the scheduler's metadata is broadcast to every worker, the workers' reports
are aggregated on the way back), so they hold only builtins and descriptor bytes."""

from __future__ import annotations

import dataclasses


@dataclasses.dataclass
class StepLoads:
    """Scheduler to workers: the items each rank loads this step (mm_hash to the bytes of the hold's
    descriptor, which each rank reads and acks once), the items a producer should publish again if the
    pool no longer has them, and the step's number, which each rank's report of these loads names."""

    loads: dict[str, bytes] = dataclasses.field(default_factory=dict)
    saves: list[str] = dataclasses.field(default_factory=list)
    step: int = 0


@dataclasses.dataclass
class StepReport:
    """Workers to scheduler, summed over ranks: descriptors saved (mm_hash to descriptor bytes),
    loads done per item (the number of ranks), items a rank could not load, the acks of each load's
    descriptor that went through (the number of ranks, loaded or not), and the step whose loads these
    are (0: no loads). Every rank of one report ran the same step."""

    saved: dict[str, bytes] = dataclasses.field(default_factory=dict)
    loaded: dict[str, int] = dataclasses.field(default_factory=dict)
    failed: dict[str, str] = dataclasses.field(default_factory=dict)
    acked: dict[str, int] = dataclasses.field(default_factory=dict)
    step: int = 0

    def aggregate(self, other: "StepReport") -> "StepReport":
        return StepReport({**self.saved, **other.saved}, _sum(self.loaded, other.loaded),
                          {**self.failed, **other.failed}, _sum(self.acked, other.acked), max(self.step, other.step))

    def __bool__(self) -> bool:
        return bool(self.saved or self.loaded or self.failed or self.acked)


def _sum(a: dict[str, int], b: dict[str, int]) -> dict[str, int]:
    out = dict(a)
    for h, n in b.items():
        out[h] = out.get(h, 0) + n
    return out
