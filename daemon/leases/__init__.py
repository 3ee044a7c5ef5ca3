"""The lease lifecycle and what it is drawn from: the pool's allocator, arenas, the lease table, sessions."""
