"""Processes of tests/test_overdue_reservations.py: a producer that does what the test tells it, step by
step, so that the test decides when it writes (after an event it saw, never after a guessed time), and
a consumer that checks every byte of what it is handed."""

from __future__ import annotations

import os
import time
from typing import Any

import torch

from mmfeat.client import Client
from mmfeat.protos import Descriptor, MmfeatError


def _slot_and_offset(c: Client, t: torch.Tensor) -> tuple[int, int]:
    """The lease slot and pool offset of reserved tensor ``t`` (a reservation's own descriptor, which only
    its publish hands out)."""
    desc = getattr(t, "_mmfeat_reservation").desc
    return desc.lease, t.data_ptr() - c.session.mapping(desc.pool).tensor.data_ptr()


def producer(runtime_dir: str, commands: Any, results: Any) -> None:
    """Run ``commands`` until "exit" (or "hang": wait to be killed), answering each on ``results``:
    ("reserve", nbytes, retain_ttl) -> ("reserved", slot, offset) or ("refused", code);
    ("publish", value) fills the oldest open reservation with ``value`` and publishes it -> ("published",
    descriptor bytes) or ("refused", code, message); ("discard",) -> ("discarded",); "raw_reserve" and
    "raw_publish" do the same with the bare requests, on the control socket."""
    open_ones: list[torch.Tensor] = []
    raw: dict[str, Any] = {}  # the reserve reply of "raw_reserve"
    try:
        with Client(runtime_dir, inline_threshold=0, fallback="error", timeout=10.0) as c:
            c.connect()
            results.put(("ready", os.getpid()))
            while True:
                cmd = commands.get(timeout=120)
                op = cmd[0]
                try:
                    if op == "reserve":
                        _, nbytes, retain_ttl = cmd
                        t = c.reserve((nbytes,), torch.uint8, retain_ttl=retain_ttl)
                        open_ones.append(t)
                        results.put(("reserved", *_slot_and_offset(c, t)))
                    elif op == "publish":
                        t = open_ones.pop(0)
                        t.fill_(cmd[1])  # the write: after whatever the test waited for
                        results.put(("published", c.publish(t).to_bytes()))
                    elif op == "discard":
                        c.discard(open_ones.pop(0))
                        results.put(("discarded",))
                    elif op == "raw_reserve":  # the protocol itself, as any client may speak it
                        raw = c.request("reserve", session=c.session.token, nbytes=cmd[1], retain_ttl=cmd[2])
                        results.put(("reserved", raw["lease"]["lease"], raw["lease"]["offset"]))
                    elif op == "raw_publish":
                        reply = c.request("publish", session=c.session.token, lease=raw["lease"])
                        results.put(("published", reply["state"]))
                    elif op == "hang":
                        results.put(("hanging",))
                        time.sleep(600)
                    else:
                        break
                except MmfeatError as exc:
                    results.put(("refused", exc.code.value, exc.message))
            results.put(("async_failures", dict(c.async_failures)))
    except BaseException as exc:  # report to the parent instead of dying silently
        results.put(("error", f"{type(exc).__name__}: {exc}"))


def consumer(runtime_dir: str, blob: bytes, value: int, results: Any) -> None:
    """Read the feature ``blob`` names; report whether every byte is ``value`` and whether its slot's
    READY word names its generation, then ack it."""
    try:
        desc = Descriptor.from_bytes(blob)
        with Client(runtime_dir, timeout=10.0) as c:
            view = c.get(blob)
            right = bool((view == value).all())
            del view
            ready = c.session.table.is_ready(desc.lease, desc.gen)
            c.ack(blob)
            c.flush()
        results.put(("read", right, ready))
    except BaseException as exc:
        results.put(("error", f"{type(exc).__name__}: {exc}"))
