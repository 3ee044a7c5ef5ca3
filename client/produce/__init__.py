"""The producer's side: ``put`` (in an arena, a lease, or inline with the request), zero-copy
reservations, the put in flight that carries a feature from step to step, and the inline fallbacks.

It imports the link, the GPU wing and the client's shared modules (policy, fork_locks, neutral, tensors), never
the consumer's side nor the Client above it."""
