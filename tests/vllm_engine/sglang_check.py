"""mmfeat's SGLang delivery and receiver against SGLang's own classes, in the vLLM venv where SGLang
0.5.23 is installed beside it (tests/vllm_engine/setup_venv.sh): the encoder's MmfeatDelivery sends one
request's embedding to two receiving ranks, each rank's WaitingMmfeatRequest reads it out of the pool,
and the release gives back the share of a rank that was never sent to. With ``rank_down``, one of three
ranks is down (its socket gone) when the encoder sends to it: that send fails, and the release gives
its share back, so the embedding is freed once the two live ranks acked. Prints one JSON line.

    python sglang_check.py RUNTIME_DIR [rank_down]
"""

import asyncio
import json
import os
import pickle
import sys


def main() -> None:
    os.environ["MMFEAT_RUNTIME_DIR"] = sys.argv[1]
    import torch
    import zmq
    from sglang.srt.disaggregation.encoder import server
    from sglang.srt.disaggregation.encoder.receiver import EmbeddingData
    from sglang.srt.utils.common import safe_pickle_loads

    from mmfeat.integrations import sglang as ours

    rank_down = sys.argv[2:] == ["rank_down"]
    ctx = zmq.Context.instance()
    pulls, ports = [], []
    for _ in range(3 if rank_down else 2):
        sock = ctx.socket(zmq.PULL)
        sock.setsockopt(zmq.RCVTIMEO, 60_000)  # a send that never comes fails the check, not hangs it
        ports.append(sock.bind_to_random_port("tcp://127.0.0.1"))
        pulls.append(sock)
    if rank_down:
        pulls.pop(1).close(linger=0)  # rank 1 is down: nothing listens on its port

    embedding = torch.randn(300, 256).to(torch.bfloat16)
    mm_data = EmbeddingData("req-1", 1, 0, [[1, 30, 40]], "image", embedding=embedding)
    state = server.ReqState("req-1", embedding_data=mm_data)
    state.embedding_ready.set()

    class Encoder:  # the two things of SGLang's MMEncoder a delivery uses
        # How long a send waits for a connection that takes it: rank 1's never can, so this is only
        # how long its failed send takes.
        send_timeout = 2 if rank_down else 10

        async def _wait_for_embedding(self, state):
            return state.embedding_data

    delivery = ours.MmfeatDelivery(Encoder())
    assert isinstance(delivery, server.ZmqDelivery)
    server.rid_to_receive_count["req-1"] = 3  # three ranks expected; only two are ever sent to, or got it

    failed_sends = []

    async def send() -> None:
        for port in ports:  # as SGLang's receivers register themselves: a host and an embedding port
            try:
                await delivery.send(state, server.SendDestination.from_host_port("127.0.0.1", port))
            except zmq.Again:
                failed_sends.append(port)

    asyncio.run(send())
    receiver_cls = ours.WaitingMmfeatRequest
    got = []
    for sock in pulls:
        parts = sock.recv_multipart(copy=False)
        recv_obj = safe_pickle_loads(parts[0].bytes)
        rank = receiver_cls.__new__(receiver_cls)  # the receive path alone: no encoder to register with
        rank._extract_embedding_from_buffer(recv_obj, parts)
        got.append(bool(torch.equal(recv_obj.embedding, embedding)))
    c = ours.client()
    c.flush()  # the live ranks' acks are in the daemon's books: only the undelivered share is left
    before = c.stats()["pools"][0]["used"]
    asyncio.run(delivery.release(state))
    c.flush()
    assert "req-1" not in server.rid_to_receive_count  # ZmqDelivery's own release ran too
    print("SGLANG-RESULT " + json.dumps({"equal": got, "used_before_release": before,
                                         "failed_sends": len(failed_sends),
                                         "header_bytes": len(pickle.dumps(mm_data.copy_without_embedding()))}))


if __name__ == "__main__":
    main()
