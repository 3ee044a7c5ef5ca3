"""Scenarios of an arena feature acked before its GPU wrote it (client/gpu/ready_word.py; SPEC.md, section
5): a producer publishes behind a fill the fake driver holds, a consumer process acks at once without
reading, and then the arena goes back (a close, the idle reaper, a size class's hand-back) or its producer
dies. The range the fill still writes into must not go to the next reserve before the fill's READY word is
written (or, its producer dead, the daemon let the word go). Run through scenarios.py; each leaves ``=== ``
marks in the driver's log. The other process (``serve_commands``) is a consumer that acks and a producer
that reserves, one command at a time, so the scenario waits for its answers, not for times."""

from __future__ import annotations

import json
import select
import subprocess
import sys
import threading
import time
from typing import Any, Callable

import torch

from tests.fake_cuda import fake_torch as ft
from tests.fake_cuda.order_scenarios import _setup, mark
from tests.fake_cuda.ready_scenarios import _start

FEATURE = 1 << 16  # an arena feature: under half the usual arena


def _until(done: Callable[[], bool], seconds: float = 30.0) -> bool:
    """Whether ``done()`` holds within ``seconds``: a wait for an event, bounded."""
    deadline = time.monotonic() + seconds
    while not done():
        if time.monotonic() >= deadline:
            return False
        time.sleep(0.01)
    return True


def _range_of(t: torch.Tensor) -> dict[str, Any]:
    """The pool range a reservation holds: its whole arena (the producer's GPU may write anywhere in it),
    or its reserved lease's."""
    from mmfeat.client.produce.reservations import _ATTR

    r = getattr(t, _ATTR)
    if r.kind == "arena":
        a = r.placed.arena
        return {"kind": "arena", "start": a.offset, "end": a.offset + a.size}
    if r.kind == "lease":
        return {"kind": "lease", "start": r.desc.offset, "end": r.desc.offset + r.desc.nbytes}
    return {"kind": r.kind, "start": 0, "end": 0}


def _over(got: dict[str, Any], desc: Any) -> bool:
    """Whether the range ``got`` overlaps the feature ``desc``."""
    return got["start"] < desc.offset + desc.nbytes and desc.offset < got["end"]


def _publish_behind(c: Any, side: Any, tag: str) -> Any:
    """An arena feature published behind work on ``side`` that stays queued until ``release(tag)``."""
    t = c.reserve((FEATURE,), torch.uint8, device="cuda:0")
    ft.launch(side, tag)
    return c.publish(t, after=side)


def _land(table: Any, side: Any, desc: Any) -> bool:
    """Let the fill go and wait for its READY word."""
    ft.release("fill")
    return _until(lambda: ft.pending(side) == 0 and table.is_ready(desc.lease, desc.gen))


class _Other:
    """The other process of the scenario (``serve_commands``), driven one command at a time."""

    def __init__(self) -> None:
        self.proc = _start("serve_commands", {}, stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True)
        self._read(300)  # connected (a busy machine takes a minute to start it): its session counts from here

    def call(self, op: str, **fields: Any) -> dict[str, Any]:
        assert self.proc.stdin is not None
        self.proc.stdin.write(json.dumps({"op": op, **fields}) + "\n")
        self.proc.stdin.flush()
        reply = self._read(120)
        if "error" in reply:
            raise RuntimeError(f"the other process's {op}: {reply['error']}")
        return reply

    def _read(self, seconds: float) -> dict[str, Any]:
        assert self.proc.stdout is not None
        if not select.select([self.proc.stdout], [], [], seconds)[0]:
            raise TimeoutError(f"the other process did not answer within {seconds} s")
        line = self.proc.stdout.readline()
        if not line:
            raise RuntimeError(f"the other process exited {self.proc.wait(5)}")
        return json.loads(line)

    def close(self) -> None:
        try:
            self.call("quit")
        finally:
            self.proc.wait(30)


