"""Prometheus metrics on an optional HTTP port, with prometheus-client.

Gauges are read from a snapshot the main loop refreshes (the HTTP server runs on its own thread and
must not walk the ledger while the loop changes it); histograms are fed as events happen.
"""

from __future__ import annotations

import operator
import threading
from typing import Any, Callable, Iterator, Optional

from prometheus_client import CollectorRegistry, Histogram, start_http_server
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily

from .leases.lease import EndReason, Lease

_COUNTERS = {
    "requests": "Request frames taken on the control socket and the fd channels",
    "reserves": "Leases reserved",
    "publishes": "Leases published",
    "acks": "Consumer acknowledgements applied",
    "over_acks": "Acknowledgements beyond what a lease expected (clamped, not applied)",
    "frees": "Leases freed, for any reason",
    "releases": "Leases released by their producer",
    "expired": "Leases whose reserve_ttl or ack_ttl passed (a client's reservation is kept, not freed, until "
               "its producer publishes, releases it or ends)",
    "late_publishes": "Publishes refused because their lease's reserve_ttl had passed (the range freed then)",
    "reclaimed_on_disconnect": "RESERVED leases freed because their producer disconnected",
    "unready_ended": "Published features that ended before their producer's GPU had written them (READY behind)",
    "lost_reads": "Lookups and acks refused LOST: their feature ended before its producer's GPU wrote it",
    "pool_full": "Reserves refused because the pool was full",
    "too_large": "Reserves refused because the feature is larger than the pool",
    "bad_requests": "Requests refused as malformed",
    "forbidden": "Requests refused for a wrong token or forged lease reference",
    "stale": "Requests naming a lease from another epoch or a reused slot",
    "sessions_dropped": "Sessions dropped before attaching because too many were waiting for their fd channel",
    "over_quota": "Reserves refused because the session's leases hold max_session_mb",
    "duplicate_acks": "Retried acks recognised by their ack id and not applied again",
    "late_requests": "Requests that reached the daemon after their client's deadline and were not applied",
    "replies_dropped": "Control-socket replies dropped for a peer with far more requests in flight than allowed",
    "arenas_granted": "Arenas granted to producers",
    "arenas_refused": "Arena requests refused (pool full, slots used up, a session's limit); those producers reserve",
    "arenas_returned": "Arenas given back by their producer or at its exit",
    "arenas_freed": "Arenas whose space went back to the pool (nothing in them was live any more)",
    "arena_publishes": "Features adopted from producer arenas by the sweep",
    "arena_adoptions": "Features from arenas that became live leases one by one (not acked within the sweeps' wait)",
    "table_acks": "Acknowledgements read from the lease table by the sweep",
    "stray_table_acks": "Acknowledgements found in the lease table for features already ended",
    "bad_table_words": "Words written by clients into the lease table that the daemon refused",
    "sessions_cut": "Sessions cut because words in lease table slots they hold were refused past max_refused_words",
    "leases_cut": "Leases ended because their session was cut",
    "dedups": "Keyed puts whose key named a live feature already (answered with it, or left unkeyed by a bind)",
    "binds": "Keys and lifetimes bound to features published in producer arenas",
    "holds": "Holds granted on retained features",
    "holds_expired": "Holds that ended by ack_ttl, their readers' acks missing",
    "holds_reclaimed": "Holds that ended because their holder's session ended",
    "table_pins": "Reads pinned on retained features in the lease table, as sweeps found them",
    "pins_forgiven": "Pinned reads not acked when ack_ttl had passed and their retained feature ended",
    "retained_expired": "Retained features freed once their retain_ttl passed with no hold",
    "evictions": "Retained features nothing held, freed because a reserve or hold needed their space",
    "evicted_by_key": "Features evicted by key",
}
# Per namespace of keys (stats "namespaces"): (field, metric, help, counter or gauge).
_NAMESPACE_METRICS = (
    ("hits", "mmfeat_namespace_hits", "Lookups and holds by key that found a live feature", True),
    ("misses", "mmfeat_namespace_misses", "Lookups and holds by key that found none", True),
    ("holds", "mmfeat_namespace_holds", "Holds granted", True),
    ("evictions", "mmfeat_namespace_evictions", "Features evicted, under pressure or by key", True),
    ("expired", "mmfeat_namespace_retained_expired", "Retained features freed by their retain_ttl", True),
    ("keys", "mmfeat_namespace_keys", "Keys naming a live feature", False),
    ("bytes_retained", "mmfeat_namespace_retained_bytes", "Bytes of the retained features live under its keys", False),
)


