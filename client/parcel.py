"""Pickled objects whose tensors travel through the pool, for servers that already pickle their requests
between processes (SGLang's ``send_pyobj``/``recv_pyobj``, vLLM's engine-core messages,
``multiprocessing`` queues): replace ``pickle.dumps`` with ``dumps`` and ``pickle.loads`` with
``loads``, and ack the result once its tensors are used.

The bytes hold the pickle (protocol 5) of the object with every large tensor replaced by its index,
and one descriptor for all those tensors, placed in one feature as ``put_many`` does. They never hold
pool memory. ``loads`` unpickles, as ``pickle.loads`` does: use it only on messages from your own
processes.
"""

from __future__ import annotations

import atexit
import io
import os
import pickle
import threading
import warnings
import weakref
from typing import Any, Optional

import msgpack
import torch

from mmfeat.protos.descriptor import Descriptor, DescriptorError
from mmfeat.protos.errors import ErrorCode, MmfeatError
from mmfeat.protos.tensor_spec import MAX_TENSORS

from .gpu import dlpack, gpu_order
from .client import Client
from .fork_locks import renew_in_child

FORMAT = 1

_default: Optional[Client] = None
_default_pid = 0
_default_lock = threading.Lock()
_warned_unacked = False


def _new_lock_in_child() -> None:
    # A thread of the parent making the default Client at the fork holds the lock in the child for good,
    # and the child's first dumps or loads without client= would wait for it.
    global _default_lock
    _default_lock = threading.Lock()


os.register_at_fork(after_in_child=_new_lock_in_child)


def forget_warned() -> None:
    """Warn again about the next Parcel collected without an ack, as if this process had not yet."""
    global _warned_unacked
    _warned_unacked = False


def default_client() -> Client:
    """The process's shared Client for ``dumps`` and ``loads`` without ``client=`` (one per process,
    a new one after fork)."""
    global _default, _default_pid
    with _default_lock:
        if _default is None or _default_pid != os.getpid():
            _default, _default_pid = Client(), os.getpid()
        return _default


def dumps(obj: Any, *, consumers: int = 1, client: Optional[Client] = None) -> bytes:
    """``obj`` pickled, with every plain tensor of at least ``client.inline_threshold`` bytes placed in
    the pool for ``consumers`` consumers (one feature for all of them); smaller tensors are pickled as
    usual. CUDA tensors go to the GPU pool of their device."""
    client = client or default_client()
    pooled: list[torch.Tensor] = []
    threshold = max(1, client.inline_threshold)

    buf = io.BytesIO()
    _Pickler(buf, pooled, threshold).dump(obj)
    if len(pooled) > MAX_TENSORS:
        raise ValueError(f"dumps places the tensors of at least inline_threshold ({threshold} B) of an object in one "
                         f"feature, which holds at most {MAX_TENSORS}, and this object has {len(pooled)}: split it "
                         "over several dumps")
    desc = client.put_many(pooled, consumers=consumers).to_bytes() if pooled else None
    return msgpack.packb([FORMAT, desc, buf.getvalue()], use_bin_type=True)


def loads(data: bytes, *, client: Optional[Client] = None, device: Any = None) -> "Parcel":
    """The object ``dumps`` pickled, in a Parcel: its tensors are zero-copy views into the pool until
    the Parcel is acked. With ``device`` (a CUDA device) they are private copies on that device instead,
    and the Parcel is acked at once."""
    try:
        fmt, desc_bytes, payload = msgpack.unpackb(data, raw=False)
    except Exception as exc:
        raise MmfeatError(ErrorCode.BAD_REQUEST, f"not bytes from mmfeat.client.dumps: {type(exc).__name__}") from None
    if fmt != FORMAT or not isinstance(payload, bytes) or not (desc_bytes is None or isinstance(desc_bytes, bytes)):
        raise MmfeatError(ErrorCode.BAD_REQUEST, f"not bytes from mmfeat.client.dumps (format {fmt!r})")
    client = client or default_client()
    desc: Optional[Descriptor] = None
    tensors: list[torch.Tensor] = []
    if desc_bytes is not None:
        try:
            desc = Descriptor.from_bytes(desc_bytes)
        except DescriptorError as exc:
            raise MmfeatError(ErrorCode.BAD_REQUEST, str(exc)) from None
        got = client.get(desc, device=device)
        tensors = got if isinstance(got, list) else [got]
    # Zero-copy views of a GPU pool: kernels queued on them may still read them after they die.
    devices = [torch.cuda.current_device()] if desc is not None and desc.kind == "cuda" and device is None else []
    lease = _Lease(client, desc, tensors, devices)
    if desc is not None and not desc.is_inline and device is None:
        # Pool views: each gets a storage that keeps the lease, so the feature lives as long as any
        # tensor made from it, not as long as the Parcel (which `loads(data).value` drops at once).
        tensors = [dlpack.keep_alive(t, lease) for t in tensors]
    parcel = Parcel(_unpickle(payload, tensors), lease, payload, tensors)
    if device is not None:
        parcel.ack()  # private copies: the pool's bytes are not needed once a staged copy (the ack waits) is done
    return parcel


