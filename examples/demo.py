"""make demo: a daemon, one producer process and two consumer processes moving real tensors.

The producer plays a tokenizer that preprocessed images into pixel tensors; the consumers play two
tensor-parallel ranks that both need every image. Descriptors travel over a multiprocessing queue here,
as they would in the server's own messages.
"""

from __future__ import annotations

import multiprocessing as mp
import os
import shutil
import signal
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import torch

from mmfeat.client import Client
from mmfeat.testing import DaemonStartError, spawn_daemon

N_IMAGES = 24


def producer(runtime_dir: str, queues: list) -> None:
    with Client(runtime_dir) as c:
        c.connect()  # session, fd handshake and the pool mapping: once, before the first feature
        t0 = time.perf_counter()
        nbytes = 0
        for i in range(N_IMAGES):
            pixels = torch.full((3, 448, 448), float(i), dtype=torch.bfloat16)  # one preprocessed image
            grid = torch.tensor([1, 32, 32], dtype=torch.int64)  # its patch grid: tiny, so it goes inline
            desc = (c.put_many([pixels, grid], consumers=len(queues)) if i % 4 == 0
                    else c.put(pixels, consumers=len(queues)))
            nbytes += desc.nbytes
            for q in queues:
                q.put(desc.to_bytes())
        for q in queues:
            q.put(None)
        dt = time.perf_counter() - t0
        print(f"[producer pid {os.getpid()}] put {N_IMAGES} features, {nbytes / 2**20:.1f} MiB, "
              f"in {dt * 1e3:.1f} ms", flush=True)


def consumer(rank: int, runtime_dir: str, q) -> None:
    with Client(runtime_dir) as c:
        n = 0
        while (blob := q.get()) is not None:
            got = c.get(blob)  # a zero-copy view into the shared pool
            pixels = got[0] if isinstance(got, list) else got
            value = pixels[0, 0, 0].item()
            assert torch.all(pixels == value), "feature bytes differ"
            c.ack(blob)
            n += 1
        print(f"[consumer rank {rank} pid {os.getpid()}] read and acked {n} features, every byte checked", flush=True)


def main() -> int:
    # Under /tmp, not $TMPDIR: a socket path must fit AF_UNIX's 108 bytes.
    runtime_dir = Path(tempfile.mkdtemp(prefix="mmfeat-demo-", dir="/tmp"))
    print(f"[demo] daemon's runtime dir: {runtime_dir} (removed at the end)", flush=True)
    try:
        return _run(runtime_dir)
    finally:
        shutil.rmtree(runtime_dir, ignore_errors=True)


def _run(runtime_dir: Path) -> int:
    try:
        daemon = spawn_daemon(runtime_dir, ["--pool-mb", "256"])
    except DaemonStartError as exc:
        print(f"demo: {exc}", file=sys.stderr)
        return 1
    try:
        ctx = mp.get_context("spawn")
        queues = [ctx.Queue(), ctx.Queue()]
        procs = [ctx.Process(target=consumer, args=(r, str(runtime_dir), q)) for r, q in enumerate(queues)]
        procs.append(ctx.Process(target=producer, args=(str(runtime_dir), queues)))
        for p in procs:
            p.start()
        for p in procs:
            p.join(120)
        if any(p.exitcode != 0 for p in procs):
            print("demo: a worker failed", file=sys.stderr)
            for p in procs:
                if p.is_alive():
                    p.kill()
                    p.join(15)
            return 1
        print()
        subprocess.run([sys.executable, "-m", "mmfeat.cli", "--runtime-dir", str(runtime_dir), "stats"], check=True)
        return 0
    finally:
        daemon.send_signal(signal.SIGTERM)
        try:
            daemon.wait(15)
        except subprocess.TimeoutExpired:
            daemon.kill()
            daemon.wait(15)


if __name__ == "__main__":
    sys.exit(main())
