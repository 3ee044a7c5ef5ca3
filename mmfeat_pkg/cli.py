"""``mmfeat``: operator commands (stats, health) and the benchmark."""

from __future__ import annotations

import argparse
import json
import signal
import sys
import time
from pathlib import Path
from typing import Any, Optional, Sequence

from mmfeat.client.link.channel import ControlChannel
from mmfeat.protos.errors import MmfeatError
from mmfeat.protos.paths import control_endpoint, default_runtime_dir


def _mib(n: int) -> str:
    return f"{n / (1 << 20):.1f}"


def render_stats(s: dict[str, Any]) -> str:
    """The stats reply as a table for people."""
    c = s["counters"]
    lines = [
        f"mmfeatd on {s['node']}  pid {s['pid']}  epoch {s['epoch']}  up {s['uptime_s']:.0f} s"
        f"  clients {s['clients']}{'  DRAINING' if s['draining'] else ''}",
        "",
        f"{'pool':>4} {'kind':<5} {'dev':>3} {'handle':<8} {'MiB':>9} {'used':>9} {'free':>9} {'largest':>9}"
        f" {'reserved':>8} {'published':>9}"
        f" {'arenas':>6} {'slack':>9}",
    ]
    for p in s["pools"]:
        lines.append(
            f"{p['pool']:>4} {p['kind']:<5} {p['device']:>3} {p['handle']:<8} {_mib(p['capacity']):>9}"
            f" {_mib(p['used']):>9} {_mib(p['free']):>9} {_mib(p['largest_free']):>9}"
            f" {p['leases']['RESERVED']:>8} {p['leases']['PUBLISHED']:>9}"
            f" {p['arenas']['count']:>6} {_mib(p['arenas']['slack']):>9}"
        )
    lines.append("")
    counters = [(k, v) for k, v in c.items() if k not in ("fallbacks", "requests_by_op")]
    for i in range(0, len(counters), 4):
        lines.append("  ".join(f"{k}={v}" for k, v in counters[i : i + 4]))
    fb = c.get("fallbacks") or {}
    lines.append("fallbacks reported by clients: " + (", ".join(f"{k}={v}" for k, v in sorted(fb.items())) or "none"))
    by_op = c.get("requests_by_op") or {}
    lines.append("requests by op: " + (", ".join(f"{k}={v}" for k, v in sorted(by_op.items())) or "none"))
    namespaces = s.get("namespaces") or {}
    if namespaces:
        lines += ["", f"{'namespace':<16} {'keys':>7} {'retained MiB':>12} {'hits':>9} {'misses':>9} {'holds':>8} "
                      f"{'evictions':>9} {'expired':>8}"]
        for ns, n in sorted(namespaces.items()):
            lines.append(f"{ns:<16} {n['keys']:>7} {_mib(n['bytes_retained']):>12} {n['hits']:>9} {n['misses']:>9} "
                         f"{n['holds']:>8} {n['evictions']:>9} {n['expired']:>8}")
    mesh = s.get("mesh")
    if mesh:
        lines += ["", f"mesh on {mesh['listen']} as {mesh['public_key']}: refused keys {mesh['refused']}, "
                      f"bad messages {mesh['bad_messages']}, connections {mesh.get('connections', 0)} "
                      f"(shed {mesh.get('connections_refused', 0)}, "
                      f"evicted for peers {mesh.get('connections_evicted', 0)}, "
                      f"ended with their key {mesh.get('connections_ended', 0)})",
                  f"pulls with {mesh.get('transport') or 'nothing: ' + str(mesh.get('transport_error'))}; "
                  f"copies here {mesh.get('copies', 0)} ({mesh.get('copy_bytes', 0) >> 20} MiB)"]
        if mesh.get("source"):
            lines.append(_membership(mesh))
        lines.append(f"{'node':<16} {'endpoint':<28} {'source':<6} {'state':<16} {'for s':>7} {'rtt ms':>8} "
                     f"{'seen s ago':>10} {'pools':>5} {'pulled MiB':>10} {'served MiB':>10} {'acks out':>9} "
                     f"{'acks in':>8}")
        for p in mesh["peers"]:
            rtt = "-" if p["rtt_ms"] is None else f"{p['rtt_ms']:.2f}"
            seen = "-" if p["last_seen_s"] is None else f"{p['last_seen_s']:.1f}"
            since = "-" if p.get("changed_s_ago") is None else f"{p['changed_s_ago']:.0f}"
            lines.append(f"{p['node'] or p.get('listed_as') or '?':<16} {p['endpoint']:<28} "
                         f"{p.get('source', 'static'):<6} {p['state']:<16} {since:>7} {rtt:>8} {seen:>10} "
                         f"{len(p['pools']):>5} "
                         f"{p.get('bytes_pulled', 0) >> 20:>10} {p.get('bytes_served', 0) >> 20:>10} "
                         f"{p.get('acks_relayed', 0):>9} {p.get('acks_received', 0):>8}")
    return "\n".join(lines)


