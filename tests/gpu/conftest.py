"""GPU tests run only where torch sees a CUDA device and the driver API works."""

from __future__ import annotations

import pytest


def _gpu_missing_reason() -> str | None:
    try:
        import torch
    except ImportError:
        return "torch is not installed"
    if not torch.cuda.is_available():
        return "no CUDA device visible to torch"
    from mmfeat import cuda_driver as drv

    return drv.driver_unavailable_reason()


_REASON = _gpu_missing_reason()


def pytest_collection_modifyitems(config, items) -> None:
    if _REASON is None:
        return
    skip = pytest.mark.skip(reason=f"GPU test skipped: {_REASON}")
    for item in items:
        # The marker, not the keyword: keywords hold every parent's name, so a checkout in a folder
        # named gpu would skip the whole suite.
        if item.get_closest_marker("gpu") is not None:
            item.add_marker(skip)
