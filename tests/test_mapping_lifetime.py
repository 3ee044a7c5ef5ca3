"""How long a host pool and the lease table stay mapped in a client process: while anything the library
handed out views them, and not after. Each attack runs in a process of its own, so that a read of
unmapped memory shows as the SIGSEGV it is instead of ending the test run."""

from __future__ import annotations

import subprocess
import sys

import torch

# Every child starts with these: its runtime dir in ``rt`` and ``mapped(name)``, how many mappings of
# that name the process has now (without a garbage collection unless ``collect``).
PROLOGUE = """
import gc, os, sys, threading, time
import torch
from mmfeat.client import Client
rt = sys.argv[1]

def mapped(name="mmfeat-pool0", collect=False):
    if collect:
        gc.collect()
    return open("/proc/self/maps").read().count(name)
"""


def run_child(code: str, *args: str, timeout: float = 120.0) -> str:
    """Run ``code`` after PROLOGUE in a fresh interpreter; its stdout, once it exited 0 (a signal, such
    as SIGSEGV, is a negative return code)."""
    out = subprocess.run([sys.executable, "-c", PROLOGUE + code, *args], capture_output=True, text=True,
                         timeout=timeout)
    assert out.returncode == 0, f"child exited {out.returncode}: {out.stderr[-4000:]}"
    return out.stdout


def test_a_closed_clients_pool_is_unmapped_by_its_last_view_without_a_garbage_collection(daemon) -> None:
    """A closed session refers to nothing that refers back to it, so reference counting frees it and its
    pool mapping goes with the last view: a consumer that outlives its daemon and allocates little
    would otherwise keep the whole pool until a full collection that may not come for a long time."""
    code = """
gc.disable()
c = Client(rt, inline_threshold=0)
d = c.put(torch.arange(100_000, dtype=torch.float32))
view = c.get(d)
c.ack(d)
c.close()
assert mapped() == 1 and float(view[-1]) == 99_999.0, "the view holds the pages"
del view
assert mapped() == 0, "nothing uses the pool, yet it is still mapped"
print("ok")
"""
    assert run_child(code, str(daemon.runtime_dir)).strip() == "ok"
    daemon.wait_for(lambda s: s["pools"][0]["used"] == 0, what="the feature to be freed")


# A producer whose tensor stops inside its copy into the pool until told to go on: a put that is still
# writing (a large feature, a descheduled thread) while another thread closes the client.
SLOW_PUT = """
inside, go = threading.Event(), threading.Event()

class Slow(torch.Tensor):
    @classmethod
    def __torch_function__(cls, func, types, args=(), kwargs=None):
        if func is torch.Tensor.copy_:
            inside.set()
            go.wait(60)
        return super().__torch_function__(func, types, args, kwargs or {})

c = Client(rt, inline_threshold=0, fallback="error")
c.ack(c.put(torch.zeros(int(sys.argv[2]))))  # the session's first arena, for features this size
slow = torch.full((int(sys.argv[2]) // 2, 2), 7.0).t().as_subclass(Slow)  # not contiguous: copied by copy_
out = {}

def put():
    try:
        out["desc"] = c.put(slow)
    except Exception as exc:
        out["exc"] = exc

t = threading.Thread(target=put)
t.start()
assert inside.wait(60)
c.close()
print("closed", flush=True)
assert sys.stdin.readline().strip() == "go"
go.set()
t.join(60)
print(out["desc"].to_bytes().hex() if "desc" in out else f"failed: {out['exc']!r}", flush=True)
"""


def _put_during_close(daemon, elements: int) -> None:
    child = subprocess.Popen([sys.executable, "-c", PROLOGUE + SLOW_PUT, str(daemon.runtime_dir), str(elements)],
                             stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    try:
        assert child.stdout.readline().strip() == "closed", child.stderr.read() if child.poll() is not None else ""
        with daemon.client(inline_threshold=0, fallback="error") as other:
            mine = other.put(torch.full((elements,), 1.0))
            child.stdin.write("go\n")
            child.stdin.flush()
            out, err = child.communicate(timeout=60)
            assert child.returncode == 0, err[-4000:]
            got = other.get(mine)
            assert torch.equal(got, torch.full((elements,), 1.0)), (
                "another producer's put, still writing when its client closed, overwrote this feature")
            assert not out.startswith("failed"), f"the put racing close: {out}"
            slow = bytes.fromhex(out.strip())
            theirs = other.get(slow)
            assert torch.equal(theirs, torch.full((elements // 2, 2), 7.0).t())
            del got, theirs
            other.ack(mine)
            other.ack(slow)
    finally:
        if child.poll() is None:
            child.kill()
            child.wait()
    daemon.wait_for(lambda s: s["pools"][0]["used"] == 0 and s["sessions"] == 0, timeout=15,
                    what="every feature and session to end")


def test_closing_a_client_while_a_put_writes_into_its_arena_does_not_free_that_space(daemon) -> None:
    """close() gives the session's arenas back and ends it; while a put in another thread is still
    writing into an arena, the daemon would hand that space to the next producer, whose feature the put
    then overwrites (its consumers read wrong bytes). close() waits for the write, or leaves the end of
    the session to it."""
    _put_during_close(daemon, 1 << 16)


def test_closing_a_client_while_a_put_writes_into_its_reserved_lease_does_not_free_it(daemon) -> None:
    """The same for a feature too large for an arena, written into a lease reserved in the session: the
    session's end frees its unpublished leases."""
    _put_during_close(daemon, 1 << 22)


def test_close_racing_puts_gets_and_acks_in_other_threads_raises_nothing_and_reads_right(daemon) -> None:
    """Threads share one Client while another thread closes it: close() itself raises nothing (it used
    to find the session replaced under it), no thread reads unmapped memory or wrong bytes, and what
    fails says so with a typed error. A call after close() opens the client's next session; the final
    close() ends it, and every feature is freed."""
    code = """
from mmfeat.client import MmfeatError
x = torch.arange(1 << 16, dtype=torch.float32)
errors = []

def work(c, stop):
    while not stop.is_set():
        try:
            d = c.put(x)
            v = c.get(d)
            if not torch.equal(v, x):
                errors.append("wrong bytes")
            del v
            c.ack(d)
        except MmfeatError:
            pass  # typed: the client was closed under this call
        except BaseException as exc:
            errors.append(repr(exc))

for _ in range(15):
    c = Client(rt, inline_threshold=0, timeout=5)
    c.connect()
    stop = threading.Event()
    threads = [threading.Thread(target=work, args=(c, stop)) for _ in range(3)]
    for t in threads:
        t.start()
    time.sleep(0.05)
    try:
        c.close()
    except BaseException as exc:
        errors.append(f"close: {exc!r}")
    stop.set()
    for t in threads:
        t.join(60)
    c.close()  # the session a racing call opened after the first close
assert not errors, errors[:5]
print("ok")
"""
    assert run_child(code, str(daemon.runtime_dir), timeout=300).strip() == "ok"
    daemon.wait_for(lambda s: s["pools"][0]["used"] == 0 and s["sessions"] == 0, timeout=15,
                    what="every feature and session to end")

