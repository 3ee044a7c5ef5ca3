"""Producer and consumer processes for the chaos run (tests/chaos/chaos.py), killed at random.

Every feature's bytes follow from its seed, so a consumer checks every byte it reads. A wrong byte is
appended to the run's WRONG file at once (an O_APPEND write survives the SIGKILL that may follow);
counts go to a per-process JSON file twice a second.

Beside the honest workers, producer p0 puts non-contiguous tensors that require grad (a training step's
activations), and every odd-numbered consumer gets and checks under ``torch.inference_mode()`` (a server
running its model): a view carrying either mode is a wrong read too.
"""

from __future__ import annotations

import json
import os
import random
import sys
import time
from pathlib import Path

import msgpack
import torch
import zmq

from mmfeat.client import Client, MmfeatError
from mmfeat.protos.descriptor import Descriptor

DTYPES = [torch.uint8, torch.float32, torch.int64, torch.bfloat16, torch.float16]
# The shortest ack_ttl of the run (chaos.LOW_ACK_TTL, after a reload): a view is the feature's bytes only
# until then, so a view read later than that after its publish may show the next feature's bytes.
EARLIEST_EXPIRY_S = 2.0
# chaos.py --backend cuda_vmm: features are made, put and checked as CUDA tensors.
DEVICE = os.environ.get("MMFEAT_CHAOS_DEVICE", "cpu")


def pattern(seed: int, nbytes: int) -> torch.Tensor:
    """The bytes of feature ``seed``: cheap to make, different for every seed and offset."""
    i = torch.arange(nbytes, dtype=torch.int64)
    return ((i * 131 + (seed * 7919) % 251 + (i >> 8) * 17) % 251).to(torch.uint8)