# Module-level classes that hold the tensors in attributes: a class made inside the function would hold
# them in its closure, and a class sits in reference cycles, so they lived until a garbage collection,
# and with them the feature a Parcel's tensors keep.
class _Pickler(pickle.Pickler):
    def __init__(self, buf: io.BytesIO, pooled: list[torch.Tensor], threshold: int) -> None:
        super().__init__(buf, protocol=5)
        self._pooled = pooled
        self._threshold = threshold

    def persistent_id(self, o: Any) -> Optional[int]:
        if (type(o) is torch.Tensor and o.layout is torch.strided and not o.requires_grad and not o.is_quantized
                and o.device.type in ("cpu", "cuda") and o.numel() * o.element_size() >= self._threshold):
            self._pooled.append(o)
            return len(self._pooled) - 1
        return None


class _Unpickler(pickle.Unpickler):
    def __init__(self, payload: bytes, tensors: list[torch.Tensor]) -> None:
        super().__init__(io.BytesIO(payload))
        self._tensors = tensors

    def persistent_load(self, pid: Any) -> torch.Tensor:
        if type(pid) is not int or not 0 <= pid < len(self._tensors):
            raise pickle.UnpicklingError(f"no pooled tensor {pid!r}")
        return self._tensors[pid]


def _unpickle(payload: bytes, tensors: list[torch.Tensor]) -> Any:
    return _Unpickler(payload, tensors).load()


class _Lease:
    """A Parcel's feature and whether it was acked. The Parcel and every pool tensor from it keep it
    alive; once the last of them is freed, an unacked feature is acked here and a warning says so (once
    per process), so a forgotten ack costs memory for a moment, not for ``ack_ttl``."""

    def __init__(self, client: Client, desc: Optional[Descriptor], sources: list[torch.Tensor],
                 devices: list[int]) -> None:
        self._client = client
        self._desc = desc
        self._devices = devices  # GPUs whose queued work may read the views: an automatic ack waits for it
        self._sources = sources  # the views get returned: their storage keeps the pool mapped
        self._lock = threading.Lock()
        # A forked child may ack a Parcel it inherited, and exits through ack_at_exit, both under the lock.
        renew_in_child(self)
        self.acked = desc is None
        # A fork copies the Parcel and its tensors, not the duty to ack: the process that loaded it acks
        # when its own copies go, and a child's automatic ack would free memory that process still reads.
        self._pid = os.getpid()
        if not self.acked:
            _unacked.add(self)

    def ack(self, after: Any = None, count: int = 1) -> None:
        # Under the lock, so that a concurrent ack() waits and then finds it done. The finaliser cannot
        # run meanwhile: the caller holds this object.
        with self._lock:
            if self.acked:
                return
            assert self._desc is not None
            if after is None and self._devices:
                after = gpu_order.behind_current(self._devices)  # `with` exits right after the launches
            try:
                self._client.ack(self._desc, count=count, after=after)
            except MmfeatError:
                self.acked = True  # the daemon's verdict on this feature: another ack would get it again
                raise
            except Exception:
                # Bad arguments (refused before anything was tried), or a failure before the ack was
                # made: nothing was acked, so a corrected ack() (or the finaliser) still will.
                raise
            except BaseException:
                # An interrupt may land after the ack took effect: a second one could then free the
                # feature under another consumer, which is worse than leaving it to ack_ttl.
                self.acked = True
                raise
            self.acked = True

    def ack_at_exit(self) -> bool:
        """The automatic ack, for a lease still alive at exit; True when it went as a message, which the
        client must flush before the process ends."""
        with self._lock:
            if self.acked or self._pid != os.getpid():
                return False
            self.acked = True
        assert self._desc is not None
        return not self._client._ack_in_finalizer(self._desc, gpu_order.behind_current(self._devices))

    def __del__(self) -> None:
        # Runs where torch frees the last tensor's storage or the Parcel goes: any thread, and inside
        # whatever that thread was doing (a garbage collection can free them in the client's own code).
        if getattr(self, "acked", True) or self._pid != os.getpid():
            return
        self.acked = True  # nothing else holds this object now: no other thread can ack it
        global _warned_unacked
        if not _warned_unacked:
            _warned_unacked = True
            warnings.warn("an mmfeat Parcel and its tensors were collected without ack(); acked now. Ack each "
                          "Parcel (or use `with loads(data) as obj:`) once its tensors are used", ResourceWarning,
                          stacklevel=2)
        try:
            # A tensor's death is not the GPU's: the kernels queued on it have usually not run yet. The
            # ack follows the work queued so far on the current streams; work on other streams is the
            # caller's to name, with ack(after=).
            self._client._ack_in_finalizer(self._desc, gpu_order.behind_current(self._devices))
        except Exception:
            pass  # interpreter shutdown or a gone daemon: the feature expires by ack_ttl


