"""msgpack framing for the control socket. No pickle, no ext types, bounded sizes."""

from __future__ import annotations

from typing import Any

import msgpack

# A request is a few hundred bytes; a stats reply a few KiB. Anything bigger is a mistake or an attack.
MAX_REQUEST_BYTES = 64 * 1024
# Requests one control-socket connection may have unanswered at once (SPEC.md, section 2): the daemon
# never drops a reply within it; past it, replies to a peer that falls behind may be dropped.
MAX_IN_FLIGHT = 128
_MAX_ITEMS = 4096


class DecodeError(ValueError):
    """The bytes are not one msgpack map within the limits. ``too_large``: the frame itself is over
    MAX_REQUEST_BYTES (TOO_LARGE on the wire; anything else is BAD_REQUEST)."""

    def __init__(self, message: str, too_large: bool = False) -> None:
        super().__init__(message)
        self.too_large = too_large


def encode(message: dict[str, Any]) -> bytes:
    return msgpack.packb(message, use_bin_type=True)


def decode(data: bytes) -> dict[str, Any]:
    if len(data) > MAX_REQUEST_BYTES:
        raise DecodeError(f"frame of {len(data)} bytes exceeds the {MAX_REQUEST_BYTES}-byte limit", too_large=True)
    try:
        obj = msgpack.unpackb(
            data,
            raw=False,
            strict_map_key=True,
            max_array_len=_MAX_ITEMS,
            max_map_len=_MAX_ITEMS,
            max_bin_len=MAX_REQUEST_BYTES,
            max_str_len=MAX_REQUEST_BYTES,
            max_ext_len=0,
        )
    except Exception as exc:  # msgpack raises several unrelated types for bad input
        raise DecodeError(f"not valid msgpack: {type(exc).__name__}: {exc}") from None
    if not isinstance(obj, dict):
        raise DecodeError(f"expected a msgpack map, got {type(obj).__name__}")
    return obj
