"""How long a host pool and the lease table stay mapped in a client process: while anything the library
handed out views them, and not after. Each attack runs in a process of its own, so that a read of
unmapped memory shows as the SIGSEGV it is instead of ending the test run."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import torch

# Every child starts with these: its runtime dir in ``rt`` and ``mapped(name)``, how many mappings of
# that name the process has now (without a garbage collection unless ``collect``).
ROOT = Path(__file__).resolve().parent.parent
PROLOGUE = f"""
import gc, os, signal, sys, threading, time
sys.path.insert(0, {str(ROOT)!r})  # the tests package: its fork helpers
import torch
from mmfeat.client import Client
from tests.forking import fork_holding, reap
rt = sys.argv[1]
""" + """
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
            out, err = child.communicate(timeout=300)
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


def test_every_kind_of_view_of_a_get_outlives_its_client_and_then_lets_the_pool_go(daemon) -> None:
    """Views made from a get() by as_strided, numpy, frombuffer, DLPack (torch's and numpy's), a
    storage and a memoryview all hold the pool's pages through the tensor's storage: they read the
    right bytes after both clients closed and a collection, and the pool goes with the last of them."""
    code = """
import numpy as np
a, b = Client(rt, inline_threshold=0), Client(rt, inline_threshold=0, readonly=True)
d = a.put(torch.arange(100_000, dtype=torch.float32))
v = b.get(d)
arr = v.numpy()
views = [v.as_strided((10,), (3,), v.storage_offset() + 99_972), arr, torch.frombuffer(arr, dtype=torch.float32),
         torch.utils.dlpack.from_dlpack(torch.utils.dlpack.to_dlpack(v)), np.from_dlpack(v),
         torch.empty(0).set_(v.untyped_storage(), v.storage_offset(), v.shape, v.stride()), memoryview(arr)]
b.ack(d)
a.close()
b.close()
del a, b, v, arr, d
assert mapped(collect=True) == 1
for x in views:
    assert float(x[-1]) == 99_999.0, type(x)
del x
while views:
    assert mapped(collect=True) == 1, f"unmapped while a {type(views[-1])} views it"
    views.pop()
assert mapped(collect=True) == 0
print("ok")
"""
    assert run_child(code, str(daemon.runtime_dir)).strip() == "ok"
    daemon.wait_for(lambda s: s["pools"][0]["used"] == 0, what="the feature to be freed")


def test_parcel_values_outlive_their_clients_and_their_acks_land_from_the_finaliser(daemon) -> None:
    """``loads(data).value`` kept after the Parcel and both clients are gone reads the right bytes;
    dropping it acks through the closed client's lease table, and unmaps the pool."""
    code = """
from mmfeat.client import dumps, loads
a, b = Client(rt, inline_threshold=0), Client(rt, inline_threshold=0)
value = loads(dumps({"px": torch.arange(50_000, dtype=torch.float32)}, client=a), client=b).value
a.close()
b.close()
del a, b
assert mapped(collect=True) == 1 and float(value["px"][-1]) == 49_999.0
import warnings
with warnings.catch_warnings():
    warnings.simplefilter("ignore", ResourceWarning)  # collected without ack(): acked now, as intended
    del value
    assert mapped(collect=True) == 0
print("ok")
"""
    assert run_child(code, str(daemon.runtime_dir)).strip() == "ok"
    daemon.wait_for(lambda s: s["pools"][0]["used"] == 0, what="the finaliser's ack to free the feature")