def feature(seed: int, nbytes: int, dtype: torch.dtype) -> torch.Tensor:
    size = torch.empty((), dtype=dtype).element_size()
    n = max(1, nbytes // size)
    return pattern(seed, n * size).view(dtype).reshape(-1).to(DEVICE)


def with_grad(t: torch.Tensor) -> torch.Tensor:
    """``t``'s values in a non-contiguous tensor (every other element of a larger one) that, for a
    floating dtype, requires grad and has a grad_fn."""
    base = torch.zeros(t.numel(), 2, dtype=t.dtype, device=t.device)
    base[:, 0] = t
    if t.dtype.is_floating_point:
        base.requires_grad_()
    return base[:, 0]


class Counts:
    def __init__(self, run: Path, role: str) -> None:
        self.path = run / f"{role}-{os.getpid()}.json"
        self.values: dict[str, int] = {}
        self._last = 0.0

    def add(self, key: str, n: int = 1) -> None:
        self.values[key] = self.values.get(key, 0) + n
        now = time.monotonic()
        if now - self._last > 0.5:
            self.flush()
            self._last = now

    def flush(self) -> None:
        tmp = self.path.with_suffix(".tmp")
        tmp.write_text(json.dumps(self.values))
        os.replace(tmp, self.path)


def produce(runtime_dir: str, run: Path, endpoints: list[str], seconds: float, grad: bool) -> None:
    rng = random.Random(os.getpid())
    counts = Counts(run, "producer")
    ctx = zmq.Context()
    pushes = []
    for ep in endpoints:
        s = ctx.socket(zmq.PUSH)
        s.linger = 0
        s.sndhwm = 64
        s.connect(ep)
        pushes.append(s)
    seq = 0
    end = time.monotonic() + seconds
    with Client(runtime_dir, inline_threshold=0, timeout=2.0) as c:
        while time.monotonic() < end:
            seq += 1
            seed = (os.getpid() << 24) | seq
            nbytes = int(2 ** rng.uniform(6, 22))  # 64 B to 4 MiB
            dtype = rng.choice(DTYPES)
            k = rng.choice([1, 2])
            try:
                if rng.random() < 0.2:
                    tensors = [feature(seed + j, nbytes // 3 + 1, dtype) for j in range(3)]
                    desc = c.put_many([with_grad(t) for t in tensors] if grad else tensors, consumers=k)
                    spec = [[seed + j, t.numel(), str(dtype)] for j, t in enumerate(tensors)]
                elif rng.random() < 0.15:
                    # Filled in place, and now and then published later than a reload's short reserve_ttl
                    # allows: that publish must raise STALE, never name a range another feature owns.
                    src = feature(seed, nbytes, dtype)
                    t = c.reserve(src.shape, dtype, consumers=k, device=src.device)
                    t.copy_(src)
                    time.sleep(rng.choice([0.0, 0.0, 0.0, 0.8]))
                    desc = c.publish(t)
                    spec = [[seed, t.numel(), str(dtype)]]
                else:
                    t = feature(seed, nbytes, dtype)
                    desc = c.put(with_grad(t) if grad else t, consumers=k)
                    spec = [[seed, t.numel(), str(dtype)]]
            except MmfeatError as exc:
                counts.add(f"put_error_{exc.code.value if exc.code else 'unavailable'}")
                time.sleep(0.05)
                continue
            counts.add("inline" if desc.is_inline else "put")
            if grad:
                counts.add("grad_puts")
                if not desc.is_inline and seq % 8 == 0:
                    _check_own_view(c, desc, run)
            # When it was sent (CLOCK_MONOTONIC is one clock for every process): publish came before it.
            blob = msgpack.packb([spec, desc.to_bytes(), time.monotonic()])
            for s in rng.sample(pushes, k):
                try:
                    s.send(blob, zmq.NOBLOCK)
                except zmq.Again:
                    counts.add("undelivered")  # that consumer is down: the lease waits for ack_ttl
    counts.flush()


def _check_own_view(c: Client, desc: Descriptor, run: Path) -> None:
    """A view of the grad producer's own feature: its copies into the pool must not have given the pool's
    views a graph, which every later view of this process would inherit."""
    try:
        got = c.get(desc)
    except MmfeatError:
        return  # the daemon restarted, or the consumers acked it already
    for t in got if isinstance(got, list) else [got]:
        if t.requires_grad or t.grad_fn is not None:
            wrong = os.open(run / "WRONG", os.O_WRONLY | os.O_APPEND | os.O_CREAT, 0o644)
            os.write(wrong, f"producer {os.getpid()}: a view of its own feature has grad_fn {t.grad_fn}\n".encode())
            os.close(wrong)


def consume(runtime_dir: str, run: Path, endpoint: str, inference: bool) -> None:
    rng = random.Random(os.getpid())
    counts = Counts(run, "consumer")
    wrong = os.open(run / "WRONG", os.O_WRONLY | os.O_APPEND | os.O_CREAT, 0o644)
    ctx = zmq.Context()
    pull = ctx.socket(zmq.PULL)
    pull.linger = 0
    pull.bind(endpoint)
    with Client(runtime_dir, timeout=2.0) as c:
        while True:
            if not pull.poll(200):
                counts.add("idle")
                continue
            spec, blob, sent = msgpack.unpackb(pull.recv())
            copy = rng.random() < 0.5
            with torch.inference_mode(inference):
                try:
                    got = c.get(blob, copy=copy)
                except MmfeatError as exc:
                    counts.add(f"refused_{exc.code.value if exc.code else 'unavailable'}")
                    continue
                for (seed, numel, dtype), t in zip(spec, got if isinstance(got, list) else [got]):
                    expect = feature(seed, numel * t.element_size(), getattr(torch, dtype.split(".")[1]))
                    # A private copy made in inference mode is an inference tensor, as torch makes it; a
                    # view into the pool never is, and never requires grad.
                    moded = t.requires_grad or (not copy and not desc_inline(blob) and t.is_inference())
                    if moded or not torch.equal(t.view(torch.uint8), expect.view(torch.uint8).to(t.device)):
                        age = time.monotonic() - sent
                        if not moded and not copy and not desc_inline(blob) and age >= EARLIEST_EXPIRY_S:
                            # Read past the shortest ack_ttl since its publish: the lease may have ended
                            # and its range gone to another feature, as the contract allows.
                            counts.add("views_past_ack_ttl")
                            continue
                        os.write(wrong, f"seed {seed} numel {numel} {dtype} copy={copy} inference={inference} "
                                        f"requires_grad={t.requires_grad} is_inference={t.is_inference()} "
                                        f"{age:.2f} s after it was sent\n".encode())
                        counts.add("wrong")
                    else:
                        counts.add("checked_bytes", t.numel() * t.element_size())
            counts.add("checked")
            if inference:
                counts.add("inference_gets")
            try:
                c.ack(blob, wait=rng.random() < 0.5)
                counts.add("acked")
            except MmfeatError:
                counts.add("ack_failed")


def desc_inline(blob: bytes) -> bool:
    """Whether ``blob`` is an inline descriptor, whose view is made from its bytes in the caller's mode."""
    return Descriptor.from_bytes(blob).is_inline


def main() -> None:
    """A supervisor: forks the worker (torch already imported, so a restart costs milliseconds, not
    the seconds of an import), writes its pid for the chaos driver to kill, and forks a new one each
    time it dies."""
    role, runtime_dir, run, name = sys.argv[1], sys.argv[2], Path(sys.argv[3]), sys.argv[4]
    while True:
        pid = os.fork()
        if pid == 0:
            try:
                if role == "producer":
                    produce(runtime_dir, run, sys.argv[6].split(","), float(sys.argv[5]), grad=name == "p0")
                elif role == "staged":
                    from . import staged_worker

                    staged_worker.staged_read(runtime_dir, run)
                elif role in ("keyed", "holder"):
                    from . import keyed_worker

                    if role == "keyed":
                        keyed_worker.keyed_produce(runtime_dir, run, float(sys.argv[5]))
                    else:
                        keyed_worker.hold_and_read(runtime_dir, run)
                else:
                    consume(runtime_dir, run, sys.argv[5], inference=int(name[1:]) % 2 == 1)
            finally:
                os._exit(0)
        tmp = run / f"{name}.pid.tmp"
        tmp.write_text(str(pid))
        os.replace(tmp, run / f"{name}.pid")
        os.waitpid(pid, 0)


if __name__ == "__main__":
    main()
