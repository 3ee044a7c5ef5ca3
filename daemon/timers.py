"""The control loop's timers: when each of its periodic jobs is next due, by name, in one table.

Some timers wake the loop; others only ride on a wake-up that something else caused (a status line or
a heap trim is no reason to wake an idle daemon), so the table says which is which and ``wake_at``
looks at the first kind alone.
"""

from __future__ import annotations

import math


class Timers:
    def __init__(self) -> None:
        self._at: dict[str, float] = {}
        self._wakes: set[str] = set()

    def add(self, name: str, at: float, wakes: bool = True) -> None:
        """A timer first due at ``at``; ``wakes``: the loop wakes for it, not only runs it when awake."""
        if name in self._at:
            raise ValueError(f"timer {name!r} exists already")
        self._at[name] = at
        if wakes:
            self._wakes.add(name)

    def __contains__(self, name: str) -> bool:
        return name in self._at

    def __getitem__(self, name: str) -> float:
        return self._at[name]

    def __setitem__(self, name: str, at: float) -> None:
        if name not in self._at:
            raise KeyError(f"no timer {name!r}; add it first")
        self._at[name] = at

    def due(self, name: str, now: float) -> bool:
        """Whether timer ``name`` is due at ``now``; False for a timer this loop does not have."""
        at = self._at.get(name)
        return at is not None and now >= at

    def not_after(self, name: str, at: float) -> None:
        """Bring timer ``name`` in to ``at`` if it is set later."""
        if at < self._at[name]:
            self._at[name] = at

    def wake_at(self) -> float:
        """The earliest due time of the timers that wake the loop (math.inf: none)."""
        return min((self._at[n] for n in self._wakes), default=math.inf)