class _StateCollector:
    def __init__(self) -> None:
        self.snapshot: Optional[dict[str, Any]] = None
        self._lock = threading.Lock()

    def update(self, snapshot: dict[str, Any]) -> None:
        with self._lock:
            self.snapshot = snapshot

    def collect(self) -> Iterator[Any]:
        with self._lock:
            s = self.snapshot
        if s is None:
            return
        pool_bytes = GaugeMetricFamily("mmfeat_pool_bytes", "Pool bytes by state",
                                       labels=["pool", "kind", "device", "state"])
        capacity = GaugeMetricFamily("mmfeat_pool_capacity_bytes", "Pool capacity", labels=["pool", "kind", "device"])
        largest = GaugeMetricFamily("mmfeat_pool_largest_free_bytes", "Largest free range",
                                    labels=["pool", "kind", "device"])
        leases = GaugeMetricFamily("mmfeat_leases", "Live leases by state", labels=["pool", "state"])
        arenas = GaugeMetricFamily("mmfeat_arenas", "Arenas granted and not yet freed",
                                   labels=["pool", "kind", "device"])
        arena_bytes = GaugeMetricFamily("mmfeat_arena_bytes", "Arena bytes: granted, in live features, slack",
                                        labels=["pool", "kind", "device", "part"])
        for p in s["pools"]:
            labels = [str(p["pool"]), p["kind"], str(p["device"])]
            capacity.add_metric(labels, p["capacity"])
            largest.add_metric(labels, p["largest_free"])
            pool_bytes.add_metric(labels + ["free"], p["free"])
            for state, n in p["bytes"].items():
                pool_bytes.add_metric(labels + [state.lower()], n)
            for state, n in p["leases"].items():
                leases.add_metric([str(p["pool"]), state.lower()], n)
            a = p["arenas"]
            arenas.add_metric(labels, a["count"])
            for part in ("bytes", "live_bytes", "slack"):
                arena_bytes.add_metric(labels + [part], a[part])
        yield from (pool_bytes, capacity, largest, leases, arenas, arena_bytes)
        yield GaugeMetricFamily("mmfeat_clients", "Clients with an attached fd channel", value=s["clients"])
        yield GaugeMetricFamily("mmfeat_expired_reserved", "Reservations past their reserve_ttl whose ranges are "
                                "kept while their producers live", value=s.get("expired_reserved") or 0)
        yield GaugeMetricFamily("mmfeat_draining", "1 while the daemon drains for shutdown", value=int(s["draining"]))
        yield GaugeMetricFamily("mmfeat_uptime_seconds", "Seconds since the daemon started", value=s["uptime_s"])
        limits = s.get("limits") or {}
        if limits:
            yield GaugeMetricFamily("mmfeat_connections", "Connections to the control socket",
                                    value=limits["connections"])
            yield CounterMetricFamily("mmfeat_connections_refused",
                                      "Connections shut down or closed past max_connections or max_clients",
                                      value=limits["connections_refused"])
            yield CounterMetricFamily("mmfeat_control_resets",
                                      "Control socket resets after peers made the daemon outgrow control_memory_mb",
                                      value=limits["control_resets"])
        counters = s["counters"]
        for name, help_text in _COUNTERS.items():
            yield CounterMetricFamily(f"mmfeat_{name}", help_text, value=counters[name])
        yield from _mesh_metrics(s.get("mesh"))
        yield from _namespace_metrics(s)
        fallbacks = CounterMetricFamily("mmfeat_client_fallbacks", "Features clients sent inline, by reason",
                                        labels=["reason"])
        for reason, n in sorted(counters["fallbacks"].items()):
            fallbacks.add_metric([reason], n)
        yield fallbacks
        by_op = CounterMetricFamily("mmfeat_requests_by_op", "Request frames taken, by op", labels=["op"])
        for op, n in sorted(counters["requests_by_op"].items()):
            by_op.add_metric([op], n)
        yield by_op