# Leases this process has not acked. At exit Python frees nothing that module globals or a live frame
# still hold, so the finalisers of those tensors never run: they are acked here instead, or each feature
# would stay until ack_ttl.
_unacked: "weakref.WeakSet[_Lease]" = weakref.WeakSet()


@atexit.register
def _ack_at_exit() -> None:
    clients: dict[int, Client] = {}
    for lease in list(_unacked):
        try:
            if lease.ack_at_exit():
                clients[id(lease._client)] = lease._client
        except Exception:
            pass  # a gone daemon: this feature expires by ack_ttl, and the others are still acked
    for client in clients.values():
        try:
            client.flush(min(client.timeout, 1.0))
        except Exception:
            pass  # a gone daemon: the features expire by ack_ttl


class Parcel:
    """An object from ``loads`` and the pool feature its tensors view. ``with loads(data) as obj:``
    acks on exit, as ``ack()`` does; after either, the tensors must not be read (the producer may reuse
    their memory at once). Without an ack the feature lives as long as the Parcel or any tensor from it
    (so ``loads(data).value`` is safe to read), and is acked once the last of them is freed. A GPU
    pool's tensors are complete on the current stream of their device at ``loads`` (Client.get): read
    them on another stream only after its ``wait_stream`` of that one."""

    def __init__(self, value: Any, lease: _Lease, payload: bytes, tensors: list[torch.Tensor]) -> None:
        self.value = value
        self._lease = lease
        self._payload = payload
        self._tensors = tensors

    @property
    def acked(self) -> bool:
        return self._lease.acked

    def ack(self, after: Any = None, count: int = 1) -> None:
        """Done with the tensors (views must not be read after this). Once; again is a no-op.
        ``after`` (a CUDA stream or event) acks once the GPU work queued there is done; without it, a GPU
        feature's ack waits for the work queued so far on the current stream. ``count`` acks
        for that many consumers: the one rank that encodes an image for its group acks for the group."""
        self._lease.ack(after, count)

    def copy(self) -> Any:
        """The object again, with private copies of the pooled tensors: valid after the ack."""
        return _unpickle(self._payload, [t.clone() for t in self._tensors])

    def __enter__(self) -> Any:
        return self.value

    def __exit__(self, *exc: object) -> None:
        self.ack()


class Pooled:
    """Wraps an object for ``multiprocessing``: ``queue.put(Pooled(obj))`` moves its tensors through the
    pool (not through the queue's pipe), and the receiving process gets a ``Parcel``."""

    def __init__(self, obj: Any, consumers: int = 1, client: Optional[Client] = None) -> None:
        self.obj = obj
        self.consumers = consumers
        self.client = client

    def __reduce__(self) -> tuple[Any, tuple[bytes]]:
        return (_arrive, (dumps(self.obj, consumers=self.consumers, client=self.client),))


def _arrive(data: bytes) -> Parcel:
    return loads(data)
