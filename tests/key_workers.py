"""Processes of the keyed and retained tests (tests/test_keys.py): a producer that puts under keys, a
scheduler that holds with a control-only client, readers that get and ack a hold."""

from __future__ import annotations

import time
from typing import Any

import torch

from mmfeat.client import Client


def keyed_producer(runtime_dir: str, keys: list[str], retain_ttl: float, out_q: Any) -> None:
    """Put one retained feature per key (feature i is all i), report the descriptors, exit."""
    with Client(runtime_dir, fallback="error") as c:
        descs = [c.put(torch.full((4096,), float(i)), key=k, retain_ttl=retain_ttl).to_bytes()
                 for i, k in enumerate(keys)]
    out_q.put(descs)


def holder(runtime_dir: str, key: str, count: int, out_q: Any) -> None:
    """A scheduler: hold ``key`` for ``count`` readers with a control-only client, report the hold's
    descriptor, then wait to be killed (its holds must end with it)."""
    c = Client(runtime_dir, map_pools=False)
    h = c.hold(key, count=count)
    out_q.put(h.to_bytes() if h is not None else None)
    time.sleep(600)


def ready_holder(runtime_dir: str, keys: Any, count: int, out_q: Any) -> None:
    """holder, started before what it holds exists: connected, it says "ready", then holds each key it
    is sent on ``keys`` and reports each hold's descriptor (None: nothing live under the key)."""
    c = Client(runtime_dir, map_pools=False)
    c.connect()
    out_q.put("ready")
    while True:
        h = c.hold(keys.get(timeout=600), count=count)
        out_q.put(h.to_bytes() if h is not None else None)


def reader(runtime_dir: str, hold: bytes, out_q: Any) -> None:
    """A worker rank: copy the held feature out, ack one unit of the hold, report the copy's sum."""
    with Client(runtime_dir) as c:
        t = c.get(hold, copy=True)
        c.ack(hold)
        c.flush()
    out_q.put(float(t.sum()))


def racing_producer(runtime_dir: str, keys: list[str], value: float, go: Any, out_q: Any) -> None:
    """Put one retained feature per key, all at once with other producers of the same keys (``go``
    starts them together), half by reserve and publish; report each descriptor and what it reads."""
    with Client(runtime_dir, fallback="error") as c:
        go.wait(60)
        out = []
        for i, k in enumerate(keys):
            if i % 2:
                r = c.reserve((4096,), torch.float32, key=k, retain_ttl=300.0)
                r.fill_(value)
                d = c.publish(r)
            else:
                d = c.put(torch.full((4096,), value), key=k, retain_ttl=300.0)
            out.append((d.to_bytes(), float(c.get(d, copy=True)[0])))
    out_q.put(out)


def press(runtime_dir: str, key: str, value: str, numel: str, ack: str = "") -> None:
    """Another producer, when the pool has room for one feature only: put a retained feature of ``numel``
    float32 elements, each ``value``, under ``key`` (after acking the counted feature ``ack`` names, as
    its one consumer), and print where it went: "pool", or "inline" where the pool could not take it."""
    with Client(runtime_dir) as c:
        if ack:
            c.ack(bytes.fromhex(ack), wait=True)
        desc = c.put(torch.full((int(numel),), float(value)), key=key, retain_ttl=300.0)
    print("inline" if desc.is_inline else "pool")


def key_reader(runtime_dir: str, keys: list[str], out_q: Any) -> None:
    """A consumer: each key's feature through a hold, copied and acked; per key its first element and
    whether every element equals it, or None where no key found it."""
    with Client(runtime_dir) as c:
        out: list[Any] = []
        for k in keys:
            h = c.hold(k, count=1)
            if h is None:
                out.append(None)
                continue
            t = c.get(h, copy=True)
            c.ack(h)
            out.append((float(t[0]), bool(torch.all(t == t[0]))))
        c.flush()
    out_q.put(out)


def streaming_producer(runtime_dir: str, keys: list[str], counted: list[bool], keys_q: Any) -> None:
    """Put feature i (all i) under keys[i] with wait=False, counted for one consumer or retained, and hand
    each key on the moment its put returned, as a producer's request ends once its step returned."""
    with Client(runtime_dir, fallback="error") as c:
        for i, (k, one) in enumerate(zip(keys, counted)):
            t = torch.full((4096,), float(i))
            if one:
                c.put(t, key=k, consumers=1, wait=False)
            else:
                c.put(t, key=k, retain_ttl=300.0, wait=False)
            keys_q.put((i, k, one))
        keys_q.put(None)


def streaming_consumer(runtime_dir: str, keys_q: Any, out_q: Any) -> None:
    """Look each key up as soon as it arrives: a counted feature by lookup (its consumer's ack ends it),
    a retained one by a hold; report per key whether it was found with the right bytes."""
    with Client(runtime_dir) as c:
        out = []
        while (item := keys_q.get(timeout=120)) is not None:
            i, k, one = item
            desc = c.lookup(k) if one else c.hold(k, count=1)
            if desc is None:
                out.append((k, False))
                continue
            t = c.get(desc, copy=True)
            c.ack(desc)
            out.append((k, torch.equal(t, torch.full((4096,), float(i)))))
        c.flush()
    out_q.put(out)


def late_holder(runtime_dir: str, key: str, ready_q: Any, go_q: Any, out_q: Any) -> None:
    """Connect, say so, and once told hold_many ``key`` as the vLLM scheduler does; report whether it
    was found. Says it is sending just before it sends, so the caller lets the daemon run after that."""
    with Client(runtime_dir, map_pools=False, timeout=60.0) as c:
        c.hold_many([key + "-none"])  # the session is open: the request below is its only frame
        ready_q.put("connected")
        go_q.get(timeout=120)
        ready_q.put("sending")
        answer = c.hold_many([key])[0]
        out_q.put(answer is not None)


def pinner(runtime_dir: str, key: str, count: int, out_q: Any, go: Any) -> None:
    """A scheduler that found ``key``'s descriptor itself: pin it for ``count`` reads in the lease table
    (no message), report ``(descriptor, pinned)``, then wait for ``go`` (or to be killed) and exit."""
    c = Client(runtime_dir, map_pools=False)
    desc = c.lookup(key)
    table = c._connect().table
    out_q.put((desc.to_bytes(), table.pin(desc.lease, desc.gen, desc.pool, desc.offset, desc.nbytes, count)))
    go.get(timeout=600)
