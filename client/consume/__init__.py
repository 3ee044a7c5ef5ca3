"""The consumer's side: ``get`` (views over the pool, copies staged through pinned host pages), the
routes an acknowledgement takes, the background acker and the memory of leases acked lately.

It imports the link, the GPU wing and the client's shared modules (policy, fork_locks, neutral, tensors), never
the producer's side nor the Client above it."""
