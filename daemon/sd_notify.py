"""systemd's notify protocol: datagrams to $NOTIFY_SOCKET (READY=1, STATUS=..., WATCHDOG=1, STOPPING=1).

Small enough to own rather than depend on: a datagram with a few key=value lines (sd_notify(3)).
"""

from __future__ import annotations

import logging
import os
import socket
from typing import Optional

log = logging.getLogger("mmfeatd")


class Notifier:
    """Sends to $NOTIFY_SOCKET when systemd (Type=notify) set it; does nothing otherwise."""

    def __init__(self, environ: Optional[dict[str, str]] = None) -> None:
        env = os.environ if environ is None else environ
        path = env.get("NOTIFY_SOCKET", "")
        self._addr: Optional[str] = None
        self._sock: Optional[socket.socket] = None
        if path:
            # '@' names an abstract socket (a leading NUL on the wire).
            self._addr = "\0" + path[1:] if path.startswith("@") else path
            self._sock = socket.socket(socket.AF_UNIX, socket.SOCK_DGRAM | socket.SOCK_CLOEXEC)
        usec = env.get("WATCHDOG_USEC", "")
        pid = env.get("WATCHDOG_PID", "")
        self.watchdog_interval: Optional[float] = None
        if usec.isdigit() and int(usec) > 0 and (not pid or pid == str(os.getpid())):
            self.watchdog_interval = int(usec) / 1e6 / 2  # ping at half the timeout, as sd_watchdog_enabled(3) advises

    @property
    def enabled(self) -> bool:
        return self._sock is not None

    def send(self, *fields: str) -> bool:
        if self._sock is None or self._addr is None:
            return False
        try:
            self._sock.sendto("\n".join(fields).encode(), self._addr)
            return True
        except OSError as exc:
            log.warning("sd_notify to %s failed: %s", self._addr.lstrip("\0"), exc)
            return False

    def ready(self, status: str) -> bool:
        return self.send("READY=1", f"STATUS={status}", f"MAINPID={os.getpid()}")

    def status(self, status: str) -> bool:
        return self.send(f"STATUS={status}")

    def watchdog(self) -> bool:
        return self.send("WATCHDOG=1")

    def reloading(self) -> bool:
        return self.send("RELOADING=1")

    def stopping(self, status: str) -> bool:
        return self.send("STOPPING=1", f"STATUS={status}")

    def close(self) -> None:
        if self._sock is not None:
            self._sock.close()
            self._sock = None
