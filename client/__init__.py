"""The thin client producer and consumer processes import. Never imports the daemon.

``Client`` (and ``dumps``, ``loads``, ``Parcel``, ``Pooled``) load on first use, so that ``mmfeat
stats`` and other torch-free users do not pay for importing torch.
"""

from typing import TYPE_CHECKING, Any

from mmfeat.protos import (
    MAX_KEY_BYTES, MAX_LOOKUP_KEYS, DaemonUnavailableError, Descriptor, ErrorCode, FdLimitError, MmfeatError,
    Namespace, PeerUnavailableError,
)

if TYPE_CHECKING:
    from .client import Client
    from .parcel import Parcel, Pooled, dumps, loads

__all__ = [
    "Client", "DaemonUnavailableError", "Descriptor", "ErrorCode", "FdLimitError", "MAX_KEY_BYTES",
    "MAX_LOOKUP_KEYS", "MmfeatError", "Namespace", "Parcel", "PeerUnavailableError", "Pooled", "dumps", "loads",
]


def __getattr__(name: str) -> Any:
    if name == "Client":
        from .client import Client

        return Client
    if name in ("dumps", "loads", "Parcel", "Pooled"):
        from . import parcel

        return getattr(parcel, name)
    raise AttributeError(f"module 'mmfeat.client' has no attribute {name!r}")
