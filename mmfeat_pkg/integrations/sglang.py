"""mmfeat as SGLang's encoder transfer: ``MmfeatDelivery`` on the encode server, ``WaitingMmfeatRequest``
on each scheduler rank of the prefill (or PD) server. Both are subclasses of SGLang's own classes
(``EncoderDelivery`` in sglang/srt/disaggregation/encoder/server.py, ``WaitingZmqRequest`` in its
receiver.py), made on first use so that importing this module needs no SGLang.

The encoder puts each request's embedding into the node's pool once, with one consumer per rank that
will receive it (SGLang's ``receive_count``), and pushes SGLang's usual pickled ``EmbeddingData`` header
to each rank with the descriptor's bytes as the message's second frame, where the ZMQ backend sends the
raw embedding. A rank reads the descriptor into a private tensor (on its GPU when it has one, straight
from the pool) and acks it, so the pool holds each embedding only until its last rank copied it.

SGLang chooses its backend from a closed list, so selecting these takes a patch of a few lines in
SGLang (docs/integration.md, "SGLang"): with ``--encoder-transfer-backend zmq_to_scheduler`` and
``SGLANG_ENCODER_DELIVERY=mmfeat`` on both servers, the encoder makes a ``MmfeatDelivery`` where it
makes a ``ZmqDelivery``, and each rank a ``WaitingMmfeatRequest`` where it makes a
``WaitingZmqRequest``; everything else of that backend stays as it is.
"""

from __future__ import annotations

import asyncio
import functools
import threading
from typing import Any, Optional

from mmfeat.client import Client, Descriptor, ErrorCode, MmfeatError

_client_lock = threading.Lock()
_client: Optional[Client] = None


def client() -> Client:
    """This process's one Client: SGLang makes a delivery per encoder and a receiver object per request."""
    global _client
    with _client_lock:
        if _client is None:
            _client = Client(name="sglang-encoder-transfer")
        return _client


class DescriptorBook:
    """The encoder's descriptor of each request that is being sent, until SGLang releases the request.

    The first send of a request puts its embedding, for ``receive_count`` consumers; each later send of
    that request reuses the descriptor. A destination counts once its send went through: only a rank
    that got the descriptor will ack it. At release, every consumer that was not delivered to (its
    rank was down, an abort) is acked for, so no embedding waits out ``ack_ttl``."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._sent: dict[str, tuple[Descriptor, int, int]] = {}  # req_id -> (descriptor, consumers, delivered)

    def descriptor(self, c: Client, req_id: str, embedding: Any, consumers: int) -> Descriptor:
        with self._lock:
            entry = self._sent.get(req_id)
            if entry is None:
                entry = (c.put(embedding, consumers=consumers), consumers, 0)
                self._sent[req_id] = entry
            return entry[0]

    def delivered(self, req_id: str) -> None:
        """One destination of ``req_id`` got its descriptor: that rank acks it, not the release."""
        with self._lock:
            entry = self._sent.get(req_id)
            if entry is not None:
                desc, n, delivered = entry
                self._sent[req_id] = (desc, n, delivered + 1)

    def release(self, c: Client, req_id: str) -> None:
        with self._lock:
            entry = self._sent.pop(req_id, None)
        if entry is None:
            return
        desc, consumers, delivered = entry
        if delivered < consumers and not desc.is_inline:
            try:
                c.ack(desc, count=consumers - delivered)
            except MmfeatError:
                pass  # gone already (expired, daemon restarted): nothing to give back


def embedding_from_frame(c: Client, frame: Any, dtype: Any, shape: Any, device: Any = None) -> Any:
    """A rank's private copy of the embedding a descriptor frame names, acked once copied."""
    tensor = c.get(frame, copy=True, device=device)
    c.ack(frame)
    if (dtype is not None and tensor.dtype != dtype) or (shape is not None and list(tensor.shape) != list(shape)):
        raise MmfeatError(ErrorCode.BAD_REQUEST, f"the descriptor holds {tensor.dtype} {list(tensor.shape)}, but "
                          f"its header says {dtype} {shape}: the encoder and this rank disagree")
    return tensor


@functools.lru_cache(maxsize=None)
def _make_delivery() -> type:
    import zmq
    import zmq.asyncio
    from sglang.srt.disaggregation.encoder import server

    class MmfeatDelivery(server.ZmqDelivery):
        """ZMQ's delivery with the embedding in the pool: put once per request, and [header, descriptor]
        pushed to each destination where ZMQ pushes [header, raw bytes]. SGLang's own bookkeeping of
        the request (what ZmqDelivery.release clears) is kept as it is."""

        def __init__(self, encoder: Any, *, cleanup_receive_state: bool = True) -> None:
            super().__init__(encoder, cleanup_receive_state=cleanup_receive_state)
            self._book = DescriptorBook()
            self._ctx = zmq.asyncio.Context.instance()
            self._sockets: dict[str, Any] = {}
            self._lock = asyncio.Lock()

        async def send(self, state: Any, destination: Any) -> None:
            import pickle

            mm_data = await self.encoder._wait_for_embedding(state)
            consumers = server.rid_to_receive_count.get(state.req_id) or 1
            desc = await asyncio.to_thread(self._book.descriptor, client(), state.req_id, mm_data.embedding,
                                           consumers)
            header = pickle.dumps(mm_data.copy_without_embedding())
            endpoint = server.NetworkAddress.parse(destination.endpoint).to_tcp()
            async with self._lock:
                sock = self._sockets.get(endpoint)
                if sock is None:
                    sock = self._ctx.socket(zmq.PUSH)
                    sock.setsockopt(zmq.IMMEDIATE, 1)
                    sock.setsockopt(zmq.SNDTIMEO, int(getattr(self.encoder, "send_timeout", 60) * 1000))
                    sock.connect(endpoint)
                    self._sockets[endpoint] = sock
                # A send that raises (the rank is down: no connection took the message before the
                # timeout) delivered nothing, so it is not counted and the release gives its share back.
                await sock.send_multipart([header, desc.to_bytes()])
            await asyncio.to_thread(self._book.delivered, state.req_id)

        async def release(self, state: Any) -> None:
            await asyncio.to_thread(self._book.release, client(), state.req_id)
            await super().release(state)

    return MmfeatDelivery


@functools.lru_cache(maxsize=None)
def _make_receiver() -> type:
    import torch
    from sglang.srt.disaggregation.encoder import receiver

    class WaitingMmfeatRequest(receiver.WaitingZmqRequest):
        """Frame 1 is a descriptor: the embedding is copied out of the pool (onto this rank's GPU where
        it has one) and acked, then SGLang assembles it as it does a ZMQ frame's bytes."""

        def _extract_embedding_from_buffer(self, recv_obj: Any, parts: Any) -> None:
            frame = parts[1].buffer if hasattr(parts[1], "buffer") else parts[1]
            device = torch.device("cuda", torch.cuda.current_device()) if torch.cuda.is_available() else None
            recv_obj.embedding = embedding_from_frame(client(), frame, recv_obj.dtype, recv_obj.shape, device)

    return WaitingMmfeatRequest


def __getattr__(name: str) -> Any:
    if name == "MmfeatDelivery":
        return _make_delivery()
    if name == "WaitingMmfeatRequest":
        return _make_receiver()
    raise AttributeError(f"module 'mmfeat.integrations.sglang' has no attribute {name!r}")
