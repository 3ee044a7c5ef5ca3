"""``mmfeatd``: parse settings, create pools, bind sockets, serve until told to stop."""

from __future__ import annotations

import argparse
import logging
import os
import sys
import time
from pathlib import Path
from typing import Optional, Sequence

from .backends import create_pools
from .config import HELP, RELOADABLE, ConfigError, MeshConfigError, Settings, adjusted, load_settings, render_config
from .core import DaemonCore
from .logs import setup_logging
from .pools import PoolCreateError
from .sd_notify import Notifier
from .server import Server
from .settings_help import SettingsParser, unknown_env
from .sockets.budgets import FdLimitError, raise_fd_limit
from .sockets.runtime_dir import RuntimeDir, RuntimeDirError

log = logging.getLogger("mmfeatd")


def _ordinals(text: str) -> list[int]:
    try:
        return [int(x) for x in text.split(",") if x]
    except ValueError:
        pass
    raise argparse.ArgumentTypeError(f"{text!r} is not a comma-separated list of device ordinals, e.g. 0,1")


def _parser() -> argparse.ArgumentParser:
    # Settings flags get their help and default from config.py (SettingsParser). No prefix matching: a
    # mistyped --pool would silently set pool_mb, and a flag added later would change what it means.
    p = SettingsParser(prog="mmfeatd", allow_abbrev=False,
                       description="mmfeat per-node feature pool daemon. Settings come from defaults, then --config, "
                                   "then MMFEAT_<SETTING> environment variables (MMFEAT_POOL_MB=2048), then flags.")
    p.add_argument("--config", type=Path,
                   help="TOML settings file, section [mmfeatd]; deploy/mmfeatd.toml lists every setting "
                        "(default: none)")
    p.add_argument("--runtime-dir", dest="runtime_dir", type=Path)
    p.add_argument("--pool-mb", dest="pool_mb", type=int)
    p.add_argument("--host-pool-mb", dest="host_pool_mb", type=int)
    p.add_argument("--backend", choices=["auto", "host", "cuda_vmm"])
    p.add_argument("--devices", type=_ordinals)
    p.add_argument("--nnodes", type=int)
    p.add_argument("--reserve-ttl", dest="reserve_ttl", type=float)
    p.add_argument("--ack-ttl", dest="ack_ttl", type=float)
    p.add_argument("--max-leases", dest="max_leases", type=int)
    p.add_argument("--max-session-mb", dest="max_session_mb", type=int)
    p.add_argument("--max-session-leases", dest="max_session_leases", type=int)
    p.add_argument("--max-refused-words", dest="max_refused_words", type=int)
    p.add_argument("--arena-mb", dest="arena_mb", type=int)
    p.add_argument("--arena-slots", dest="arena_slots", type=int)
    p.add_argument("--arenas-per-session", dest="arenas_per_session", type=int)
    p.add_argument("--gpu-publish", dest="gpu_publish", choices=["auto", "host_wait"])
    p.add_argument("--ready-ttl", dest="ready_ttl", type=float)
    p.add_argument("--max-clients", dest="max_clients", type=int)
    p.add_argument("--control-memory-mb", dest="control_memory_mb", type=int)
    p.add_argument("--log-level", dest="log_level")
    p.add_argument("--metrics-port", dest="metrics_port", type=int)
    p.add_argument("--metrics-host", dest="metrics_host")
    p.add_argument("--drain-timeout", dest="drain_timeout", type=float)
    p.add_argument("--listen")
    p.add_argument("--mesh-secret-file", dest="mesh_secret_file", type=Path)
    p.add_argument("--data-devices", dest="data_devices")
    p.add_argument("--print-config", action="store_true",
                   help="print the effective settings as TOML, where each came from, and exit")
    p.add_argument("--gen-keys", dest="gen_keys", type=Path, metavar="DIR",
                   help="write this node's mesh keypair (mesh.secret, mode 0600, and mesh.public) into DIR and exit")
    return p


