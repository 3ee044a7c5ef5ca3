"""Every view of an inline feature is aligned as torch's allocator aligns (64 bytes), whatever buffer
the descriptor arrived in; a readonly Client's inline views fault on a write, as its pool views do; and
no mutation of a descriptor's bytes gets a consumer anything but a typed error or a correct read. The
consumers run in processes of their own: a SIGSEGV fails the test, not the pytest worker."""

from __future__ import annotations

import mmap
import os
import signal

import torch

from mmfeat.client.consume import inline_base


from . import inline_workers as iw
from .chaos import descriptor_fuzz as fz

BIG = 1 << 62  # an inline_threshold no feature reaches: every put goes inline


def _join(children, target, args, timeout: float = 180.0) -> list:
    results = children.SimpleQueue()  # written at once: a Queue's feeder thread dies with its process
    p = children.Process(target=target, args=(*args, results))
    p.start()
    p.join(timeout)
    if p.is_alive():
        p.kill()
        p.join()
    out = []
    while not results.empty():
        out.append(results.get())
    return [p.exitcode, *out]


def test_every_view_of_small_honest_inline_features_is_64_byte_aligned_in_another_process(daemon, children) -> None:
    items = []
    with daemon.client(inline_threshold=BIG) as c:
        for dtype in iw.DTYPES:
            for n in iw.SIZES:
                desc = c.put(iw.honest(dtype, n))
                blob = desc.to_bytes()
                assert desc.is_inline and (len(blob) - desc.nbytes) % 64 == 0
                items.append((blob, [(dtype, n)]))
        for k in range(len(iw.SIZES)):  # put_many: every tensor of the payload starts aligned too
            cases = [(iw.DTYPES[(k + j) % len(iw.DTYPES)], iw.SIZES[(k * 3 + j) % len(iw.SIZES)]) for j in range(4)]
            desc = c.put_many([iw.honest(d, n) for d, n in cases])
            assert desc.is_inline and all(s.offset % 64 == 0 for s in desc.tensors)
            items.append((desc.to_bytes(), cases))
    exitcode, *results = _join(children, iw.read_aligned, (str(daemon.runtime_dir), items))
    assert exitcode == 0, f"the consumer died with exit {exitcode} (-11: SIGSEGV): {results}"
    views = sum(len(cases) for _, cases in items) * 3
    assert results == [("ok", views)], results


def test_mutated_inline_and_pool_descriptors_get_a_typed_error_or_a_correct_read(daemon, children) -> None:
    with daemon.client(inline_threshold=BIG) as inline, daemon.client(inline_threshold=0, fallback="error") as pool:
        blobs = [inline.put(iw.honest("complex128", 100)).to_bytes(),
                 inline.put(iw.honest("bfloat16", 7)).to_bytes(),
                 inline.put_many([iw.honest("float16", 33), iw.honest("complex64", 5)]).to_bytes(),
                 inline.put(torch.arange(20_000, dtype=torch.int16)).to_bytes()]  # a bin 16 length field
        pool_descs = [pool.put(torch.arange(2000, dtype=torch.float64), consumers=1),
                      pool.put_many([torch.ones(3, dtype=torch.complex128), torch.ones(5)], consumers=1)]
        blobs += [d.to_bytes() for d in pool_descs]
        count = 600
        at = children.Value("q", -1)
        exitcode, *results = _join(children, fz.fuzz_worker, (str(daemon.runtime_dir), blobs, 11, count, at))
        crashed = fz.mutant(blobs, 11, count, at.value).hex() if exitcode != 0 else ""
        assert exitcode == 0, f"the consumer died with exit {exitcode} on mutant {at.value}: {crashed} {results}"
        assert len(results) == 1 and results[0][0] == "ok", results
        tally = results[0][1]
        assert tally["read"] >= len(blobs) and tally["refused"] > count, tally  # both verdicts were met
        for d in pool_descs:
            pool.ack(d)
        assert pool.flush(10)


