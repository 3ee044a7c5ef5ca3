"""A producer process that fills reserved pool memory in place, for tests/test_reservations.py; its
descriptors go to workers.consume, which checks every byte."""

from __future__ import annotations

from typing import Any

import torch

from mmfeat.client import Client

from .workers import DTYPES, cases, make_tensor


def _fill(t: torch.Tensor, src: torch.Tensor) -> None:
    """Write ``src`` into ``t`` as a kernel with ``out=`` would; src + 0 is src for every dtype here."""
    torch.add(src, torch.zeros_like(src), out=t)


def _in_place(c: Client, t: torch.Tensor, desc: Any, index: int = 0) -> bool:
    """Whether the published feature is the very memory the producer wrote: nothing was copied."""
    base = c.session.mapping(desc.pool).tensor.data_ptr()
    return t.data_ptr() == base + desc.offset + desc.tensors[index].offset


def produce_reserved(runtime_dir: str, consumers: int, out_q: Any, result_q: Any) -> None:
    in_place = 0
    try:
        with Client(runtime_dir, inline_threshold=0, fallback="error") as c:
            # The 2-D shapes at even seeds: workers.consume expects the odd ones transposed.
            items = [(s, shape, dt) for s, shape, dt in cases() if len(shape) != 2 or s % 2 == 0]
            items.append((7000, (40, 1 << 20), torch.uint8))  # more than half an arena: a reserved lease
            for seed, shape, dt in items:
                t = c.reserve(shape, dt, consumers=consumers)
                _fill(t, make_tensor(seed, shape, dt))
                desc = c.publish(t)
                in_place += _in_place(c, t, desc)
                out_q.put(("one", seed, shape, str(dt), desc.to_bytes()))
            layout = [((k + 1, 333), DTYPES[k]) for k in range(len(DTYPES))]
            many = c.reserve_many(layout, consumers=consumers)
            for k, t in enumerate(many):
                _fill(t, make_tensor(900 + k, (k + 1, 333), DTYPES[k]))
            desc = c.publish(many)
            in_place += all(_in_place(c, t, desc, k) for k, t in enumerate(many))
            out_q.put(("many", 900, None, None, desc.to_bytes()))
            result_q.put(("producer", in_place, len(items) + 1))
    except BaseException as exc:  # report to the parent instead of dying silently
        result_q.put(("error", f"{type(exc).__name__}: {exc}"))
    out_q.put(None)