# (stats key per peer, metric, help): what crossed between this node and each peer.
_PEER_COUNTERS = (
    ("pulls", "mmfeat_mesh_pulls", "Features pulled from a peer's pool (one NIXL READ each)"),
    ("bytes_pulled", "mmfeat_mesh_pulled_bytes", "Bytes pulled from a peer's pool"),
    ("pull_failures", "mmfeat_mesh_pull_failures", "Pulls from a peer that failed or ran out of time"),
    ("bytes_served", "mmfeat_mesh_served_bytes", "Bytes of this node's features a peer pulled (checked)"),
    ("acks_relayed", "mmfeat_mesh_acks_relayed", "Acks of a peer's features relayed to it"),
    ("acks_received", "mmfeat_mesh_acks_received", "Acks of this node's features a peer relayed"),
    ("acks_dropped", "mmfeat_mesh_acks_dropped", "Acks not relayed (peer down or restarted); its ack_ttl frees those"),
    ("auth_failures", "mmfeat_mesh_auth_failures", "Handshakes in which a peer refused this node's key"),
)


def _namespace_metrics(s: dict[str, Any]) -> Iterator[Any]:
    namespaces = s.get("namespaces") or {}
    yield GaugeMetricFamily("mmfeat_holds_live", "Holds on retained features live now", value=s.get("holds") or 0)
    yield GaugeMetricFamily("mmfeat_pinned_reads", "Reads pinned on retained features in the lease table, not yet "
                            "released", value=s.get("pins") or 0)
    for field, name, doc, counter in _NAMESPACE_METRICS:
        family = (CounterMetricFamily if counter else GaugeMetricFamily)(name, doc, labels=["namespace"])
        for ns, entry in sorted(namespaces.items()):
            family.add_metric([ns], entry[field])
        yield family