def _membership(mesh: dict[str, Any]) -> str:
    """Where the peers come from, how the last read went, and whether this node reaches a quorum."""
    src, q = mesh["source"], mesh["quorum"]
    read = (f"read {src['refreshed_s_ago']:.0f} s ago" if src.get("refreshed_s_ago") is not None else "not read yet")
    error = f", last read failed: {src['error']}" if src.get("error") else ""
    return (f"peers from {src['from']} ({src['name']}), {read}{error}; reaches {q['reachable']} of {q['members']} "
            f"members (this node included): {'a quorum' if q['ok'] else 'NO quorum'}")


def _channel(args: argparse.Namespace) -> ControlChannel:
    # Plain control channel, not Client: operator commands should not pay for importing torch.
    runtime_dir = args.runtime_dir or default_runtime_dir()
    return ControlChannel(control_endpoint(runtime_dir), args.timeout)


def _stats(args: argparse.Namespace) -> int:
    c = _channel(args)
    try:
        if not args.watch:
            s = _body(c.call("stats"))
            print(json.dumps(s, indent=2, sort_keys=True) if args.json else render_stats(s))
            return 0
        # Explicit handlers: a process started in the background inherits SIGINT ignored, and
        # Ctrl-C or a service manager's SIGTERM must still end the watch cleanly.
        signal.signal(signal.SIGINT, signal.default_int_handler)
        signal.signal(signal.SIGTERM, signal.default_int_handler)
        while True:
            table = render_stats(_body(c.call("stats")))
            # Home the cursor and clear to the end: the table redraws in place without flicker.
            sys.stdout.write("\x1b[H\x1b[J" + table + f"\n\n(every {args.interval:g} s; Ctrl-C to stop)\n")
            sys.stdout.flush()
            time.sleep(args.interval)
    except KeyboardInterrupt:
        return 0
    finally:
        c.close()


def _body(reply: dict[str, Any]) -> dict[str, Any]:
    return {k: v for k, v in reply.items() if k not in ("v", "id", "ok")}


def _health(args: argparse.Namespace) -> int:
    c = _channel(args)
    try:
        reply = c.call("ping")
        mesh = c.call("stats").get("mesh") or {}
    finally:
        c.close()
    where = f"node {reply['node']} epoch {reply['epoch']}"
    if mesh and not mesh.get("transport"):
        # A meshed daemon that cannot pull answers every get of another node's feature with an error:
        # it serves its own node, but not as its configuration says it should.
        print(f"mmfeatd unhealthy: {where}: it meshes with other nodes but cannot pull from them: "
              f"{mesh.get('transport_error')}", file=sys.stderr)
        return 1
    quorum = mesh.get("quorum")
    if quorum:
        where += (f"; reaches {quorum['reachable']} of {quorum['members']} mesh members: "
                  f"{'a quorum' if quorum['ok'] else 'no quorum'}")
        if args.require_quorum and not quorum["ok"]:
            # Asked for: a node cut off from most of the mesh serves its own clients, but the features
            # of most nodes are out of its reach.
            print(f"mmfeatd unhealthy: {where}", file=sys.stderr)
            return 1
    state = "draining" if reply.get("draining") else "ok"
    print(f"mmfeatd {state}: {where}")
    return 0


def _bench(args: argparse.Namespace) -> int:
    from .bench.cli import run_bench

    return run_bench(args)


def parser() -> argparse.ArgumentParser:
    # No prefix matching, here and in each command: an abbreviation would change meaning as flags are added.
    p = argparse.ArgumentParser(prog="mmfeat", description="mmfeat client tools", allow_abbrev=False)
    p.add_argument("--runtime-dir", type=Path, default=None,
                   help="daemon runtime dir (default: $MMFEAT_RUNTIME_DIR, else $RUNTIME_DIRECTORY, "
                        "else $XDG_RUNTIME_DIR/mmfeat, else /tmp/mmfeat-<uid>)")
    p.add_argument("--timeout", type=float, default=3.0, help="seconds to wait for the daemon (default: %(default)s)")
    sub = p.add_subparsers(dest="command", required=True)
    s = sub.add_parser("stats", help="pool usage, leases and counters", allow_abbrev=False)
    s.add_argument("--json", action="store_true", help="machine-readable output")
    s.add_argument("--watch", action="store_true", help="redraw the table in place")
    s.add_argument("--interval", type=float, default=1.0,
                   help="seconds between redraws of --watch (default: %(default)s)")
    s.set_defaults(func=_stats)
    h = sub.add_parser("health", help="exit 0 when the daemon answers and, when meshed, can pull from other nodes; "
                                      "says whether it reaches a quorum of the mesh", allow_abbrev=False)
    h.add_argument("--require-quorum", action="store_true",
                   help="exit 1 too when this node and the peers up are not a majority of what its source lists "
                        "(default: off; a liveness probe must not use it, or a partition restarts daemons)")
    h.set_defaults(func=_health)
    b = sub.add_parser("bench", help="measure the handoff against the alternatives, in one run", allow_abbrev=False)
    from .bench.cli import add_bench_args

    add_bench_args(b)
    b.set_defaults(func=_bench)
    return p


def main(argv: Optional[Sequence[str]] = None) -> int:
    args = parser().parse_args(argv)
    try:
        return args.func(args)
    except MmfeatError as exc:
        print(f"mmfeat {args.command}: {exc}", file=sys.stderr)
        return 1


if __name__ == "__main__":
    sys.exit(main())
