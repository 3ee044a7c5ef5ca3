"""Consumer processes for tests/test_parcel.py (spawned): they receive pickled requests the way a
scheduler rank does and check every tensor against the request the producer built from the same seed."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

import torch


@dataclass
class Request:
    rid: int
    prompt: str
    images: list[torch.Tensor]
    extras: dict[str, Any] = field(default_factory=dict)


def make_request(rid: int) -> Request:
    g = torch.Generator().manual_seed(rid)
    dtypes = (torch.float32, torch.bfloat16, torch.float16)[: 1 + rid % 3]
    images = [torch.randn(3, 256 + 32 * k, 256, generator=g).to(dtype) for k, dtype in enumerate(dtypes)]
    extras = {"grid": torch.tensor([[1, 8, 8]]), "mask": torch.randint(0, 2, (300_000,), generator=g).bool(),
              "ids": list(range(rid % 7)), "nested": {"t": torch.arange(100_000, dtype=torch.int64) * rid}}
    return Request(rid, f"describe image {rid}", images, extras)


def same(a: Request, b: Request) -> bool:
    return (a.rid == b.rid and a.prompt == b.prompt and len(a.images) == len(b.images)
            and all(x.dtype == y.dtype and torch.equal(x, y) for x, y in zip(a.images, b.images))
            and torch.equal(a.extras["grid"], b.extras["grid"]) and torch.equal(a.extras["mask"], b.extras["mask"])
            and a.extras["ids"] == b.extras["ids"] and torch.equal(a.extras["nested"]["t"], b.extras["nested"]["t"]))


def rank(runtime_dir: str, endpoint: str, count: int, results: Any) -> None:
    import zmq

    from mmfeat.client import Client, loads

    ctx = zmq.Context()
    pull = ctx.socket(zmq.PULL)
    pull.connect(endpoint)
    bad = 0
    with Client(runtime_dir) as c:
        for _ in range(count):
            data = pull.recv()
            with loads(data, client=c) as req:
                bad += not same(req, make_request(req.rid))
        c.flush()
    pull.close(0)
    ctx.term()
    results.put(bad)


def from_queue(runtime_dir: str, q: Any, results: Any) -> None:
    import os

    os.environ["MMFEAT_RUNTIME_DIR"] = runtime_dir
    parcel = q.get(timeout=60)  # a Pooled on the way in, a Parcel here
    ok = same(parcel.value, make_request(parcel.value.rid))
    parcel.ack()
    from mmfeat.client.parcel import default_client

    default_client().flush()
    results.put(ok)


def keeps_only_the_value(runtime_dir: str, inbox: Any, outbox: Any) -> None:
    """``loads(data).value``: the Parcel goes at once, the tensors stay. Reads them after the producer has
    put over whatever space an ack would have given back, then drops them."""
    import gc

    from mmfeat.client import Client, loads

    with Client(runtime_dir) as c:
        value = loads(inbox.get(timeout=60), client=c).value
        gc.collect()
        c.flush()  # any ack this process made is applied before the producer looks
        outbox.put("held")
        assert inbox.get(timeout=60) == "overwritten"
        outbox.put(all(bool((t == 7).all()) for t in value["pixel_values"]))
        del value
        gc.collect()
        c.flush()
        outbox.put("dropped")


def drops_the_last_tensor_inside_the_clients_lock(runtime_dir: str, inbox: Any, outbox: Any) -> None:
    """The last tensor freed while this thread holds the client's fd-channel lock, as when a garbage
    collection runs inside the client's own code: the automatic ack must not wait for that lock."""
    import time

    from mmfeat.client import Client, loads

    with Client(runtime_dir) as c:
        x = loads(inbox.get(timeout=60), client=c).value["x"]
        session = c.session
        time.sleep(0.01)  # past alive()'s read interval, so that an ack through it would take the lock
        with session.fd._read_lock:
            del x
        outbox.put(c.flush())
