"""Descriptor bytes mutated as a fuzzer would (bit flips, byte changes, truncation, length fields), and
what a consumer must make of each: a typed refusal, or views that are aligned, readable and hold the
bytes the descriptor names. Run in a child process (a crash is a finding, not a lost run): by
tests/test_inline_alignment.py and by ``make chaos`` (tests/chaos/fuzz.py).
"""

from __future__ import annotations

import random
import warnings
from typing import Any, Iterator

import torch

from mmfeat.client import Client, MmfeatError
from mmfeat.client import tensors as tz
from mmfeat.protos import Descriptor, DescriptorError

ALIGNMENT = 64
_BINS = {0xC4: 1, 0xC5: 2, 0xC6: 4}  # msgpack bin type byte -> bytes of its length field


def mutations(blob: bytes, rng: random.Random, count: int) -> Iterator[bytes]:
    """``count`` mutants of ``blob``, the same ones for the same ``rng`` state."""
    lengths = [i for i in range(len(blob) - 1) if blob[i] in _BINS or 0x90 <= blob[i] <= 0x9F]
    for _ in range(count):
        b = bytearray(blob)
        kind = rng.random()
        if kind < 0.35:  # bit flips, most in the head, where the fields are
            for _ in range(rng.randint(1, 3)):
                at = rng.randrange(min(len(b), 256)) if rng.random() < 0.8 else rng.randrange(len(b))
                b[at] ^= 1 << rng.randrange(8)
        elif kind < 0.55:  # a byte set to anything
            at = rng.randrange(min(len(b), 256))
            b[at] = rng.randrange(256)
        elif kind < 0.7:  # truncated, or run on
            b = b[: rng.randrange(len(b))] if rng.random() < 0.7 else b + bytes(rng.randrange(1, 80))
        elif lengths:  # a length field (a bin's, an array's) changed
            at = rng.choice(lengths)
            width = _BINS.get(b[at], 0)
            if width == 0:
                b[at] = 0x90 | rng.randrange(16)
            else:
                value = rng.choice([0, 1, 15, 16, 17, 63, 64, 255, rng.randrange(1 << (8 * width))])
                b[at + 1 : at + 1 + width] = (value % (1 << (8 * width))).to_bytes(width, "big")
        yield bytes(b)


def check_get(c: Client, src: Any) -> str:
    """What ``c.get(src)`` did: ``refused`` (a typed error) or ``read`` (every view checked here).
    Anything else raises AssertionError, or escapes as the untyped exception it was."""
    try:
        desc = Descriptor.from_bytes(src)
    except DescriptorError:
        desc = None
    try:
        got = c.get(src)
    except MmfeatError:
        return "refused"
    assert desc is not None, "get read a descriptor that from_bytes refused"
    views = got if isinstance(got, list) else [got]
    payload = bytes(desc.inline) if desc.is_inline else None
    for v, spec in zip(views, desc.tensors):
        assert v.data_ptr() % ALIGNMENT == 0, f"a {spec.dtype} view at {v.data_ptr():#x} is not {ALIGNMENT}-aligned"
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")  # complex to real drops the imaginary part, as asked
            v.float().sum()
            v.abs().sum() if v.dtype != torch.bool else v.sum()
        if payload is not None:  # an inline view holds exactly the bytes its spec names there
            expect = tz.view(torch.frombuffer(bytearray(payload), dtype=torch.uint8), spec) if payload else None
            assert expect is None or _bitwise(v, expect), f"a {spec.dtype} view holds other bytes than its payload"
    return "read"


def _bitwise(a: torch.Tensor, b: torch.Tensor) -> bool:
    if a.shape != b.shape or a.dtype != b.dtype:
        return False
    if a.numel() == 0:
        return True
    return bytes(a.contiguous().reshape(-1).view(torch.uint8).numpy()) == bytes(
        b.contiguous().reshape(-1).view(torch.uint8).numpy())


def fuzz_worker(runtime_dir: str, blobs: list[bytes], seed: int, count: int, at: Any, result_q: Any) -> None:
    """Get ``count`` mutants of each of ``blobs`` (and the blobs themselves) and report the tally, or the
    first finding. ``at`` (a shared integer) holds the index of the mutant being tried, so the parent can
    name the one that killed this process."""
    tally = {"read": 0, "refused": 0}
    try:
        with Client(runtime_dir, timeout=5.0) as c:
            i = 0
            for k, blob in enumerate(blobs):
                rng = random.Random(seed * 1000 + k)
                for mutant in (blob, *mutations(blob, rng, count)):
                    at.value = i
                    try:
                        tally[check_get(c, mutant)] += 1
                    except Exception as exc:
                        result_q.put(("finding", i, f"{type(exc).__name__}: {exc}", mutant.hex()))
                        return
                    i += 1
        result_q.put(("ok", tally))
    except BaseException as exc:  # reported, not lost with the process
        result_q.put(("error", -1, f"{type(exc).__name__}: {exc}", ""))


def mutant(blobs: list[bytes], seed: int, count: int, index: int) -> bytes:
    """The mutant ``fuzz_worker`` tried as number ``index``: to report the one that crashed it."""
    i = 0
    for k, blob in enumerate(blobs):
        rng = random.Random(seed * 1000 + k)
        for m in (blob, *mutations(blob, rng, count)):
            if i == index:
                return m
            i += 1
    return b""
