"""Views into the pool carry no autograd history and no inference flag, whatever mode the caller of
put, get, reserve, dumps or loads is in: the typed views of the pool are shared by every later call of
the process, so a mode that reached one reached them all."""

from __future__ import annotations

import torch

from mmfeat.client import dumps, loads
from mmfeat.client import tensors as tz

from . import mode_workers as w
from .conftest import fan_out


def _pool(c) -> torch.Tensor:
    """The tensor over the client's host pool, which every view of it is made from."""
    return next(m for (pool, device), m in c.session.mappings.items() if device == -1).tensor


def _typed_views(c) -> list[torch.Tensor]:
    """The cached typed views of the client's host pool."""
    return [typed for typed, _ in tz._typed_views(_pool(c)).values()]


def _assert_plain(t: torch.Tensor, what: str) -> None:
    assert not t.is_inference(), f"{what} is an inference tensor"
    assert not t.requires_grad and t.grad_fn is None, f"{what} carries autograd history ({t.grad_fn})"


def test_a_get_under_inference_mode_leaves_the_later_puts_and_views_of_the_process_plain(daemon) -> None:
    """A server runs its model under inference_mode, and its first get there made the pool's mapping
    and its typed view inference tensors: the process's next put of a non-contiguous tensor raised an
    untyped RuntimeError (an in-place update of an inference tensor), and every later view was one.
    Every path is tried: put, get, copy=True, put_many, reserve and publish, dumps and loads."""
    with daemon.client(inline_threshold=1024, fallback="error") as c:
        with torch.inference_mode():
            first = c.put(w.expected(0))  # opens the session and maps the pool in inference mode
            view = c.get(first)
            assert torch.equal(view, w.expected(0)) and torch.equal(view * 2, w.expected(0) * 2)
            assert torch.equal(c.get(first, copy=True), w.expected(0))
            many = c.put_many([w.expected(1), torch.arange(40_000)])
            reserved = c.reserve((256, 256), torch.float32)
            blob = dumps({"x": w.expected(2)}, client=c)
            held = loads(blob, client=c)
        _assert_plain(view, "a view made in inference mode")
        c.ack(first)
        desc = c.put(w.expected(3))  # non-contiguous: copied through the typed view the get made
        got = c.get(desc)
        _assert_plain(got, "a later view")
        assert torch.equal(torch.from_numpy(got.numpy()), w.expected(3))
        assert torch.equal(c.get(desc, copy=True), w.expected(3))
        c.ack(desc)
        for k, t in enumerate(c.get(many)):
            _assert_plain(t, f"put_many's tensor {k}")
        assert torch.equal(c.get(many)[0], w.expected(1)) and torch.equal(c.get(many)[1], torch.arange(40_000))
        c.ack(many)
        _assert_plain(reserved, "a tensor reserved in inference mode")
        reserved.copy_(w.expected(4))  # filled outside inference mode, as a later step of the server would
        desc = c.publish(reserved)
        assert torch.equal(c.get(desc), w.expected(4))
        c.ack(desc)
        _assert_plain(held.value["x"], "a tensor loads gave in inference mode")
        assert torch.equal(held.value["x"], w.expected(2))
        held.ack()
        with loads(dumps({"x": w.expected(5)}, client=c), client=c) as obj:
            _assert_plain(obj["x"], "a tensor loads gave")
            assert torch.equal(obj["x"], w.expected(5))
        _assert_plain(_pool(c), "the pool's mapping, made in inference mode,")
        for typed in _typed_views(c):
            _assert_plain(typed, "the pool's typed view")
        c.flush()
    daemon.wait_for(lambda s: s["leases"] == {"RESERVED": 0, "PUBLISHED": 0}, what="the features to end")


def test_puts_of_tensors_that_require_grad_give_the_pool_no_graph(daemon) -> None:
    """The copy of a non-contiguous tensor that requires grad was recorded on the shared typed view of
    the pool: every later view of that dtype required grad (numpy() refused it), and the graph grew by
    a node a put and was never freed. Fifty puts, then put_many and a reservation filled from one."""
    with daemon.client(inline_threshold=1024, fallback="error") as c, daemon.client(readonly=True) as consumer:
        for seed in range(50):
            src = w.expected(seed, requires_grad=True)
            desc = c.put(src)
            for who in (c, consumer):
                got = who.get(desc)
                _assert_plain(got, f"the view of put {seed}")
                assert torch.equal(got, src.detach())
            got.numpy()
            consumer.ack(desc)
        many = c.put_many([w.expected(50, requires_grad=True), torch.ones(10_000, dtype=torch.float64,
                                                                            requires_grad=True)])
        for k, t in enumerate(consumer.get(many)):
            _assert_plain(t, f"put_many's tensor {k}")
        assert torch.equal(consumer.get(many)[0], w.expected(50))
        consumer.ack(many)
        reserved = c.reserve((256, 256), torch.float32)
        reserved.copy_(w.expected(51, requires_grad=True))  # the reservation's own graph, not the pool's
        desc = c.publish(reserved)
        _assert_plain(c.get(desc), "the view of a published reservation")
        assert torch.equal(consumer.get(desc, copy=True), w.expected(51))
        consumer.ack(desc)
        for who in (c, consumer):
            for typed in _typed_views(who):
                _assert_plain(typed, "the pool's typed view")
        consumer.flush()
    daemon.wait_for(lambda s: s["leases"] == {"RESERVED": 0, "PUBLISHED": 0}, what="the features to end")


def test_a_view_written_with_a_requires_grad_operand_does_not_pass_its_graph_on(daemon) -> None:
    """A consumer that writes into its view (against the contract) with an operand that requires grad
    gives the typed view under it a graph: the next view of that dtype starts from a clean one rather
    than inheriting it."""
    with daemon.client(inline_threshold=1024, fallback="error") as c:
        desc = c.put(torch.ones(65536))
        c.get(desc).mul_(torch.ones(65536, requires_grad=True))  # the same bytes, and a graph
        later = c.put(torch.full((65536,), 3.0))
        got = c.get(later)
        _assert_plain(got, "the next view")
        assert torch.equal(got, torch.full((65536,), 3.0))
        c.ack(desc)
        c.ack(later)


def test_a_consumer_in_inference_mode_reads_a_grad_producers_features_byte_for_byte(daemon, children) -> None:
    """A producer whose tensors require grad and a consumer that gets under inference_mode, each in a
    process of its own, beside an honest consumer: every byte arrives, and the inference-mode
    consumer's own later put and view still work outside that mode."""
    n = 20
    q_prod, results = children.Queue(), children.Queue()
    q_cons = [children.Queue(), children.Queue()]
    procs = [children.Process(target=w.consume, args=(str(daemon.runtime_dir), q, results, inference))
             for q, inference in zip(q_cons, (True, False))]
    procs.append(children.Process(target=w.produce_with_grad, args=(str(daemon.runtime_dir), n, len(q_cons), q_prod)))
    for p in procs:
        p.start()
    fan_out(q_prod, q_cons)
    out = [results.get(timeout=90) for _ in q_cons]
    for p in procs:
        p.join(30)
        assert p.exitcode == 0, f"{p.name} exited {p.exitcode}"
    assert out == [("ok", n), ("ok", n)], out
