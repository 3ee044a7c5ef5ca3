"""Error codes on the wire and the exception that carries them in Python."""

from __future__ import annotations

from enum import Enum


class ErrorCode(str, Enum):
    """Every code a reply may carry in ``error.code``. SPEC.md documents each one."""

    BAD_REQUEST = "BAD_REQUEST"
    UNSUPPORTED_VERSION = "UNSUPPORTED_VERSION"
    UNKNOWN_OP = "UNKNOWN_OP"
    POOL_FULL = "POOL_FULL"
    TOO_LARGE = "TOO_LARGE"
    NOT_FOUND = "NOT_FOUND"
    STALE = "STALE"
    FORBIDDEN = "FORBIDDEN"
    BAD_STATE = "BAD_STATE"
    DRAINING = "DRAINING"
    OVER_QUOTA = "OVER_QUOTA"
    TIMED_OUT = "TIMED_OUT"
    LOST = "LOST"
    SESSION_CUT = "SESSION_CUT"
    PEER_UNAVAILABLE = "PEER_UNAVAILABLE"
    NO_TRANSPORT = "NO_TRANSPORT"
    INTERNAL = "INTERNAL"


class MmfeatError(Exception):
    """A failure with a wire error code. Raised by the daemon's handlers and by the client."""

    def __init__(self, code: ErrorCode, message: str) -> None:
        super().__init__(f"{code.value}: {message}")
        self.code = code
        self.message = message

    def to_wire(self) -> dict[str, str]:
        return {"code": self.code.value, "message": self.message}

    @classmethod
    def from_reply(cls, reply: dict) -> "MmfeatError":
        """The error an error reply carries; a code this side does not know reads as INTERNAL."""
        err = reply.get("error")
        err = err if isinstance(err, dict) else {}
        try:
            code = ErrorCode(err.get("code"))
        except ValueError:
            code = ErrorCode.INTERNAL
        message = str(err.get("message", "no message"))
        if code is ErrorCode.PEER_UNAVAILABLE:
            return PeerUnavailableError(message)
        return cls(code, message)


class DaemonUnavailableError(MmfeatError):
    """The daemon did not answer in time or its socket is missing. Not a wire code: client side only."""

    def __init__(self, message: str) -> None:
        Exception.__init__(self, message)
        self.code = None  # type: ignore[assignment]
        self.message = message


class PeerUnavailableError(DaemonUnavailableError):
    """Another node's daemon that a request needs (the owner of a feature) is not reachable: code
    PEER_UNAVAILABLE, from every call that meets it (get, ack, prefetch). A DaemonUnavailableError too,
    as the caller's remedy is the same: retry later, or have the feature sent inline."""

    def __init__(self, message: str) -> None:
        Exception.__init__(self, f"{ErrorCode.PEER_UNAVAILABLE.value}: {message}")
        self.code = ErrorCode.PEER_UNAVAILABLE
        self.message = message


class FdLimitError(DaemonUnavailableError):
    """This process has too few free file descriptors to reach the daemon (RLIMIT_NOFILE or the system's
    file table). The daemon may be fine: client side only, and ``put`` sends inline (reason ``fd_limit``)."""


def lost_read(lease: int, gen: int) -> MmfeatError:
    """The error of a get, verify or ack of a feature that ended before its producer's GPU wrote it."""
    return MmfeatError(ErrorCode.LOST, f"lease {lease} generation {gen} ended before its producer's GPU wrote it: "
                       "whatever was read of it is incomplete; drop that read and have the feature sent again")