def test_an_inline_view_of_a_readonly_client_faults_on_a_write_and_the_bytes_stay(daemon, children,
                                                                                  tmp_path) -> None:
    with daemon.client(inline_threshold=BIG) as c:
        desc = c.put(torch.full((64, 16), 255.0))  # 4 KiB: inline
        assert desc.is_inline
        blob = desc.to_bytes()
    shared = tmp_path / "received"  # a buffer two consumers read: one maps it and writes its view
    shared.write_bytes(blob)
    for source in ("", str(shared)):
        exitcode, *results = _join(children, iw.write_inline_in_place, (str(daemon.runtime_dir), blob, source, True))
        assert results[:1] == [("read", 255.0, 0)], results  # it had an aligned view before it wrote
        assert exitcode == -signal.SIGSEGV, f"the write in place did not fault: exit {exitcode}, {results}"
    assert shared.read_bytes() == blob  # what a second consumer of that buffer reads
    with open(shared, "rb") as f:
        pages = mmap.mmap(f.fileno(), 0, prot=mmap.PROT_READ)
    with daemon.client(readonly=True) as second:
        assert float(second.get(memoryview(pages)).min()) == 255.0
        private = second.get(blob, copy=True)  # a private copy is writable, and aligned
        private /= 255
        assert float(private.max()) == 1.0 and private.data_ptr() % 64 == 0
        assert float(second.get(blob).max()) == 255.0


def test_a_client_that_is_not_readonly_views_an_aligned_inline_payload_in_place(daemon, children) -> None:
    expect = iw.honest("complex128", 1000)
    with daemon.client(inline_threshold=BIG) as c:
        desc = c.put(expect)
        blob = desc.to_bytes()
        pages = mmap.mmap(-1, len(blob))  # a receive buffer that starts on a page
        pages[:] = blob
        start = torch.frombuffer(pages, dtype=torch.uint8).data_ptr()
        got = c.get(memoryview(pages).toreadonly())
        assert got.data_ptr() == start + len(blob) - desc.nbytes  # in place: no copy
        assert torch.equal(got, expect) and torch.equal(got.abs(), expect.abs())
        c.ack(blob)
        blob = c.put(torch.full((64, 16), 255.0)).to_bytes()
    # Its views are the received bytes (or their aligned copy): written in place, the write goes through.
    exitcode, *results = _join(children, iw.write_inline_in_place, (str(daemon.runtime_dir), blob, "", False))
    assert exitcode == 0 and results == [("read", 255.0, 0), ("wrote", 1.0)], (exitcode, results)


def test_read_only_copies_keep_their_bytes_while_their_pages_are_carved_again() -> None:
    """A readonly Client's inline copies share chunks of read-only pages, carved again once no tensor
    reads them: a view still held keeps its bytes however many copies come after it."""
    held = []
    for k in range(6000):
        t = inline_base.read_only_copy(memoryview(bytes([k % 251]) * 1000), 1000)
        assert t.data_ptr() % 64 == 0
        if k % 1000 == 0:
            held.append((k, t))
    for k, t in held:
        assert bytes(t.numpy()) == bytes([k % 251]) * 1000, k
    assert len(inline_base._retired) <= inline_base._RETIRED


def test_a_forked_child_keeps_the_bytes_of_the_read_only_copies_it_inherited() -> None:
    """The chunks are shared memory: the parent must not carve again, after a fork, pages whose tensors
    the child inherited, even once the parent's own tensors are gone."""
    views = [inline_base.read_only_copy(memoryview(bytes([7]) * 1000), 1000) for _ in range(2000)]
    r, w = os.pipe()
    pid = os.fork()
    if pid == 0:  # waits until the parent has carved again, then reads what it inherited
        os.close(w)
        os.read(r, 1)
        os._exit(0 if all(bytes(v.numpy()) == bytes([7]) * 1000 for v in views) else 3)
    os.close(r)
    views.clear()
    for _ in range(5000):
        inline_base.read_only_copy(memoryview(bytes([9]) * 1000), 1000)
    os.write(w, b"x")
    os.close(w)
    assert os.waitpid(pid, 0)[1] == 0, "the child's inherited views changed under it"
