"""Consumers of inline features that run in processes of their own: a crash there fails a test, not
the pytest worker (tests/test_inline_alignment.py)."""

from __future__ import annotations

import mmap
import tempfile
import warnings
from typing import Any

import torch
import zmq

from mmfeat.client import Client

DTYPES = ["complex128", "complex64", "float64", "int64", "float32", "float16", "bfloat16"]
SIZES = [1, 2, 3, 5, 7, 10, 33, 100, 255, 1000]


def honest(dtype: str, n: int) -> torch.Tensor:
    """The tensor a test puts for ``dtype`` and ``n`` elements; the consumer makes it again to compare."""
    t = torch.arange(n, dtype=torch.float64) * 0.5 - 3
    if dtype.startswith("complex"):
        return torch.complex(t, -t).to(getattr(torch, dtype))
    return t.to(getattr(torch, dtype))


def read_aligned(runtime_dir: str, items: list[tuple[bytes, list[tuple[str, int]]]], result_q: Any) -> None:
    """Get each blob as bytes, as a read-only memoryview and as a zmq Frame received without copying;
    every view must be 64-byte aligned, equal to what was put, and take torch's kernels (.float(), .abs())."""
    checked = 0
    try:
        with tempfile.TemporaryDirectory() as tmp, Client(runtime_dir) as c:
            ctx = zmq.Context()
            push, pull = ctx.socket(zmq.PUSH), ctx.socket(zmq.PULL)
            pull.bind(f"ipc://{tmp}/s")
            push.connect(f"ipc://{tmp}/s")
            for blob, cases in items:
                push.send(blob, copy=False)
                for src in (blob, memoryview(blob), pull.recv(copy=False)):
                    got = c.get(src)
                    views = got if isinstance(got, list) else [got]
                    assert len(views) == len(cases)
                    for v, (dtype, n) in zip(views, cases):
                        assert v.data_ptr() % 64 == 0, f"{dtype}[{n}] from {type(src).__name__} at {v.data_ptr():#x}"
                        assert torch.equal(v, honest(dtype, n)), f"{dtype}[{n}] from {type(src).__name__}"
                        with warnings.catch_warnings():
                            warnings.simplefilter("ignore")  # complex to real drops the imaginary part
                            assert torch.equal(v.float(), honest(dtype, n).float())
                        assert torch.equal(v.abs(), honest(dtype, n).abs())
                        checked += 1
                c.ack(blob)
            push.close(0)
            pull.close(0)
            ctx.term()
            c.flush()
        result_q.put(("ok", checked))
    except BaseException as exc:  # reported, not lost with the process
        result_q.put(("error", f"{type(exc).__name__}: {exc}"))


def write_inline_in_place(runtime_dir: str, blob: bytes, shared: str, readonly: bool, result_q: Any) -> None:
    """A consumer that divides its view in place, as the README's preprocessing does. With ``shared``
    (a file holding the blob) it reads the blob where that file is mapped shared, as a consumer reads a
    receive buffer another consumer reads too."""
    c = Client(runtime_dir, readonly=readonly)
    if shared:
        with open(shared, "r+b") as f:
            pages = mmap.mmap(f.fileno(), 0)
        src: Any = memoryview(pages).toreadonly()
    else:
        src = blob
    v = c.get(src)
    result_q.put(("read", float(v.max()), v.data_ptr() % 64))
    v /= 255
    result_q.put(("wrote", float(v.max())))
    c.close()
