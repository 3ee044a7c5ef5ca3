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

import io
import os
import pickle
import threading
import warnings
from typing import Any, Optional

import msgpack
import torch

from mmfeat.protos.descriptor import Descriptor, DescriptorError
from mmfeat.protos.errors import ErrorCode, MmfeatError

from .client import Client

FORMAT = 1

_default: Optional[Client] = None
_default_pid = 0
_default_lock = threading.Lock()
_warned_unacked = False


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

    class _Pickler(pickle.Pickler):
        def persistent_id(self, o: Any) -> Optional[int]:
            if (type(o) is torch.Tensor and o.layout is torch.strided and not o.requires_grad and not o.is_quantized
                    and o.device.type in ("cpu", "cuda") and o.numel() * o.element_size() >= threshold):
                pooled.append(o)
                return len(pooled) - 1
            return None

    buf = io.BytesIO()
    _Pickler(buf, protocol=5).dump(obj)
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
    parcel = Parcel(_unpickle(payload, tensors), client, desc, payload, tensors)
    if device is not None:
        parcel.ack()  # private copies, complete when get returned: the pool's bytes are not needed
    return parcel


def _unpickle(payload: bytes, tensors: list[torch.Tensor]) -> Any:
    class _Unpickler(pickle.Unpickler):
        def persistent_load(self, pid: Any) -> torch.Tensor:
            if type(pid) is not int or not 0 <= pid < len(tensors):
                raise pickle.UnpicklingError(f"no pooled tensor {pid!r}")
            return tensors[pid]

    return _Unpickler(io.BytesIO(payload)).load()


class Parcel:
    """An object from ``loads`` and the pool feature its tensors view. ``with loads(data) as obj:``
    acks on exit. A Parcel collected without an ack acks then, and warns (once per process), so a
    forgotten ack costs memory for a moment, not for ``ack_ttl``."""

    def __init__(self, value: Any, client: Client, desc: Optional[Descriptor], payload: bytes,
                 tensors: list[torch.Tensor]) -> None:
        self.value = value
        self._client = client
        self._desc = desc
        self._payload = payload
        self._tensors = tensors
        self._lock = threading.Lock()
        self.acked = desc is None

    def ack(self, after: Any = None, count: int = 1) -> None:
        """Done with the tensors (views must not be read after this). Once; again is a no-op.
        ``after`` (a CUDA stream or event) acks once the GPU work queued there is done. ``count`` acks
        for that many consumers: the one rank that encodes an image for its group acks for the group."""
        with self._lock:
            if self.acked:
                return
            self.acked = True
        assert self._desc is not None
        self._client.ack(self._desc, count=count, after=after)

    def copy(self) -> Any:
        """The object again, with private copies of the pooled tensors: valid after the ack."""
        return _unpickle(self._payload, [t.clone() for t in self._tensors])

    def __enter__(self) -> Any:
        return self.value

    def __exit__(self, *exc: object) -> None:
        self.ack()

    def __del__(self) -> None:
        if getattr(self, "acked", True):
            return
        global _warned_unacked
        if not _warned_unacked:
            _warned_unacked = True
            warnings.warn("an mmfeat Parcel was collected without ack(); acked now. Ack each Parcel (or use "
                          "`with loads(data) as obj:`) once its tensors are used", ResourceWarning, stacklevel=2)
        try:
            self.ack()
        except Exception:
            pass  # interpreter shutdown or a gone daemon: the feature expires by ack_ttl


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
