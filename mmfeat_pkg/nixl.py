"""Finding NIXL, which both the daemon (pulls) and ``mmfeat bench --remote`` (the bare READ) use."""

from __future__ import annotations

import importlib
from typing import Any

# Tried in order: the meta package, then the CUDA 12 and 13 builds (mmfeat[mesh] installs nixl-cu12).
_NIXL_MODULES = ("nixl._api", "nixl_cu12._api", "nixl_cu13._api")


class NixlUnavailable(RuntimeError):
    """NIXL cannot be loaded or started here; the message says what to install."""


def load_nixl() -> Any:
    """NIXL's Python API module; NixlUnavailable naming mmfeat[mesh] if none is installed."""
    errors = []
    for name in _NIXL_MODULES:
        try:
            return importlib.import_module(name)
        except ImportError as exc:
            errors.append(f"{name}: {exc}")
    raise NixlUnavailable("NIXL is not installed (pip install 'mmfeat[mesh]'); " + "; ".join(errors))
