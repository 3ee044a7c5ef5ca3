"""Producer and consumer processes for the GPU suite (spawned; each owns its CUDA context)."""

from __future__ import annotations

import os
import time
from typing import Any

import torch

from mmfeat.client import Client

DTYPES = [torch.float32, torch.bfloat16, torch.float16, torch.int64, torch.uint8, torch.float8_e4m3fn]
SHAPES = [(7,), (3, 224, 224), (16, 1024, 1024)]


def expected(seed: int, shape: tuple[int, ...], dtype: torch.dtype, device: str) -> torch.Tensor:
    g = torch.Generator(device="cpu").manual_seed(seed)
    base = torch.randn(shape, generator=g) * 8
    return base.to(dtype).to(device)


def produce(runtime_dir: str, n_consumers: int, out_q: Any) -> None:
    torch.cuda.set_device(0)
    with Client(runtime_dir, inline_threshold=0, fallback="error") as c:
        seed = 0
        for shape in SHAPES:
            for dtype in DTYPES:
                t = expected(seed, shape, dtype, "cuda:0")
                desc = c.put(t, consumers=n_consumers)
                assert desc.kind == "cuda", desc.kind
                out_q.put(("one", seed, shape, str(dtype), desc.to_bytes()))
                seed += 1
        cpu = expected(seed, (4, 1000), torch.float32, "cpu")  # a CPU tensor into a GPU pool
        out_q.put(("one", seed, (4, 1000), str(torch.float32), c.put(cpu, consumers=n_consumers).to_bytes()))
        many = [expected(500 + k, (k + 1, 77), DTYPES[k], "cuda:0") for k in range(len(DTYPES))]
        out_q.put(("many", 500, None, None, c.put_many(many, consumers=n_consumers).to_bytes()))
        out_q.put(None)
        out_q.put(("fds", len(os.listdir("/proc/self/fd"))))


def consume(rank: int, runtime_dir: str, in_q: Any, result_q: Any) -> None:
    try:
        device = rank % torch.cuda.device_count()
        torch.cuda.set_device(device)
        stream = torch.cuda.Stream()
        checked = 0
        with Client(runtime_dir) as c:
            fds_after_first = None
            while (item := in_q.get(timeout=120)) is not None:
                kind, seed, shape, dtype, blob = item
                with torch.cuda.stream(stream):
                    view = c.get(blob)  # zero-copy view of the pool
                    staged = c.get(blob, device=device)  # private copy in this rank's HBM
                    views = view if isinstance(view, list) else [view]
                    stageds = staged if isinstance(staged, list) else [staged]
                    if kind == "one":
                        dt = getattr(torch, dtype.split(".")[1])
                        exp = [expected(seed, shape, dt, f"cuda:{device}")]
                    else:
                        exp = [expected(500 + k, (k + 1, 77), DTYPES[k], f"cuda:{device}") for k in range(len(DTYPES))]
                    for v, s, e in zip(views, stageds, exp):
                        assert v.is_cuda and s.device.index == device and v.dtype == e.dtype and v.shape == e.shape
                        assert torch.equal(v.to(f"cuda:{device}").view(torch.uint8), e.view(torch.uint8))
                        assert torch.equal(s.view(torch.uint8), e.view(torch.uint8))
                    assert c.ack(blob, after=stream) is None  # acked once the reads on `stream` finish
                checked += 1
                if fds_after_first is None:
                    fds_after_first = len(os.listdir("/proc/self/fd"))
            assert c.flush(30.0)
            fds_end = len(os.listdir("/proc/self/fd"))
        result_q.put(("ok", checked, fds_after_first, fds_end))
    except BaseException as exc:
        import traceback

        result_q.put(("error", f"{type(exc).__name__}: {exc}\n{traceback.format_exc()}"))


def produce_behind_a_kernel(runtime_dir: str, rounds: int, out_q: Any) -> None:
    """Features a kernel fills behind half a second of GPU time, put at once: how long each put took,
    and its descriptor. The consumer's reads are ordered behind the fill only by the READY word."""
    torch.cuda.set_device(0)
    with Client(runtime_dir, inline_threshold=0, fallback="error") as c:
        base = torch.zeros(4 << 20, dtype=torch.uint8, device="cuda:0")
        c.ack(c.put(base))  # the mapping and the arena, outside the measurement
        for k in range(rounds):
            torch.cuda._sleep(int(1e9))
            t = torch.full((4 << 20,), k + 1, dtype=torch.uint8, device="cuda:0")
            t0 = time.monotonic()
            desc = c.put(t)
            out_q.put((time.monotonic() - t0, k + 1, desc.to_bytes()))
        torch.cuda.synchronize()
        out_q.put(None)


def put_keyed_behind_a_kernel(runtime_dir: str, rounds: int, out_q: Any) -> None:
    """Retained features under keys, put without a round trip (``wait=False``: in the arena, bound by a
    message) while the kernel that fills each runs: its key and value. Its readers hold the key and read
    through the hold, a slot of its own, whose READY word the daemon stores at once."""
    torch.cuda.set_device(0)
    with Client(runtime_dir, inline_threshold=0, fallback="error") as c:
        c.ack(c.put(torch.zeros(1 << 16, dtype=torch.uint8, device="cuda:0")))  # the mapping and the arena
        for k in range(rounds):
            torch.cuda._sleep(int(1e9))
            t = torch.full((1 << 16,), k + 1, dtype=torch.uint8, device="cuda:0")
            key = f"gpu-keyed-{os.getpid()}-{k}"
            desc = c.put(t, key=key, retain_ttl=120.0, wait=False)
            out_q.put((key, k + 1, desc.is_inline))
        torch.cuda.synchronize()
        out_q.put(None)
