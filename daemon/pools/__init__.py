"""Pool backends: one exportable memory region per device, behind one interface."""

from .base import Pool, PoolCreateError

__all__ = ["Pool", "PoolCreateError"]
