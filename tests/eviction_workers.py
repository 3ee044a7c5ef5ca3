"""Processes of tests/test_eviction_refusals.py: producers of retained features under keys, a producer
whose put is refused, and a reader that checks every byte of each key's feature."""

from __future__ import annotations

from typing import Any

import torch

from mmfeat.client import Client, MmfeatError


def put_retained(runtime_dir: str, keys: list[str], nbytes: int, out_q: Any) -> None:
    """Put one retained feature of ``nbytes`` per key (feature i's bytes are all i + 1); report where each
    lies ((offset, nbytes) from its descriptor), exit: the features stay."""
    try:
        with Client(runtime_dir, fallback="error") as c:
            descs = [c.put(torch.full((nbytes,), i + 1, dtype=torch.uint8), key=k, retain_ttl=600.0)
                     for i, k in enumerate(keys)]
        out_q.put([(d.offset, d.nbytes) for d in descs])
    except BaseException as exc:  # report to the parent instead of dying silently
        out_q.put(("error", f"{type(exc).__name__}: {exc}"))


def put_refused(runtime_dir: str, key: str, nbytes: int, out_q: Any) -> None:
    """Put one retained feature of ``nbytes`` with fallback="error": report ("put",) or ("refused", code)."""
    try:
        with Client(runtime_dir, fallback="error") as c:
            try:
                c.put(torch.zeros(nbytes, dtype=torch.uint8), key=key, retain_ttl=600.0)
                out_q.put(("put",))
            except MmfeatError as exc:
                out_q.put(("refused", exc.code.value if exc.code else None))
    except BaseException as exc:
        out_q.put(("error", f"{type(exc).__name__}: {exc}"))


def read_keys(runtime_dir: str, keys: list[str], out_q: Any) -> None:
    """For each key: whether its feature is live and every byte of it is i + 1 (a copy, by key)."""
    try:
        with Client(runtime_dir) as c:
            out = []
            for i, k in enumerate(keys):
                desc = c.lookup(k)
                out.append(desc is not None and bool((c.get(desc, copy=True) == i + 1).all()))
        out_q.put(out)
    except BaseException as exc:
        out_q.put(("error", f"{type(exc).__name__}: {exc}"))
