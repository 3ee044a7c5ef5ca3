"""``make chaos`` (second half): fuzz the control socket, the fd-channel handshake and the requests a
session sends on its fd channel. Every answer must be a typed reply; the daemon must stay up with flat
fds, no lease left behind, and serve a real client at the end. Then fuzz descriptors: mutants of real
inline and pool descriptors got by consumers in child processes (tests/chaos/descriptor_fuzz.py), each
a typed refusal or a read of aligned views that hold the bytes named; a consumer that dies is a finding,
reported with the mutant that killed it, and the next batch goes on.

    python -m tests.chaos.fuzz --frames 50000 --handshakes 5000 --descriptors 12000
"""

from __future__ import annotations

import argparse
import json
import random
import shutil
import socket
import sys
import tempfile
import time
from pathlib import Path

import msgpack
import torch
import zmq

from mmfeat.client import Client
from mmfeat.protos import PROTOCOL_VERSION, REQUEST_MODELS, ErrorCode
from mmfeat.testing import worker_context

from tests.chaos import descriptor_fuzz as dfz
from tests.conftest import anon_bytes, fd_count, start_daemon

CODES = {c.value for c in ErrorCode}
VALUES = [None, True, False, 0, -1, 1, 255, 1 << 31, 1 << 63, -(1 << 63), 1.5, float("nan"), "", "x" * 200, b"",
          b"y" * 16, b"z" * 1000, [], [1, "a"], {}, {"k": b""}, {"pool": 0, "epoch": 1, "lease": 0, "gen": 0,
          "token": b"t" * 16, "offset": 0, "nbytes": 256}]
FIELDS = ["session", "nbytes", "lease", "count", "consumers", "reason", "name", "pid", "device", "ack_id", "deadline",
          "quiet", "id"]


def _frame(rng: random.Random, real: dict) -> bytes:
    kind = rng.random()
    if kind < 0.25:
        return bytes(rng.getrandbits(8) for _ in range(rng.randint(0, 400)))
    msg: dict = {"v": PROTOCOL_VERSION if rng.random() < 0.9 else rng.choice(VALUES), "id": rng.randint(1, 1 << 30),
                 "op": rng.choice([*REQUEST_MODELS, "nope", None, 5])}
    for _ in range(rng.randint(0, 4)):
        msg[rng.choice(FIELDS)] = rng.choice(VALUES + [real["session"], real["lease"]])
    if rng.random() < 0.3:  # a real lease reference with one field off
        lease = dict(real["lease"])
        key = rng.choice(list(lease))
        lease[key] = rng.choice(VALUES)
        msg["lease"] = lease
    blob = msgpack.packb(msg, use_bin_type=True)
    if kind > 0.9 and blob:
        b = bytearray(blob)
        b[rng.randrange(len(b))] = rng.getrandbits(8)
        blob = bytes(b)
    return blob


_MUTANTS_PER_BLOB = 200  # per child process: a crash loses at most one batch's tally


