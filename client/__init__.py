"""The thin client producer and consumer processes import. Never imports the daemon."""

from mmfeat.protos import DaemonUnavailableError, Descriptor, ErrorCode, MmfeatError

from .client import Client

__all__ = ["Client", "DaemonUnavailableError", "Descriptor", "ErrorCode", "MmfeatError"]