def _mesh_metrics(mesh: Optional[dict]) -> Iterator[Any]:
    if not mesh:
        return
    from .mesh.liveness import STATES  # a daemon without a mesh never imports the mesh's modules

    states = GaugeMetricFamily("mmfeat_mesh_peers", "Listed peer daemons by state", labels=["state"])
    for state in STATES:
        states.add_metric([state], sum(p["state"] == state for p in mesh["peers"]))
    yield states
    # A row per listed peer, and per removed one until it is forgotten: two may carry one label (a key
    # replaced at one address), whose samples are summed, or for a gauge, the latest taken.
    peer_state = GaugeMetricFamily("mmfeat_mesh_peer_state", "1 for each peer's state now, with where it is listed "
                                   "from", labels=["peer", "source", "state"])
    for labels, n in _per_label(mesh["peers"], lambda p: 1, lambda p: (p["source"], p["state"])).items():
        peer_state.add_metric(list(labels), n)
    yield peer_state
    changed = GaugeMetricFamily("mmfeat_mesh_peer_state_seconds", "Seconds since a peer's state last changed",
                                labels=["peer"])
    for labels, v in _per_label(mesh["peers"], lambda p: p["changed_s_ago"], combine=min).items():
        changed.add_metric(list(labels), v)
    yield changed
    quorum = mesh["quorum"]
    yield GaugeMetricFamily("mmfeat_mesh_members", "This node and the peers its source lists", value=quorum["members"])
    yield GaugeMetricFamily("mmfeat_mesh_quorum", "1 while this node and the peers up are a majority of the members",
                            value=int(quorum["ok"]))
    yield CounterMetricFamily("mmfeat_mesh_source_errors", "Reads of the peers' source that failed (the last "
                              "listing stays)", value=mesh["source"]["errors"])
    yield CounterMetricFamily("mmfeat_mesh_connections_ended", "Connections of a peer's key shut down when its "
                              "source stopped listing it", value=mesh["connections_ended"])
    rtt = GaugeMetricFamily("mmfeat_mesh_rtt_seconds", "Last heartbeat round trip to a peer that is up",
                            labels=["peer"])
    for labels, v in _per_label(mesh["peers"], lambda p: p["rtt_ms"] and p["rtt_ms"] / 1e3, combine=min).items():
        rtt.add_metric(list(labels), v)
    yield rtt
    for key, name, doc in _PEER_COUNTERS:
        family = CounterMetricFamily(name, doc, labels=["peer"])
        for labels, v in _per_label(mesh["peers"], lambda p: p.get(key)).items():
            family.add_metric(list(labels), v)
        yield family
    yield GaugeMetricFamily("mmfeat_mesh_transport_up", "1 when this daemon can pull other nodes' features (NIXL "
                            "started); 0: it cannot, and mmfeat health fails",
                            value=1 if mesh.get("transport") else 0)
    yield GaugeMetricFamily("mmfeat_mesh_copy_bytes", "Bytes of other nodes' features pulled into this pool, live now",
                            value=mesh.get("copy_bytes", 0))
    yield CounterMetricFamily("mmfeat_mesh_refused", "Mesh connections refused for an unlisted public key",
                              value=mesh["refused"])
    yield CounterMetricFamily("mmfeat_mesh_bad_messages", "Mesh frames refused as invalid", value=mesh["bad_messages"])
    yield CounterMetricFamily("mmfeat_mesh_connections_refused",
                              "Connections to the mesh listener shut down past its cap",
                              value=mesh["connections_refused"])
    yield CounterMetricFamily("mmfeat_mesh_connections_evicted",
                              "Connections to the mesh listener shut down to make room for a listed peer's",
                              value=mesh["connections_evicted"])


def _per_label(peers: list[dict], value: Callable[[dict], Any], more: Callable[[dict], tuple] = lambda p: (),
               combine: Callable[[Any, Any], Any] = operator.add) -> dict[tuple, Any]:
    """Each peer row's ``value`` (None: none) under its labels: the name it said, else the one its source
    gives it, then ``more``; rows with the same labels combined."""
    out: dict[tuple, Any] = {}
    for p in peers:
        v = value(p)
        if v is None:
            continue
        labels = (p["node"] or p.get("listed_as") or p["endpoint"], *more(p))
        out[labels] = combine(out[labels], v) if labels in out else v
    return out


class Metrics:
    """Owns the registry, the HTTP endpoint and the histograms."""

    def __init__(self, host: str, port: int) -> None:
        self.registry = CollectorRegistry()
        self._state = _StateCollector()
        self.registry.register(self._state)
        self.ack_latency = Histogram(
            "mmfeat_publish_to_last_ack_seconds",
            "Time from publish to the last consumer's ack",
            buckets=(0.0005, 0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10, 30, 60),
            registry=self.registry,
        )
        self.reserve_latency = Histogram(
            "mmfeat_reserve_seconds",
            "Time the daemon spent serving a reserve",
            buckets=(0.00001, 0.000025, 0.00005, 0.0001, 0.00025, 0.0005, 0.001, 0.0025, 0.01),
            registry=self.registry,
        )
        self.server, self.thread = start_http_server(port, addr=host, registry=self.registry)

    @property
    def port(self) -> int:
        return self.server.server_port

    def update(self, snapshot: dict[str, Any]) -> None:
        self._state.update(snapshot)

    def on_free(self, lease: Lease, reason: EndReason, now: float) -> None:
        if reason is EndReason.ACKED and lease.published_at:
            self.ack_latency.observe(max(0.0, now - lease.published_at))

    def on_quick_acks(self, n: int) -> None:
        """``n`` features published and acked by all between two sweeps: no time between the two that
        the daemon can see."""
        for _ in range(n):
            self.ack_latency.observe(0.0)

    def close(self) -> None:
        self.server.shutdown()
        self.server.server_close()