def _fuzz_descriptors(root: Path, total: int, seed: int) -> dict:
    """``total`` mutants of real descriptors, got in child processes a batch each."""
    with Client(root, inline_threshold=1 << 62) as inline, Client(root, inline_threshold=0, fallback="error") as pool:
        stft = torch.complex(torch.arange(100.0), torch.ones(100)).to(torch.complex128)
        blobs = [inline.put(stft).to_bytes(), inline.put(torch.ones(7, dtype=torch.bfloat16)).to_bytes(),
                 inline.put_many([torch.ones(33, dtype=torch.float16), stft[:5].to(torch.complex64)]).to_bytes(),
                 inline.put(torch.arange(20_000, dtype=torch.int16)).to_bytes()]
        descs = [pool.put(torch.arange(2000, dtype=torch.float64), consumers=1),
                 pool.put_many([torch.ones(3, dtype=torch.complex128), torch.ones(5)], consumers=1)]
        blobs += [d.to_bytes() for d in descs]
        ctx = worker_context()
        out = {"mutants": 0, "read": 0, "refused": 0, "children": 0, "findings": []}
        batches = max(1, -(-total // (_MUTANTS_PER_BLOB * len(blobs))))
        for b in range(batches):
            results, at = ctx.SimpleQueue(), ctx.Value("q", -1)
            proc = ctx.Process(target=dfz.fuzz_worker,
                               args=(str(root), blobs, seed + b, _MUTANTS_PER_BLOB, at, results))
            proc.start()
            proc.join(300)
            if proc.is_alive():
                proc.kill()
                proc.join()
            out["children"] += 1
            got = results.get() if not results.empty() else None
            if got is not None and got[0] == "ok":
                out["mutants"] += sum(got[1].values())
                out["read"] += got[1]["read"]
                out["refused"] += got[1]["refused"]
                continue
            mutant = dfz.mutant(blobs, seed + b, _MUTANTS_PER_BLOB, at.value)
            out["findings"].append({"batch_seed": seed + b, "index": at.value, "exit": proc.exitcode,
                                    "what": got[2] if got else "the consumer died", "mutant": mutant.hex()})
        for d in descs:
            pool.ack(d)
        pool.flush(10)
    return out


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--frames", type=int, default=50_000)
    p.add_argument("--handshakes", type=int, default=5_000)
    p.add_argument("--descriptors", type=int, default=12_000, help="mutated descriptors to get, in child processes")
    p.add_argument("--seed", type=int, default=7)
    args = p.parse_args(argv)
    rng = random.Random(args.seed)
    root = Path(tempfile.mkdtemp(prefix="mmf-fuzz-", dir="/tmp"))
    d = start_daemon(root, "--pool-mb", "64", log=root / "mmfeatd.log")
    untyped = 0
    replies = {"ok": 0, "error": 0, "silent": 0}
    try:
        with Client(root, inline_threshold=0) as c:
            real_desc = c.put(torch.ones(1000), consumers=1)
            real = {"session": c.session.token, "lease": real_desc.lease_ref()}
            c.ack(real_desc)
        fds0, anon0 = fd_count(d.pid), anon_bytes(d.pid)
        ctx = zmq.Context()
        dealer = ctx.socket(zmq.DEALER)
        dealer.linger = 0
        dealer.connect(f"ipc://{root / 'mmfeatd.sock'}")
        for _ in range(args.frames):
            frames = [_frame(rng, real)]
            if rng.random() < 0.02:
                frames.append(b"extra")
            dealer.send_multipart(frames)
            if not dealer.poll(2000):
                replies["silent"] += 1  # a quiet request that succeeded, or a frame the daemon dropped
                continue
            reply = msgpack.unpackb(dealer.recv(), raw=False)
            if reply.get("ok") is True:
                replies["ok"] += 1
            elif reply.get("ok") is False and reply.get("error", {}).get("code") in CODES:
                replies["error"] += 1
            else:
                untyped += 1
        dealer.close()
        ctx.term()
        # The fd channel: garbage handshakes, then garbage requests from a real session.
        hs = {"typed": 0, "closed": 0, "fds_leaked_to_stranger": 0}
        path = str(root / "mmfeatd.fds.sock")
        for i in range(args.handshakes):
            s = socket.socket(socket.AF_UNIX, socket.SOCK_SEQPACKET)
            s.settimeout(5)
            s.connect(path)
            if i % 10 == 0:
                s.close()  # connect and vanish
                continue
            s.send(_frame(rng, real) if i % 3
                   else msgpack.packb({"v": PROTOCOL_VERSION, "session": rng.choice(VALUES)}))
            try:
                data, fds, _, _ = socket.recv_fds(s, 4096, 8)
            except OSError:
                data, fds = b"", []
            hs["fds_leaked_to_stranger"] += len(fds)
            if data and msgpack.unpackb(data, raw=False).get("error", {}).get("code") in CODES:
                hs["typed"] += 1
            else:
                hs["closed"] += 1
            s.close()
        session_requests = 0
        with Client(root) as c:
            sess = c.session.fd
            for _ in range(args.handshakes):
                sess.send_frame(_frame(rng, real))
                session_requests += 1
            assert sess.sync(10.0), "the daemon did not answer a ping on the fd channel after the fuzzing"
        descriptors = _fuzz_descriptors(root, args.descriptors, args.seed)
        time.sleep(1.0)
        with Client(root, inline_threshold=0, fallback="error") as c:
            desc = c.put(torch.arange(4096), consumers=1)
            assert torch.equal(c.get(desc), torch.arange(4096))
            c.ack(desc)
        s = d.stats()
        time.sleep(1.0)
        report = {
            "control_frames": args.frames,
            "replies": replies,
            "untyped_replies": untyped,
            "fd_handshakes": args.handshakes,
            "handshake_answers": hs,
            "fd_channel_requests": session_requests,
            "descriptors": descriptors,
            "bad_requests_counted": s["counters"]["bad_requests"],
            "pool_used_after": s["pools"][0]["used"],
            "daemon_fds": {"before": fds0, "after": fd_count(d.pid)},
            "daemon_anon_mib": {"before": round(anon0 / 2**20, 1), "after": round(anon_bytes(d.pid) / 2**20, 1)},
        }
        print(json.dumps(report, indent=2))
        ok = (untyped == 0 and hs["fds_leaked_to_stranger"] == 0 and s["pools"][0]["used"] == 0
              and not descriptors["findings"] and descriptors["mutants"] >= args.descriptors
              and d.proc.poll() is None
              and fd_count(d.pid) <= fds0 + 1 and anon_bytes(d.pid) - anon0 < 64 << 20)
        print("fuzz: " + ("held" if ok else "FAILED"))
        return 0 if ok else 1
    finally:
        if d.proc.poll() is None:
            d.stop()
        d.proc.communicate()
        shutil.rmtree(root, ignore_errors=True)


if __name__ == "__main__":
    sys.exit(main())
