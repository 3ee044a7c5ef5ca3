"""Where the daemon's sockets live: part of the contract, since every client must find them."""

from __future__ import annotations

import os
from pathlib import Path

CONTROL_SOCKET = "mmfeatd.sock"
FD_SOCKET = "mmfeatd.fds.sock"
# The key feed (SPEC.md, section 12): keys as they are bound and unbound, published to whoever subscribes.
KEY_FEED_SOCKET = "mmfeatd.feed.sock"
# The serving daemon holds an exclusive flock on it for its whole life and writes its pid in it, so a
# client can tell at once that socket files are a dead daemon's leftovers instead of waiting out a timeout.
LOCK_FILE = "mmfeatd.lock"
RUNTIME_DIR_ENV = "MMFEAT_RUNTIME_DIR"


def default_runtime_dir() -> Path:
    """``$MMFEAT_RUNTIME_DIR``, else systemd's ``$RUNTIME_DIRECTORY``, else ``$XDG_RUNTIME_DIR/mmfeat``,
    else ``/tmp/mmfeat-<uid>``."""
    for var in (RUNTIME_DIR_ENV, "RUNTIME_DIRECTORY"):
        value = os.environ.get(var)
        if value:
            # systemd may list several directories separated by ':'; ours is the first.
            return Path(value.split(":")[0])
    xdg = os.environ.get("XDG_RUNTIME_DIR")
    if xdg:
        return Path(xdg) / "mmfeat"
    return Path(f"/tmp/mmfeat-{os.getuid()}")


def control_endpoint(runtime_dir: Path) -> str:
    return f"ipc://{runtime_dir / CONTROL_SOCKET}"


def key_feed_endpoint(runtime_dir: Path) -> str:
    return f"ipc://{runtime_dir / KEY_FEED_SOCKET}"


def fd_socket_path(runtime_dir: Path) -> Path:
    return runtime_dir / FD_SOCKET


def lock_path(runtime_dir: Path) -> Path:
    return runtime_dir / LOCK_FILE