def serve_commands() -> None:
    """A client that answers JSON commands on stdin, one line each: ack (a consumer done without reading),
    lookup, reserve (a producer's next reservation: the range it holds), stats, quit."""
    from mmfeat.client import Client
    from mmfeat.protos.descriptor import Descriptor
    from mmfeat.protos.errors import MmfeatError

    _setup()
    held: list[torch.Tensor] = []
    with Client(timeout=20) as c:
        c.connect()
        print(json.dumps({}), flush=True)
        for line in sys.stdin:
            cmd = json.loads(line)
            op = cmd["op"]
            reply: dict[str, Any] = {}
            try:
                desc = Descriptor.from_bytes(bytes.fromhex(cmd["desc"])) if "desc" in cmd else None
                if op == "ack":
                    c.ack(desc)  # no after=, no wait: the table's ack word, as a cancelled request's
                elif op == "lookup":
                    try:
                        c.request("lookup", lease=desc.lease_ref())
                        reply = {"live": True}
                    except MmfeatError as exc:
                        reply = {"live": False, "code": exc.code.value, "message": exc.message}
                elif op == "reserve":
                    held.append(c.reserve((cmd["nbytes"],), torch.uint8, device="cuda:0"))
                    reply = _range_of(held[-1])
                elif op == "stats":
                    s = c.stats()
                    reply = {"unwritten": s["unwritten"], "sessions": s["sessions"],
                             **{k: s["counters"][k] for k in ("unready_ended", "arenas_returned")}}
            except Exception as exc:
                reply = {"error": f"{type(exc).__name__}: {exc}"}
            print(json.dumps(reply), flush=True)
            if op == "quit":
                break
        held.clear()


def early_ack_in_the_sweeps_batch() -> None:
    """The daemon's sweep finds the feature published and acked by all at once: it ends it keeping its
    range (unwritten), says its read was lost, and takes the producer's next feature in that space once
    the fill landed."""
    from mmfeat.client import Client
    from mmfeat.client.produce.reservations import _ATTR

    _setup()
    other = _Other()
    try:
        with Client(timeout=20) as c:
            table = c._connect().table
            side = torch.cuda.Stream(0)
            desc = _publish_behind(c, side, "fill")
            other.call("ack", desc=desc.to_bytes().hex())
            s = c.stats()  # a sweep: the publish and its ack, seen together
            mark(f"acked before the fill: unwritten {s['unwritten']}, unready_ended {s['counters']['unready_ended']}")
            looked = other.call("lookup", desc=desc.to_bytes().hex())
            mark(f"its lookup: {looked.get('code')}: {looked.get('message')}")
            mark(f"the fill landed: {_land(table, side, desc)}")
            t = c.reserve((FEATURE,), torch.uint8, device="cuda:0")
            same = getattr(t, _ATTR).placed.offset == desc.offset
            following = c.publish(t)
            looked = other.call("lookup", desc=following.to_bytes().hex())
            mark(f"the next feature in its space: {same}; taken: {looked['live']}")
            mark(f"range back after the fill: {_until(lambda: c.stats()['unwritten'] == 0)}")
    finally:
        other.close()


def close_with_an_early_acked_feature() -> None:
    """The producer closes while the fill is held: close waits for its READY writes before it gives its
    arenas back, and the next producer's reservation gets another range meanwhile."""
    from mmfeat.client import Client

    _setup()
    other = _Other()
    try:
        c = Client(timeout=20)
        side = torch.cuda.Stream(0)
        desc = _publish_behind(c, side, "fill")
        other.call("ack", desc=desc.to_bytes().hex())
        before = other.call("stats")["arenas_returned"]
        closer = threading.Thread(target=c.close)
        closer.start()
        # Either close waits on the GPU now (for the fill), or it is over.
        _until(lambda: ft.waiting() > 0 or not closer.is_alive())
        mark(f"close waits for the fill: {closer.is_alive()}")
        returned = other.call("stats")["arenas_returned"] > before
        got = other.call("reserve", nbytes=FEATURE)
        mark(f"arenas back before the fill: {returned}; the next producer's range over the feature: {_over(got, desc)}")
        ft.release("fill")
        closer.join(30)
        mark(f"closed after the fill: {not closer.is_alive()}")
        mark(f"arenas back after it: {other.call('stats')['arenas_returned'] > before}")
    finally:
        other.close()


def _holds(arenas: Any, arena: Any) -> bool:
    return any(a is arena for pool in arenas._arenas.values() for a in pool)


