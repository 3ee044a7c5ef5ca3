"""What every pool backend provides to the daemon."""

from __future__ import annotations

from abc import ABC, abstractmethod
from typing import Optional

from mmfeat.protos.messages import PoolInfo


class PoolCreateError(RuntimeError):
    """The backend cannot create its pool here; the message says what is missing."""


class Pool(ABC):
    """One exportable memory region. The daemon hands out slices of it and never touches its bytes (a
    mesh maps it only for NIXL to move them)."""

    pool_id: int
    kind: str  # "host" or "cuda"
    device: int  # CUDA ordinal, -1 for host memory
    size: int
    handle: str  # "posix_fd" or "fabric"
    uuid: Optional[str] = None  # the GPU's UUID: ordinals differ between processes, UUIDs do not
    rdma: bool = False  # allocated GPUDirect RDMA capable: a NIC can register it for direct transfers

    @abstractmethod
    def export_fd(self) -> Optional[int]:
        """The fd to pass with SCM_RIGHTS (the daemon keeps owning it), or None for a FABRIC pool."""

    def fabric_handle(self) -> Optional[bytes]:
        return None

    def map_for_pulls(self) -> Optional[tuple[int, str, int]]:
        """(address, NIXL memory type, device) of a mapping of the whole pool in this process, for peers'
        NIXL READs; None if this backend has none (its features cannot be pulled)."""
        return None

    def remote_writes_landed(self) -> None:
        """A NIC finished writing a pulled feature into this pool: make its bytes visible to every GPU
        that may read them before anyone is told. Host memory needs nothing."""

    @abstractmethod
    def close(self) -> None:
        """Release the memory and every fd; idempotent."""

    def info(self, epoch: int) -> PoolInfo:
        return PoolInfo(self.pool_id, epoch, self.kind, self.device, self.size, self.handle, self.fabric_handle(),
                        self.uuid)
