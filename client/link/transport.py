"""What the client's two transports to its daemon have in common: the control channel (ZeroMQ, any
op) and a session's fd channel (ordered behind the session's own requests, and tied to its life)."""

from __future__ import annotations

from typing import Any, Protocol


class Transport(Protocol):
    def call(self, op: str, **fields: Any) -> dict[str, Any]:
        """Send ``op`` and wait for its success reply; MmfeatError for an error reply and
        DaemonUnavailableError when none comes within the transport's timeout."""
        ...

    def send(self, op: str, **fields: Any) -> None:
        """Send ``op`` quietly: answered only if it fails, and that failure is counted in the client's
        asynchronous failures under the op's name."""
        ...
