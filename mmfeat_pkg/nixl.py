"""Finding NIXL, which both the daemon (pulls) and ``mmfeat bench --remote`` (the bare READ) use."""

from __future__ import annotations

import ctypes
import glob
import importlib
import importlib.util
import logging
import os
import sys
import threading
from typing import Any, Optional

# Tried in order: the meta package, then the CUDA 12 and 13 builds (mmfeat[mesh] installs nixl-cu12,
# mmfeat[mesh-cu13] nixl-cu13: each registers GPU memory only where its CUDA runtime is).
_NIXL_MODULES = ("nixl._api", "nixl_cu12._api", "nixl_cu13._api")
_RUNTIME_MAJOR = {"nixl_cu12": 12, "nixl_cu13": 13}


# How long NIXL's progress thread waits for UCX events before it looks again, in microseconds. The
# nixl_agent class sets 0, which makes that thread spin: a whole core per agent, idle or not, taken from
# the transfers themselves (docs/performance.md). The thread wakes on UCX's events whatever this is; it
# only bounds how late a missed one is noticed.
PROGRESS_DELAY_US = 100_000
# UCX's TCP transport (nodes without RDMA) moves data in segments of 8-64 KiB by default. Features are
# MiB, and 1 MiB segments move them much faster for about 1 MiB more memory per daemon
# (docs/performance.md). Set only where the environment sets neither:
# UCX refuses to start with receive segments smaller than send segments, so one of the pair set by an
# operator and the other by us could stop the agent. RDMA transports ignore them.
UCX_DEFAULTS = {"UCX_TCP_TX_SEG_SIZE": "1m", "UCX_TCP_RX_SEG_SIZE": "1m"}
_construct = threading.Lock()


class NixlUnavailable(RuntimeError):
    """NIXL cannot be loaded or started here; the message says what to install."""


def load_nixl() -> Any:
    """NIXL's Python API module; NixlUnavailable naming mmfeat[mesh] if none is installed."""
    errors = []
    for name in _NIXL_MODULES:
        try:
            api = importlib.import_module(name)
            logging.getLogger("nixl").setLevel(logging.WARNING)  # it logs every agent and backend at INFO
            return api
        except ImportError as exc:
            errors.append(f"{name}: {exc}")
    # Named as an extra of the checkout: mmfeat itself is on no registry.
    raise NixlUnavailable("NIXL is not installed (pip install './mmfeat[mesh]' from a checkout of mmfeat, or "
                          "'./mmfeat[mesh-cu13]' for its CUDA 13 build); " + "; ".join(errors))


def preload_cuda_runtime(api: Any) -> Optional[str]:
    """Load the CUDA runtime that this NIXL build's UCX names (``libcudart.so.12`` for nixl_cu12) from
    an installed NVIDIA wheel, if the system's library paths lack it; the path loaded, else None.

    UCX's CUDA module, which registers GPU memory, needs that library. A process that imported torch
    has it loaded, but mmfeatd imports no torch, and a node or image without a CUDA toolkit has no copy
    on its library paths (then NIXL cannot register a GPU pool: docs/gpu.md). The mesh extras
    install the runtime's wheel; once a library of that soname is loaded, the loader uses it for UCX."""
    # The meta package ``nixl`` imports one of the builds: whichever is loaded names the runtime.
    builds = [api.__name__.split(".")[0], *(m for m in ("nixl_cu12", "nixl_cu13") if m in sys.modules)]
    major = next((_RUNTIME_MAJOR[b] for b in builds if b in _RUNTIME_MAJOR), None)
    if major is None:
        return None
    name = f"libcudart.so.{major}"
    try:
        ctypes.CDLL(name, mode=ctypes.RTLD_GLOBAL)
        return None  # already loaded, or on the library paths
    except OSError:
        pass
    spec = importlib.util.find_spec("nvidia")
    for base in (spec.submodule_search_locations or []) if spec is not None else []:
        for path in sorted(glob.glob(os.path.join(base, "**", name), recursive=True)):
            try:
                ctypes.CDLL(path, mode=ctypes.RTLD_GLOBAL)
                return path
            except OSError as exc:
                logging.getLogger("mmfeat").warning("cannot load %s: %s", path, exc)
    return None


def make_agent(api: Any, name: str, net_devices: Optional[str] = None) -> Any:
    """A UCX agent whose progress thread sleeps between events (see PROGRESS_DELAY_US), with UCX_DEFAULTS
    where the environment sets none (UCX reads its environment when the agent starts its backend), with
    ``net_devices`` as UCX_NET_DEVICES if given (where UCX may listen and send), and with the CUDA
    runtime UCX needs for GPU memory loaded (preload_cuda_runtime)."""
    if not any(key in os.environ for key in UCX_DEFAULTS):
        os.environ.update(UCX_DEFAULTS)
    if net_devices:
        os.environ["UCX_NET_DEVICES"] = net_devices
    preload_cuda_runtime(api)
    real = api.nixlBind.nixlAgent

    def with_delay(agent_name: str, config: Any) -> Any:
        config.pthrDelay = PROGRESS_DELAY_US
        return real(agent_name, config)

    # nixl_agent's constructor builds its config and the native agent in one go, with no way to pass
    # the delay: intercept the one call, under a lock, and put it back at once.
    with _construct:
        api.nixlBind.nixlAgent = with_delay
        try:
            return api.nixl_agent(name, api.nixl_agent_config(enable_prog_thread=True, backends=["UCX"]))
        finally:
            api.nixlBind.nixlAgent = real
