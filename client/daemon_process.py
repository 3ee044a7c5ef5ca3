"""Start an ``mmfeatd`` subprocess and wait until it answers: for the demo, the bench and the tests.

One place that knows what "up" means: both sockets exist and a ping on the control socket comes back.
"""

from __future__ import annotations

import subprocess
import sys
import time
from pathlib import Path
from typing import Any, Optional, Sequence

from mmfeat.protos.errors import MmfeatError
from mmfeat.protos.paths import CONTROL_SOCKET, FD_SOCKET, control_endpoint

from .channel import ControlChannel


class DaemonStartError(RuntimeError):
    """mmfeatd exited or did not answer in time; the message carries what it printed, if it was piped."""


def spawn_daemon(runtime_dir: Path, args: Sequence[str] = (), timeout: float = 20.0, **popen: Any) -> subprocess.Popen:
    """``python -m mmfeat.daemon --runtime-dir DIR ARGS``, returned once it answers a ping. ``popen``
    goes to subprocess.Popen (env, stdout, stderr, text, preexec_fn, ...)."""
    proc = subprocess.Popen([sys.executable, "-m", "mmfeat.daemon", "--runtime-dir", str(runtime_dir), *args], **popen)
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
