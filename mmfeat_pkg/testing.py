"""Processes for the tests, the bench and the examples: an ``mmfeatd`` started and waited on until it answers,
and the forkserver that their worker processes fork from. Nothing a producer or consumer imports.

One place that knows what "up" means: both sockets exist and a ping on the control socket comes back;
for a mesh of daemons on this machine (``spawn_mesh``), also that each sees every other one up.
"""

from __future__ import annotations

import multiprocessing
import multiprocessing.context
import os
import random
import socket
import subprocess
import sys
import time
from pathlib import Path
from types import ModuleType
from typing import Any, Mapping, Optional, Sequence

from mmfeat.client.link.channel import ControlChannel
from mmfeat.protos.errors import MmfeatError
from mmfeat.protos.paths import CONTROL_SOCKET, FD_SOCKET, control_endpoint


def free_tcp_port(host: str = "127.0.0.1") -> int:
    """A TCP port on ``host`` that is free now and below the kernel's ephemeral range. A port the kernel
    hands out (bind to 0) is one it may hand out again at once as the source port of some outgoing
    connection (ZeroMQ's, UCX's), before the daemon it was meant for binds it."""
    try:
        low = int(open("/proc/sys/net/ipv4/ip_local_port_range").read().split()[0])
    except (OSError, ValueError, IndexError):
        low = 32768
    for _ in range(200):
        port = random.randrange(10000, max(10001, low))
        with socket.socket() as s:
            try:
                s.bind((host, port))
            except OSError:
                continue
            return port
    raise RuntimeError(f"no free TCP port on {host} between 10000 and {low}")


class DaemonStartError(RuntimeError):
    """mmfeatd exited or did not answer in time; the message carries what it printed, if it was piped."""


def spawn_daemon(runtime_dir: Path, args: Sequence[str] = (), timeout: float = 60.0, wrap: Sequence[str] = (),
                 **popen: Any) -> subprocess.Popen:
    """``python -m mmfeat.daemon --runtime-dir DIR ARGS``, returned once it answers a ping (a busy machine can
    take many seconds to start an interpreter: ``timeout`` only bounds a daemon that never will). ``wrap``: a
    command that execs the daemon in its place (``ip netns exec NS``: the Popen's pid stays the daemon's).
    ``popen`` goes to subprocess.Popen (env, stdout, stderr, text, preexec_fn, ...)."""
    proc = subprocess.Popen([*wrap, sys.executable, "-m", "mmfeat.daemon", "--runtime-dir", str(runtime_dir), *args],
                            **popen)
    deadline = time.monotonic() + timeout
    while not _answers(runtime_dir):
        if proc.poll() is not None:
            raise DaemonStartError(f"mmfeatd exited {proc.returncode}: {_stderr(proc)}")
        if time.monotonic() > deadline:
            proc.kill()
            raise DaemonStartError(f"mmfeatd did not answer within {timeout:g} s: {_stderr(proc)}")
        time.sleep(0.01)
    return proc


def _answers(runtime_dir: Path) -> bool:
    if not ((runtime_dir / CONTROL_SOCKET).exists() and (runtime_dir / FD_SOCKET).exists()):
        return False
    channel = ControlChannel(control_endpoint(runtime_dir), 0.5)
    try:
        channel.call("ping")
        return True
    except MmfeatError:
        return False
    finally:
        channel.close()


def _stderr(proc: subprocess.Popen) -> Optional[str]:
    if proc.stderr is None:
        return "(see its log)"
    try:
        _, err = proc.communicate(timeout=5)
    except subprocess.TimeoutExpired:
        return "(it still runs)"
    return err if isinstance(err, str) else err.decode(errors="replace")


def spawn_mesh(work: Path, names: Sequence[str], args: Sequence[str] = (), timeout: float = 60.0,
               hosts: Optional[Mapping[str, str]] = None, wraps: Optional[Mapping[str, Sequence[str]]] = None,
               **popen: Any) -> dict[str, tuple[Path, subprocess.Popen]]:
    """One daemon per name, each a "node" of a mesh on 127.0.0.1 (its own runtime dir under ``work``, its
    own CURVE keypair, every other one listed as a peer), returned once every one sees every other up:
    ``{name: (runtime_dir, process)}``. ``hosts``: another address per node than 127.0.0.1; ``wraps``:
    per node, a command that execs its daemon (see spawn_daemon). For the bench and the examples; the
    caller stops them."""
    import zmq

    host = {n: (hosts or {}).get(n, "127.0.0.1") for n in names}
    ports = {n: free_tcp_port() for n in names}
    keys = {}
    for n in names:
        public, secret = zmq.curve_keypair()
        path = work / f"{n}.secret"
        fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600)
        with os.fdopen(fd, "w") as f:
            f.write(secret.decode() + "\n")
        keys[n] = (public.decode(), path)
    out: dict[str, tuple[Path, subprocess.Popen]] = {}
    try:
        for n in names:
            listed = ", ".join(f'{{endpoint = "tcp://{host[m]}:{ports[m]}", public_key = "{keys[m][0]}"}}'
                               for m in names if m != n)
            config = work / f"{n}.toml"
            config.write_text(f'[mmfeatd]\nnode_id = "{n}"\nlisten = "tcp://{host[n]}:{ports[n]}"\n'
                              f'mesh_secret_file = "{keys[n][1]}"\npeers = [{listed}]\n')
            runtime = work / n
            runtime.mkdir()
            out[n] = (runtime, spawn_daemon(runtime, ["--config", str(config), *args], timeout=timeout,
                                            wrap=(wraps or {}).get(n, ()), **popen))
        deadline = time.monotonic() + timeout
        for n, (runtime, _) in out.items():
            channel = ControlChannel(control_endpoint(runtime), 5.0)
            try:
                while not all(p["state"] == "up" and p["node"] for p in channel.call("stats")["mesh"]["peers"]):
                    if time.monotonic() > deadline:
                        raise DaemonStartError(f"mmfeatd {n!r} did not see every peer up within {timeout:g} s")
                    time.sleep(0.1)
            finally:
                channel.close()
    except BaseException:
        for _, proc in out.values():
            proc.kill()
            proc.wait(10)
        raise
    return out


# A spawned interpreter spends about 2 s of CPU importing these, and a bench or a test file starts many
# worker processes: each forks from a server that imported them once. The server itself never touches a
# GPU, so its children initialise CUDA as freshly spawned ones do.
PRELOAD = ["torch", "mmfeat.client"]


def worker_context(mp: ModuleType = multiprocessing) -> multiprocessing.context.BaseContext:
    """A forkserver context of ``mp`` (``multiprocessing``, or ``torch.multiprocessing`` for its queues)."""
    ctx = mp.get_context("forkserver")
    ctx.set_forkserver_preload(PRELOAD)
    return ctx
