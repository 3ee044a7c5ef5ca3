"""What the connector's two halves tell each other each step. Both travel between processes by
vLLM's own serialisation (the scheduler's metadata is broadcast to every worker, the workers' reports
are aggregated on the way back), so they hold only builtins and descriptor bytes."""

from __future__ import annotations

import dataclasses


@dataclasses.dataclass
class StepLoads:
    """Scheduler to workers: the items each rank loads this step (mm_hash to the bytes of the hold's
    descriptor, which each rank reads and acks once), the items a producer should publish again if the
    pool no longer has them, and the mm_hashes vLLM frees this step."""

    loads: dict[str, bytes] = dataclasses.field(default_factory=dict)
    saves: list[str] = dataclasses.field(default_factory=list)


@dataclasses.dataclass
class StepReport:
    """Workers to scheduler, summed over ranks: descriptors saved (mm_hash to descriptor bytes),
    loads done per item (the number of ranks), and items a rank could not load."""

    saved: dict[str, bytes] = dataclasses.field(default_factory=dict)
    loaded: dict[str, int] = dataclasses.field(default_factory=dict)
    failed: dict[str, str] = dataclasses.field(default_factory=dict)

    def aggregate(self, other: "StepReport") -> "StepReport":
        loaded = dict(self.loaded)
        for h, n in other.loaded.items():
            loaded[h] = loaded.get(h, 0) + n
        return StepReport({**self.saved, **other.saved}, loaded, {**self.failed, **other.failed})

    def __bool__(self) -> bool:
        return bool(self.saved or self.loaded or self.failed)
