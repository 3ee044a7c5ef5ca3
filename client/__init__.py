"""The thin client producer and consumer processes import. Never imports the daemon.

``Client`` is loaded on first use so that ``mmfeat stats`` and other torch-free users do not pay for
importing torch.
"""

from typing import TYPE_CHECKING, Any

from mmfeat.protos import DaemonUnavailableError, Descriptor, ErrorCode, MmfeatError

if TYPE_CHECKING:
    from .client import Client

__all__ = ["Client", "DaemonUnavailableError", "Descriptor", "ErrorCode", "MmfeatError"]


def __getattr__(name: str) -> Any:
    if name == "Client":
        from .client import Client

        return Client
    raise AttributeError(f"module 'mmfeat.client' has no attribute {name!r}")
