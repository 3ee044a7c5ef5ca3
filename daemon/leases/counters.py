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
    # Publishes refused because the lease's reserve_ttl had passed (its range freed then).
    late_publishes: int = 0
    reclaimed_on_disconnect: int = 0
    unready_ended: int = 0  # published features ended before their producer's GPU had written them
    lost_reads: int = 0  # lookups and acks of such a feature, refused LOST
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
    replies_dropped: int = 0  # control-socket replies past a peer's send mark (far past MAX_IN_FLIGHT)
    # The shared-memory path (arenas and the lease table's ack words).
    arenas_granted: int = 0
    arenas_refused: int = 0  # pool full, slots used up, or the session's limit: its producer reserves instead
    arenas_returned: int = 0
    arenas_freed: int = 0
    arena_publishes: int = 0
    # Of those, the ones adopted one by one as live leases (the rest ended in a sweep's batch): a count
    # that follows arena_publishes says consumers lag their producers past what sweeps wait for.
    arena_adoptions: int = 0
    table_acks: int = 0
    stray_table_acks: int = 0  # acks found in the table for a feature already ended (a late over-ack)
    bad_table_words: int = 0  # words a client wrote that the daemon refused (SPEC.md, section 9)
    sessions_cut: int = 0  # sessions cut for words refused in slots they hold, past max_refused_words
    leases_cut: int = 0  # their leases, ended with them
    sweeps: int = 0  # sweeps that found a STATE or ACKS word changed since the daemon last accounted for it
    sweeps_skipped: int = 0  # sweeps, and requests' sweeps of their own slots, that found none changed
    # Request frames taken, on the control socket and the fd channels: the steady state of features in
    # arenas takes none per feature, so a rate that follows the features' says a producer left that path.
    requests: int = 0
    requests_by_op: dict[str, int] = field(default_factory=dict)  # of those, each known op's
    # Keys and lifetimes (SPEC.md, section 3, "Keys and lifetimes").
    dedups: int = 0  # keyed puts whose key named a live feature already: answered with it, or left unkeyed (bind)
    binds: int = 0  # keys and lifetimes bound to features published in arenas
    key_hits: int = 0
    key_misses: int = 0
    holds: int = 0  # holds granted
    holds_ended: int = 0  # holds over: by their acks, their ack_ttl, their holder's end
    holds_expired: int = 0  # of those, by ack_ttl
    holds_reclaimed: int = 0  # of those, because their holder's session ended
    table_pins: int = 0  # reads pinned on retained features in the lease table (seen by sweeps)
    pins_forgiven: int = 0  # of those, the ones whose acks had not come when ack_ttl passed and the feature ended
    retained_acks: int = 0  # acks of a retained feature's own descriptor: it counts none, so they change nothing
    retained_expired: int = 0  # retained features freed once their retain_ttl passed with no hold
    evictions: int = 0  # retained features freed because a reserve or hold needed their space
    evicted_by_key: int = 0
    fallbacks: dict[str, int] = field(default_factory=dict)

    def as_dict(self) -> dict[str, object]:
        return asdict(self)
