"""The link to the daemon: the control channel and the fd channel with its transport, the session that
opens them and what it holds of the daemon's (the lease table, the pools mapped, the producer's arenas),
the probe that tells a dead daemon from its lock, the fd budget and the counts of failed quiet requests.

It imports the GPU wing (a session maps GPU pools through it) and the client's shared modules
(fork_locks, neutral), never the producer's or the consumer's side, nor the Client above them."""
