"""A forked child never waits for a lock that a thread of its parent held at the fork.

A fork copies each lock as it is; one held by a parent thread at that moment stays held in the child,
where no thread will release it. Each check here has a parent thread hold one lock across a fork, and
the child call what takes it: the child must finish within reap()'s bounded wait. Checks whose public
call needs a GPU (a staged get, ack after a CUDA event) call the function that takes the lock."""

from __future__ import annotations

from .test_mapping_lifetime import run_child

# ``check(name, lock, call)``: a thread holds ``lock`` (read before the fork, as the child inherits it)
# across a fork; the forked child runs ``call``. ``hung`` and ``failed`` collect the names of checks
# whose child did not finish, or raised; the script prints both at the end.
CHECKS = """
hung, failed = [], []

def check(name, lock, call):
    pid = fork_holding([lock], call, name)
    try:
        status = reap(pid, name)
    except AssertionError:
        hung.append(name)
        return
    if status != 0:
        failed.append(name)

def pooled(c, value):
    d = c.put(torch.full((50_000,), float(value)))
    assert not d.is_inline and float(c.get(d)[-1]) == value
    c.ack(d)
"""


def _run(daemon, code: str) -> None:
    out = run_child(CHECKS + code + "\nprint('hung:', hung, 'failed:', failed)\n", str(daemon.runtime_dir),
                    timeout=600)
    assert out.strip().splitlines()[-1] == "hung: [] failed: []", out


def test_a_forked_child_uses_the_client_it_inherited_whatever_lock_a_parent_thread_held(daemon) -> None:
    """The locks of the objects a Client keeps across sessions (acks remembered, pipelined failures,
    fallbacks, reservations, staged copies, the background acker, a Parcel's lease) and of its session's
    arenas: the child's put, get, ack, reserve, publish, Parcel ack and close each finish."""
    code = """
from mmfeat.client import dumps, loads
c = Client(rt)
pooled(c, 1)
check("acked leases: ack", c._acks._acked._lock, lambda: pooled(c, 2))
check("async failures: close", c._channel.failures._lock, c.close)
check("fallbacks: a put below inline_threshold", c._fallbacks._lock, lambda: c.put(torch.zeros(4)))

def reserve_and_publish():
    t = c.reserve((50_000,), torch.float32)
    t.fill_(3.0)
    d = c.publish(t)
    assert float(c.get(d)[-1]) == 3.0
    c.ack(d)

check("reservations: reserve and publish", c._reservations._lock, reserve_and_publish)
pending = c._acks._pending
pending._events[("elsewhere", 0, 0, 0)] = None  # as a staged get leaves until its ack
check("staged copies: ack", pending._lock, lambda: pooled(c, 4))
del pending._events[("elsewhere", 0, 0, 0)]
c._acks._background()  # the acker thread, as ack(after=) or a finaliser's ack starts it
check("background acker: close", c._acks._acker._cond, c.close)
p = loads(dumps({"x": torch.full((50_000,), 5.0)}, client=c), client=c)
check("parcel lease: ack", p._lease._lock, p.ack)
p.ack()
check("arenas' stop event: close", c.session.arenas._stop._cond, c.close)
c.close()
"""
    _run(daemon, code)
    daemon.wait_for(lambda s: s["pools"][0]["used"] == 0 and s["sessions"] == 0, timeout=15,
                    what="every feature and session to end")


def test_a_forked_child_takes_the_module_locks_a_parent_thread_held(daemon) -> None:
    """The module-level locks of the client and the CUDA driver wrapper: the default Client of dumps and
    loads, the DLPack wrapper of every pool view that outlives its Parcel, the pinning of host pools, the
    side streams of acks after a CUDA event, and the driver's initialisation."""
    code = """
from mmfeat import cuda_driver
from mmfeat.client import dumps, loads, parcel
from mmfeat.client.consume import ack_routes, pinned
from mmfeat.client.gpu import dlpack, gpu_order
from mmfeat.client.link.mapping import HostMapping
os.environ["MMFEAT_RUNTIME_DIR"] = rt
c = Client(rt)
check("parcel: dumps with the default client", parcel._default_lock, lambda: dumps({"x": torch.zeros(4)}))

def parcel_views():
    with loads(dumps({"x": torch.full((50_000,), 6.0)}, client=c), client=c) as value:
        assert float(value["x"][-1]) == 6.0

check("dlpack: loads", dlpack._Guard.lock, parcel_views)
host = HostMapping(0, 1, 4096, torch.zeros(4096, dtype=torch.uint8))
check("pinned: a staged get's pinning", pinned._lock, lambda: pinned.pinned_view(host, 0))

def side_stream():
    try:
        gpu_order._side_stream(0)
    except Exception:
        pass  # no CUDA here: the call got past the lock, which is what is checked

check("GPU order: side streams and contexts", gpu_order._lock, side_stream)
check("cuda driver: initialisation", cuda_driver._init_lock, cuda_driver.driver_unavailable_reason)
c.close()
"""
    _run(daemon, code)
    daemon.wait_for(lambda s: s["pools"][0]["used"] == 0 and s["sessions"] == 0, timeout=15,
                    what="every feature and session to end")


def test_a_forked_child_leaves_its_parents_open_reservations_to_the_parent(daemon) -> None:
    """An arena reservation the parent holds open belongs to the parent's session, whose arenas only the
    parent's threads use: the child's close(), discard and publish of it must not take that session's
    arena lock (a parent thread placing a feature holds it), and the parent still publishes it after the
    child is gone."""
    code = """
c = Client(rt)
pooled(c, 1)
for end in ("close", "discard", "publish"):
    t = c.reserve((50_000,), torch.float32)
    t.fill_(7.0)

    def child_ends_it():
        if end == "close":
            c.close()
            return
        if end == "discard":
            c.discard(t)
        else:  # the child's own copy of the bytes, as after a daemon restart
            d = c.publish(t)
            assert float(c.get(d)[-1]) == 7.0
            c.ack(d)
        c.close()

    check("the parent's reservation: child " + end, c.session.arenas._lock, child_ends_it)
    d = c.publish(t)
    assert not d.is_inline and float(c.get(d)[-1]) == 7.0
    c.ack(d)
    del t
c.close()
"""
    _run(daemon, code)
    daemon.wait_for(lambda s: s["pools"][0]["used"] == 0 and s["sessions"] == 0, timeout=15,
                    what="every feature and session to end")