def main(argv: Optional[Sequence[str]] = None) -> int:
    args = _parser().parse_args(argv)
    if args.gen_keys is not None:
        return _gen_keys(args.gen_keys)
    flags = {k: v for k, v in vars(args).items() if k not in ("config", "print_config", "gen_keys")}
    try:
        settings, sources = load_settings(args.config, flags)
    except ConfigError as exc:
        print(f"mmfeatd: {exc}", file=sys.stderr)
        return 2
    for line in unknown_env(os.environ):
        print(f"mmfeatd: warning: {line}", file=sys.stderr)
    if args.print_config:
        sys.stdout.write(render_config(settings, sources))
        return 0
    setup_logging(settings.log_level)
    for name, note in adjusted(settings).items():
        # A value someone chose and the daemon does not use is worth a warning; a default is not.
        log.log(logging.INFO if sources[name] == "default" else logging.WARNING, "%s: %s", name, note)
    runtime = RuntimeDir(settings.runtime_dir)
    try:
        runtime.acquire()
    except RuntimeDirError as exc:
        print(f"mmfeatd: {exc}", file=sys.stderr)
        return 1
    try:
        return _serve(settings, args.config, flags)
    finally:
        runtime.release()


def _serve(settings: Settings, config_file: Optional[Path], flags: dict) -> int:
    try:
        raise_fd_limit()
    except FdLimitError as exc:
        print(f"mmfeatd: {exc}", file=sys.stderr)
        return 1
    try:
        pools = create_pools(settings)
    except PoolCreateError as exc:
        print(f"mmfeatd: {exc}", file=sys.stderr)
        return 1
    metrics = None
    if settings.metrics_port:
        try:
            from .metrics import Metrics  # prometheus-client: only for a daemon that serves metrics

            metrics = Metrics(settings.metrics_host, settings.metrics_port)
        except OSError as exc:
            for pool in pools:
                pool.close()
            print(f"mmfeatd: cannot serve metrics on {settings.metrics_host}:{settings.metrics_port}: "
                  f"{exc.strerror}", file=sys.stderr)
            return 1
    core = DaemonCore(settings, pools, observer=metrics.on_free if metrics else None,
                      quick_observer=metrics.on_quick_acks if metrics else None)
    if metrics is not None:
        core.observe_reserve = metrics.reserve_latency.observe
    server = Server(core, Notifier(), metrics, reload=lambda: reload_settings(core, config_file, flags))
    try:
        try:
            server.bind()
        except MeshConfigError as exc:
            print(f"mmfeatd: {exc}", file=sys.stderr)
            return 1
        log.info("serving %s (epoch %d, pid %d)%s", core.endpoint, core.epoch, os.getpid(),
                 f"; metrics on http://{settings.metrics_host}:{metrics.port}/metrics" if metrics else "")
        status = server.serve()
        cut = core.ledger.cut_all(time.monotonic())
        if cut:
            log.warning("stopped: drain ended with %d lease(s) unacknowledged; they were cut", cut)
        else:
            log.info("stopped: every lease was acknowledged")
        return status
    finally:
        server.close()
        core.close()
        for pool in pools:
            pool.close()


def _gen_keys(directory: Path) -> int:
    # The mesh's package is loaded only by a daemon that runs a mesh or makes its keys.
    from .mesh import keys as mesh_keys

    try:
        public, secret = mesh_keys.generate(directory)
    except (mesh_keys.KeyFileError, OSError) as exc:
        print(f"mmfeatd: {exc}", file=sys.stderr)
        return 1
    print(f"wrote {secret} (keep it on this node) and {public}; list this node on the others as")
    print(f'  {{endpoint = "tcp://THIS-NODE:PORT", public_key = "{public.read_text().strip()}"}}')
    return 0


def reload_settings(core: DaemonCore, config_file: Optional[Path], flags: dict) -> None:
    """SIGHUP: read the settings again and apply what can change without a restart."""
    try:
        new, _ = load_settings(config_file, flags)
    except ConfigError as exc:
        log.error("reload failed, keeping the running settings: %s", exc)
        return
    old = core.settings
    changed = {k: (getattr(old, k), getattr(new, k)) for k in HELP if getattr(old, k) != getattr(new, k)}
    applied = {k: v for k, v in changed.items() if k in RELOADABLE}
    core.apply_settings(old.model_copy(update={k: v[1] for k, v in applied.items()}))
    if "log_level" in applied:
        logging.getLogger().setLevel(new.log_level)
    if applied:
        log.info("reloaded: %s", ", ".join(f"{k} {a} -> {b}" for k, (a, b) in applied.items()))
    else:
        log.info("reloaded: nothing that can change without a restart changed")
    needs_restart = sorted(set(changed) - set(applied))
    if needs_restart:
        log.warning("changed but not applied until a restart: %s", ", ".join(needs_restart))


if __name__ == "__main__":
    sys.exit(main())
