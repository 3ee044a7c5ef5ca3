"""Consumers and producers that run in autograd modes of their own, in separate processes."""

from __future__ import annotations

from typing import Any

import torch

from mmfeat.client import Client


def expected(seed: int, requires_grad: bool = False) -> torch.Tensor:
    """The feature a mode test's producer puts for ``seed``: non-contiguous, 256 KiB of float32, and
    with ``requires_grad`` the transpose of a leaf that requires grad (so it has a grad_fn)."""
    g = torch.Generator().manual_seed(seed)
    return torch.randn(256, 256, generator=g).requires_grad_(requires_grad).t()


def consume(runtime_dir: str, in_q: Any, result_q: Any, inference: bool) -> None:
    """Get every feature (with ``inference``, under torch.inference_mode(), as a server running its
    model does) and check its bytes there, then check that the process's own puts and views outside
    that mode still work."""
    checked = 0
    try:
        with Client(runtime_dir, inline_threshold=1024, fallback="error") as c:
            while (item := in_q.get(timeout=60)) is not None:
                seed, blob = item
                with torch.inference_mode(inference):
                    got = c.get(blob)
                    assert torch.equal(got, expected(seed)), f"bytes differ for seed {seed}"
                    assert torch.equal(got * 2, expected(seed) * 2)
                c.ack(blob)
                checked += 1
            own = c.put(expected(7))  # non-contiguous: written through the typed view the gets made
            view = c.get(own)
            assert not view.is_inference() and not view.requires_grad, "the process's later views carry a mode"
            assert torch.equal(torch.from_numpy(view.numpy()), expected(7))
            c.ack(own)
        result_q.put(("ok", checked))
    except BaseException as exc:  # report to the parent instead of dying silently
        result_q.put(("error", f"{type(exc).__name__}: {exc}"))


def produce_with_grad(runtime_dir: str, n: int, consumers: int, out_q: Any) -> None:
    """Put ``n`` non-contiguous features that require grad, as a training step's activations would."""
    with Client(runtime_dir, inline_threshold=1024, fallback="error") as c:
        for seed in range(n):
            out_q.put((seed, c.put(expected(seed, requires_grad=True), consumers).to_bytes()))
    out_q.put(None)
