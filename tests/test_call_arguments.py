"""The public client calls refuse bad arguments before anything is attempted, with ValueError or
TypeError, so that nothing is lost and a corrected call still works."""

from __future__ import annotations

import pytest
import torch

from mmfeat.client import dumps, loads

_BAD_COUNTS = (2.0, True, 0, 4097, "2", None)


def _features_end(daemon) -> None:
    daemon.wait_for(lambda s: s["leases"] == {"RESERVED": 0, "PUBLISHED": 0}
                    and s["pools"][0]["bytes"]["PUBLISHED"] == 0, what="the features to end")


def test_an_ack_with_a_count_that_is_not_an_int_is_refused_and_a_corrected_one_frees_the_feature(daemon) -> None:
    """A float count reached the lease table's compare-and-swap and raised ctypes.ArgumentError there;
    now every bad count, ``after`` and ``wait`` is refused first, on the table's path and the message's
    alike, and the feature is still freed by a corrected ack."""
    with daemon.client(inline_threshold=1024) as c, daemon.client(readonly=True) as consumer:
        for wait in (False, True):
            desc = c.put(torch.ones(65536), consumers=2)
            consumer.get(desc)
            for bad in _BAD_COUNTS:
                with pytest.raises(ValueError, match="count must be an int between 1 and 4096"):
                    consumer.ack(desc, count=bad, wait=wait)
            with pytest.raises(TypeError, match="after must be"):
                consumer.ack(desc, count=2, after="the default stream", wait=wait)
            with pytest.raises(TypeError, match="wait must be True or False"):
                consumer.ack(desc, count=2, wait=int(wait))
            consumer.ack(desc, count=2, wait=wait)
            consumer.flush()
            _features_end(daemon)
        inline = c.put(torch.ones(10))
        with pytest.raises(ValueError, match="count must be an int"):
            consumer.ack(inline, count=1.0)


def test_a_parcel_ack_with_a_float_count_leaves_it_to_ack_again(daemon) -> None:
    """Parcel.ack took the ArgumentError a float count raised for the daemon's verdict and marked itself
    acked: neither a corrected ack nor its finaliser acked again, and the feature stayed until ack_ttl."""
    with daemon.client(inline_threshold=1024) as c, daemon.client() as consumer:
        parcel = loads(dumps({"x": torch.ones(65536)}, consumers=2, client=c), client=consumer)
        for bad in _BAD_COUNTS:
            with pytest.raises(ValueError, match="count must be an int"):
                parcel.ack(count=bad)
        assert not parcel.acked
        parcel.ack(count=2)
        assert parcel.acked and consumer.flush()
        _features_end(daemon)


def test_get_flush_and_put_many_refuse_arguments_of_the_wrong_kind(daemon) -> None:
    """get's ``copy``, ``verify`` and ``device``, flush's ``timeout`` and put_many's list are checked
    before anything is made: a tensor given to put_many was put row by row, and a device that names
    none failed with torch's untyped error from the middle of the copy."""
    with daemon.client(inline_threshold=1024) as c:
        desc = c.put(torch.ones(65536))
        for kwargs in ({"copy": 1}, {"verify": None}, {"copy": "yes"}):
            with pytest.raises(TypeError, match="copy and verify must be True or False"):
                c.get(desc, **kwargs)
        with pytest.raises(ValueError, match="device must be"):
            c.get(desc, device="no such device")
        for bad in (-1, float("nan"), float("inf"), "1", True):
            with pytest.raises(ValueError, match="timeout must be"):
                c.flush(bad)
        with pytest.raises(TypeError, match="put_many takes a list of tensors"):
            c.put_many(torch.ones(3, 65536))
        assert torch.equal(c.get(desc, copy=True), torch.ones(65536))
        c.ack(desc)
        assert c.flush(5)
    _features_end(daemon)
