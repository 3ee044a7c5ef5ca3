"""The wire contract between mmfeatd and its clients: messages, error codes, descriptor, socket paths.

SPEC.md in this folder is the written protocol.
"""

from .codec import MAX_IN_FLIGHT, MAX_REQUEST_BYTES, DecodeError, decode, encode
from .descriptor import HANDLE_KINDS, POOL_KINDS, Descriptor, DescriptorError, TensorSpec
from .dtypes import DTYPE_SIZES
from .errors import DaemonUnavailableError, ErrorCode, FdLimitError, MmfeatError, PeerUnavailableError
from .keys import MAX_KEY_BYTES, MAX_LOOKUP_KEYS, Namespace
from .messages import REQUEST_MODELS, FallbackReason, LeaseRef
from .paths import control_endpoint, default_runtime_dir, fd_socket_path
from .version import PROTOCOL_VERSION

__all__ = [
    "DTYPE_SIZES",
    "HANDLE_KINDS",
    "MAX_IN_FLIGHT",
    "MAX_KEY_BYTES",
    "MAX_LOOKUP_KEYS",
    "MAX_REQUEST_BYTES",
    "POOL_KINDS",
    "PROTOCOL_VERSION",
    "REQUEST_MODELS",
    "DaemonUnavailableError",
    "DecodeError",
    "Descriptor",
    "DescriptorError",
    "ErrorCode",
    "FallbackReason",
    "FdLimitError",
    "LeaseRef",
    "MmfeatError",
    "Namespace",
    "PeerUnavailableError",
    "TensorSpec",
    "control_endpoint",
    "decode",
    "default_runtime_dir",
    "encode",
    "fd_socket_path",
]