def test_views_of_a_restarted_daemons_pool_keep_their_bytes_beside_the_new_pool(daemon_factory) -> None:
    """A daemon restart gives a new epoch and a new pool: the client maps it, the views of the old pool
    keep reading its bytes (its pages live while they map them), and it goes with the last of them."""
    first = daemon_factory("--pool-mb", "16")
    child = subprocess.Popen([sys.executable, "-c", PROLOGUE + """
c = Client(rt, inline_threshold=0)
d = c.put(torch.full((50_000,), 3.0))
old = c.get(d)
c.ack(d)
print("ready", flush=True)
assert sys.stdin.readline().strip() == "restarted"
d = c.put(torch.full((50_000,), 5.0))
new = c.get(d)
assert mapped(collect=True) == 2, "the old pool and the new"
assert torch.equal(old, torch.full((50_000,), 3.0)) and torch.equal(new, torch.full((50_000,), 5.0))
c.ack(d)
del old
assert mapped(collect=True) == 1, "only the new pool"
del new
c.close()
assert mapped(collect=True) == 0
print("ok", flush=True)
""", str(first.runtime_dir)], stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    try:
        assert child.stdout.readline().strip() == "ready", child.stderr.read() if child.poll() is not None else ""
        assert first.stop() == 0
        second = daemon_factory("--pool-mb", "16")
        child.stdin.write("restarted\n")
        child.stdin.flush()
        out, err = child.communicate(timeout=300)
        assert child.returncode == 0 and out.strip() == "ok", err[-4000:]
    finally:
        if child.poll() is None:
            child.kill()
            child.wait()
    second.wait_for(lambda s: s["pools"][0]["used"] == 0, what="the feature to be freed")


def test_two_daemons_pools_are_mapped_and_unmapped_apart(daemon, tmp_path_factory) -> None:
    """Clients of two daemons in one process: closing one client and dropping its views unmaps its
    daemon's pool only; the other's views and client go on working."""
    from .conftest import start_daemon

    runtime = tmp_path_factory.mktemp("second", numbered=True)
    other = start_daemon(runtime, "--pool-mb", "16")
    try:
        code = """
a, b = Client(sys.argv[1], inline_threshold=0), Client(sys.argv[2], inline_threshold=0)
da, db = a.put(torch.full((50_000,), 1.0)), b.put(torch.full((50_000,), 2.0))
va, vb = a.get(da), b.get(db)
assert mapped(collect=True) == 2
a.ack(da)
a.close()
assert float(va.sum()) == 50_000.0
del va
assert mapped(collect=True) == 1, "the first daemon's pool goes; the second's stays"
assert float(vb.sum()) == 100_000.0
b.ack(db)
d = b.put(torch.full((50_000,), 4.0))
assert float(b.get(d).sum()) == 200_000.0
b.ack(d)
del vb
b.close()
assert mapped(collect=True) == 0
print("ok")
"""
        assert run_child(code, str(daemon.runtime_dir), str(runtime)).strip() == "ok"
        daemon.wait_for(lambda s: s["pools"][0]["used"] == 0, what="the first daemon's feature to be freed")
        other.wait_for(lambda s: s["pools"][0]["used"] == 0, what="the second daemon's features to be freed")
    finally:
        assert other.stop() == 0


def test_a_forked_child_reads_its_parents_views_and_uses_the_pool_on_its_own(daemon) -> None:
    """A child forked while its parent holds views and an open client reads those views, closes its
    copy of the client without touching the parent's session, and puts and gets through a session of
    its own; the parent's client goes on working, and its closed pool is unmapped with its views."""
    code = """
torch.set_num_threads(1)  # torch's own thread pool does not survive a fork (a parallel sum would hang)
c = Client(rt, inline_threshold=0)
d = c.put(torch.full((50_000,), 6.0))
v = c.get(d)
pid = os.fork()
if pid == 0:
    ok = float(v.sum()) == 300_000.0
    try:
        mine = c.put(torch.full((50_000,), 8.0))  # the child's own session
        ok = ok and float(c.get(mine).sum()) == 400_000.0
        c.ack(mine)
        c.close()
    except BaseException as exc:
        print("child:", repr(exc), file=sys.stderr, flush=True)
        ok = False
    os._exit(0 if ok else 1)
_, status = os.waitpid(pid, 0)
assert status == 0, f"child status {status}"
assert float(v.sum()) == 300_000.0
c.ack(d)  # v must not be read from here on: its space may be reused
d = c.put(torch.full((50_000,), 9.0))
assert float(c.get(d).sum()) == 450_000.0
c.ack(d)
c.close()
assert mapped(collect=True) == 1, "v still views the pool"
del v
assert mapped(collect=True) == 0
print("ok")
"""
    assert run_child(code, str(daemon.runtime_dir)).strip() == "ok"
    daemon.wait_for(lambda s: s["pools"][0]["used"] == 0 and s["sessions"] == 0, timeout=15,
                    what="every feature and session to end")


# A thread of the parent is inside a call to a stopped daemon (holding the client's locks) when the
# parent forks; the child then uses the client it inherited, once the daemon runs again.
FORK_DURING_CALL = """
torch.set_num_threads(1)  # torch's own thread pool does not survive a fork
c = Client(rt, inline_threshold=0, timeout=5)
print("ready", flush=True)
assert sys.stdin.readline().strip() == "stopped"
def connect():
    try:
        c.connect()
    except Exception:
        pass
caller = threading.Thread(target=connect, daemon=True)
caller.start()
deadline = time.monotonic() + 60  # until it waits for the hello's reply, inside the client's locks
while not (c._connect_lock.locked() and c._channel._lock.locked()) and time.monotonic() < deadline:
    time.sleep(0.01)
r, w = os.pipe()
pid = os.fork()
if pid == 0:
    os.read(r, 1)  # the daemon runs again
    try:
        d = c.put(torch.full((50_000,), 3.0))
        ok = not d.is_inline and float(c.get(d).sum()) == 150_000.0
        c.ack(d)
        c.close()
    except BaseException as exc:
        print("child:", repr(exc), file=sys.stderr, flush=True)
        ok = False
    os._exit(0 if ok else 1)
print("forked", flush=True)
assert sys.stdin.readline().strip() == "continued"
os.write(w, b"x")
status = reap(pid, "the forked child hung on a lock its parent's thread held at the fork")
assert status == 0, f"child status {status}"
caller.join(30)
c.close()
print("ok", flush=True)
"""


def test_a_child_forked_during_a_call_in_another_thread_can_use_the_client(daemon) -> None:
    """A fork copies the locks of the client as they are: a thread of the parent that waits in a call
    (here the hello of connect(), to a daemon that does not answer yet) holds the control channel's
    lock and the connect lock in the child for good, and the child's first call would wait forever.
    The child takes them fresh, and its put, get and ack go through a session of its own."""
    import signal

    child = subprocess.Popen([sys.executable, "-c", PROLOGUE + FORK_DURING_CALL, str(daemon.runtime_dir)],
                             stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    stopped = False
    try:
        assert child.stdout.readline().strip() == "ready", child.stderr.read() if child.poll() is not None else ""
        os.kill(daemon.pid, signal.SIGSTOP)
        stopped = True
        child.stdin.write("stopped\n")
        child.stdin.flush()
        assert child.stdout.readline().strip() == "forked", child.stderr.read() if child.poll() is not None else ""
        os.kill(daemon.pid, signal.SIGCONT)
        stopped = False
        child.stdin.write("continued\n")
        child.stdin.flush()
        out, err = child.communicate(timeout=300)
        assert child.returncode == 0 and out.strip() == "ok", err[-4000:]
    finally:
        if stopped:
            os.kill(daemon.pid, signal.SIGCONT)
        if child.poll() is None:
            child.kill()
            child.wait()
    daemon.wait_for(lambda s: s["pools"][0]["used"] == 0 and s["sessions"] == 0, timeout=15,
                    what="every feature and session to end")


def test_a_child_forked_while_its_parent_maps_a_pool_and_table_maps_its_own(daemon) -> None:
    """A thread of the parent inside map_host_pool or map_lease_table at the fork (the pool's
    MAP_POPULATE can take a while) holds their locks; here a thread holds both across the fork. The
    child's own session maps them all the same, instead of waiting forever."""
    code = """
from mmfeat.client.link import lease_table, mapping

def put_get_ack():
    with Client(rt, inline_threshold=0) as c:
        d = c.put(torch.full((50_000,), 3.0))
        assert not d.is_inline and float(c.get(d).sum()) == 150_000.0
        c.ack(d)

pid = fork_holding([mapping._lock, lease_table._lock], put_get_ack)
status = reap(pid, "the forked child hung on a mapping lock its parent's thread held at the fork")
assert status == 0, f"child status {status}"
print("ok")
"""
    assert run_child(code, str(daemon.runtime_dir)).strip() == "ok"
    daemon.wait_for(lambda s: s["pools"][0]["used"] == 0 and s["sessions"] == 0, timeout=15,
                    what="every feature and session to end")