def reap_with_an_early_acked_feature() -> None:
    """The producer's arena goes idle while the fill is held: the reaper keeps it until the fill's READY
    word is written, and the next producer's reservation gets another range meanwhile."""
    from mmfeat.client import Client
    from mmfeat.client.link import arenas as client_arenas
    from mmfeat.client.produce.reservations import _ATTR

    _setup()
    other = _Other()
    try:
        with Client(timeout=20) as c:
            table, arenas = c._connect().table, c._connect().arenas
            side = torch.cuda.Stream(0)
            t = c.reserve((FEATURE,), torch.uint8, device="cuda:0")
            arena = getattr(t, _ATTR).placed.arena
            ft.launch(side, "fill")
            desc = c.publish(t, after=side)
            del t
            other.call("ack", desc=desc.to_bytes().hex())
            arena.last_used = time.monotonic() - client_arenas.IDLE_S - 1  # unused for IDLE_S, as the reaper sees it
            arenas.reap_idle()
            got = other.call("reserve", nbytes=FEATURE)
            mark(f"the reaper kept it: {_holds(arenas, arena)}; the next producer's range over the feature: "
                 f"{_over(got, desc)}")
            mark(f"the fill landed: {_land(table, side, desc)}")
            arena.last_used = time.monotonic() - client_arenas.IDLE_S - 1
            arenas.reap_idle()
            mark(f"the reaper gives it back after the fill: {not _holds(arenas, arena)}")
    finally:
        other.close()


def hand_back_with_an_early_acked_feature() -> None:
    """A session at its one arena (arenas_per_session 1) asks for an arena of a new size class while the
    fill is held: its usual arena is not handed back for it until the fill's READY word is written, and
    the new reservation gets another range meanwhile."""
    from mmfeat.client import Client
    from mmfeat.client.produce.reservations import _ATTR

    _setup()
    other = _Other()
    try:
        with Client(timeout=20) as c:
            table, arenas = c._connect().table, c._connect().arenas
            side = torch.cuda.Stream(0)
            t = c.reserve((FEATURE,), torch.uint8, device="cuda:0")
            arena = getattr(t, _ATTR).placed.arena
            ft.launch(side, "fill")
            desc = c.publish(t, after=side)
            del t
            other.call("ack", desc=desc.to_bytes().hex())
            large = c.reserve((600 << 10,), torch.uint8, device="cuda:0")  # over half the usual arena
            got = _range_of(large)
            mark(f"a reservation of kind {got['kind']}; the usual arena kept: {_holds(arenas, arena)}; "
                 f"its range over the feature: {_over(got, desc)}")
            del large
            mark(f"the fill landed: {_land(table, side, desc)}")
    finally:
        other.close()


def publish_in_an_arena_and_wait() -> None:
    """Publish an arena feature behind a fill that never ends, say its descriptor, and wait to be killed."""
    from mmfeat.client import Client

    _setup()
    c = Client(timeout=20)
    desc = _publish_behind(c, torch.cuda.Stream(0), "never")
    print(desc.to_bytes().hex(), flush=True)
    sys.stdin.read()  # until killed (or the scenario's end closes the pipe)


def producer_killed_after_an_early_ack() -> None:
    """This process acks a producer's arena feature whose fill never runs, and the producer is SIGKILLed:
    the range goes to another producer only once the daemon let the feature's READY word go."""
    from mmfeat.client import Client
    from mmfeat.protos.descriptor import Descriptor

    _setup()
    other = _Other()  # the next producer, ready before the feature exists: the ack follows its publish at once
    try:
        with Client(timeout=20) as c:
            table = c._connect().table
            sessions = c.stats()["sessions"]  # before the producer's; none between its publish and its end
            producer = _start("publish_in_an_arena_and_wait", {}, stdin=subprocess.PIPE, stdout=subprocess.PIPE,
                              text=True)
            try:
                assert producer.stdout is not None
                desc = Descriptor.from_bytes(bytes.fromhex(producer.stdout.readline().strip()))
                c.ack(desc)  # no after=: done without reading
                producer.kill()
                producer.wait(30)
            finally:
                if producer.poll() is None:
                    producer.kill()
                    producer.wait(30)
            ended = _until(lambda: c.stats()["sessions"] <= sessions)
            got = other.call("reserve", nbytes=FEATURE)
            # Kept, its range is the feature's still: an overlap means the daemon had let it go (its grace
            # for a dead producer's GPU work passed), so unwritten counts none by now.
            s = c.stats()
            mark(f"its session ended: {ended}; the next producer's range over the feature while it was kept: "
                 f"{_over(got, desc) and s['unwritten'] > 0}; unready_ended {s['counters']['unready_ended']}")
            let_go = _until(lambda: c.stats()["unwritten"] == 0)
            mark(f"let go after its grace: {let_go}; its word: {table.is_ready(desc.lease, desc.gen)}")
    finally:
        other.close()


EARLY_ACK = {f.__name__: f for f in (serve_commands, early_ack_in_the_sweeps_batch, close_with_an_early_acked_feature,
                                     reap_with_an_early_acked_feature, hand_back_with_an_early_acked_feature,
                                     publish_in_an_arena_and_wait, producer_killed_after_an_early_ack)}
