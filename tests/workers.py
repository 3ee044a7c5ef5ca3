"""Code that runs in separate producer and consumer processes (multiprocessing, spawn)."""

from __future__ import annotations

import os
import time
from typing import Any

import torch

from mmfeat.client import Client

DTYPES = [torch.float32, torch.bfloat16, torch.float16, torch.int64, torch.uint8, torch.bool, torch.float64,
          torch.int32]


def make_tensor(seed: int, shape: tuple[int, ...], dtype: torch.dtype) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed)
    if dtype == torch.bool:
        return torch.randint(0, 2, shape, generator=g).bool()
    if dtype.is_floating_point:
        return torch.randn(shape, generator=g).to(dtype)
    return torch.randint(0, 120, shape, generator=g).to(dtype)


def cases() -> list[tuple[int, tuple[int, ...], torch.dtype]]:
    """Few bytes to tens of MiB, every dtype in DTYPES, one non-contiguous input among them."""
    shapes = [(3,), (17, 5), (256, 257), (64, 1024, 3), (3, 1024, 1024), (8, 1024, 1024)]
    out = []
    for i, shape in enumerate(shapes):
        for j, dt in enumerate(DTYPES):
            if (shape[0] * (shape[1] if len(shape) > 1 else 1) * (shape[2] if len(shape) > 2 else 1)
                    * torch.empty((), dtype=dt).element_size() > 40 << 20):
                continue
            if i >= 4 and j % 3:  # keep the large cases few: the CI machine has two cores
                continue
            out.append((i * 100 + j, shape, dt))
    return out


def produce(runtime_dir: str, consumers: int, out_q: Any) -> None:
    with Client(runtime_dir, inline_threshold=0, fallback="error") as c:
        for seed, shape, dt in cases():
            t = make_tensor(seed, shape, dt)
            if len(shape) == 2 and seed % 2:
                t = t.t()  # non-contiguous input
            out_q.put(("one", seed, tuple(t.shape), str(dt), c.put(t, consumers=consumers).to_bytes()))
        many = [make_tensor(900 + k, (k + 1, 333), DTYPES[k]) for k in range(len(DTYPES))]
        out_q.put(("many", 900, None, None, c.put_many(many, consumers=consumers).to_bytes()))
    out_q.put(None)


def consume(runtime_dir: str, in_q: Any, result_q: Any, copy: bool) -> None:
    checked = 0
    try:
        with Client(runtime_dir) as c:
            while (item := in_q.get(timeout=60)) is not None:
                kind, seed, shape, dtype, blob = item
                got = c.get(blob, copy=copy)
                if kind == "one":
                    dt = getattr(torch, dtype.split(".")[1])
                    expect = make_tensor(seed, shape if seed % 2 == 0 or len(shape) != 2 else shape[::-1], dt)
                    if len(shape) == 2 and seed % 2:
                        expect = expect.t()
                    assert got.dtype == dt and tuple(got.shape) == shape, (got.dtype, got.shape, dt, shape)
                    assert torch.equal(got, expect), f"bytes differ for seed {seed}"
                else:
                    for k, t in enumerate(got):
                        assert torch.equal(t, make_tensor(900 + k, (k + 1, 333), DTYPES[k]))
                c.ack(blob)
                checked += 1
        result_q.put(("ok", checked))
    except BaseException as exc:  # report to the parent instead of dying silently
        result_q.put(("error", f"{type(exc).__name__}: {exc}"))


def reserve_and_hang(runtime_dir: str, n: int, nbytes: int, ready_q: Any) -> None:
    """Hold ``n`` RESERVED leases and wait to be killed."""
    c = Client(runtime_dir)
    session = c.session
    for _ in range(n):
        c.request("reserve", session=session.token, nbytes=nbytes, consumers=1)
    ready_q.put(os.getpid())
    time.sleep(600)


def write_in_place(runtime_dir: str, blob: bytes, readonly: bool, result_q: Any) -> None:
    """A consumer that divides its zero-copy view in place, as image preprocessing might."""
    c = Client(runtime_dir, readonly=readonly)
    v = c.get(blob)
    result_q.put(("read", float(v.max())))
    v /= 255
    result_q.put(("wrote", float(v.max())))
    c.close()


def read_max(runtime_dir: str, blob: bytes, result_q: Any) -> None:
    with Client(runtime_dir, readonly=True) as c:
        result_q.put(("read", float(c.get(blob).max()), float(c.get(blob).min())))
        c.ack(blob)
        c.flush()
