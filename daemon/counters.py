"""Event counters the daemon reports in ``stats`` and as Prometheus metrics."""

from __future__ import annotations

from dataclasses import asdict, dataclass, field


@dataclass
class Counters:
    reserves: int = 0
    publishes: int = 0
    acks: int = 0
    over_acks: int = 0
    frees: int = 0
    releases: int = 0
    expired: int = 0
    reclaimed_on_disconnect: int = 0
    cut_on_shutdown: int = 0
    pool_full: int = 0
    too_large: int = 0
    bad_requests: int = 0
    forbidden: int = 0
    stale: int = 0
    not_found: int = 0
    sessions_dropped: int = 0
    over_quota: int = 0
    duplicate_acks: int = 0
    late_requests: int = 0
    fallbacks: dict[str, int] = field(default_factory=dict)

    def as_dict(self) -> dict[str, object]:
        return asdict(self)
