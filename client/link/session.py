"""A client's session with its daemon: the hello, the fd channel that keeps the session alive (its
requests travel through client/link/fd_transport.py), the lease table and the pool mappings."""

from __future__ import annotations

import logging
import os
import threading
import time
from pathlib import Path
from typing import Any, Callable, Optional

from mmfeat.protos.errors import DaemonUnavailableError, ErrorCode, MmfeatError
from mmfeat.protos.messages import ArenaReply, HelloReply, PoolInfo
from mmfeat.protos.paths import fd_socket_path

from mmfeat import atomics

from . import fd_budget
from . import mapping as mapping_cache
from .arenas import ArenaSet
from .channel import ControlChannel
from .fd_channel import open_fd_channel
from .fd_transport import FdTransport
from .key_feed import KeyFeed
from .lease_table import LeaseTableView, map_lease_table

log = logging.getLogger("mmfeat.client")


class Session:
    """What a session is: its token, the daemon's epoch and node, pools and their mappings, the lease
    table; ``fd`` is the fd channel its requests travel on."""

    def __init__(
        self,
        hello: HelloReply,
        endpoint: str,
        fd: FdTransport,
        fds: dict[int, int],
        table: LeaseTableView,
        timeout: float,
        readonly: bool = False,
    ) -> None:
        self.token = hello.session
        self.epoch = hello.epoch
        self.node = hello.node
        self.reserve_ttl = float(hello.reserve_ttl)
        self.ack_ttl = float(hello.ack_ttl)  # how long a hold or an unacked feature lives at most
        # How long this client waits on the host for GPU work: a READY word, or the work queued on its
        # own stream ahead of a copy (TIMED_OUT after). A daemon of an earlier release does not say.
        self.ready_ttl = float(hello.ready_ttl) if hello.ready_ttl is not None else self.ack_ttl
        # "ready_word": GPU features may be published behind their stream's write (client/gpu/ready_word.py).
        self.gpu_publish = hello.gpu_publish
        # Keyed and retained features may go into arenas, their key and lifetime bound by a message (bind).
        self.binds = hello.bind
        # Retained features may be pinned in the lease table (SPEC.md, section 5): the daemon honours it.
        self.pins = hello.pins
        self.feed_endpoint = hello.feed  # "" where the daemon has no key feed
        # (device, stream) pairs whose streams hold READY writes of this session's features: close waits
        # for the latest on each (client/gpu/ready_word.py keeps an event behind it).
        self.ready_streams: set[tuple[int, int]] = set()
        self.endpoint = endpoint
        self.pools: dict[int, PoolInfo] = {p.pool: p for p in hello.pools}
        self.mappings: dict[tuple[int, int], Any] = {}  # (pool id, device) -> HostMapping or CudaMapping
        # (owner node, pool id, device) -> CudaMapping of another node's pool mapped through its FABRIC
        # handle, held here because the GPU pool cache holds none: each get would import the pool again.
        self.fabric_mappings: dict[tuple[str, int, int], Any] = {}
        # (pool id, endpoint) -> the fields every descriptor of that pool starts with (PutInFlight.descriptor)
        self.descriptor_heads: dict[tuple[int, str], dict[str, Any]] = {}
        self.host_target: Optional[tuple[PoolInfo, Any]] = None  # a CPU feature's pool and its mapping (Producer)
        self.fds = fds  # pool fds kept for pools mapped lazily (GPU pools: once per device)
        self.pid = fd.pid  # the process that opened it: a forked child must open its own
        self.table = table
        self.timeout = timeout
        self.readonly = readonly  # pools mapped read-only: this process only consumes
        self.fd = fd
        # The shared-memory path: arenas to publish in, and acks added in the lease table.
        self.arenas: Optional[ArenaSet] = ArenaSet(table, fd) if table.writable else None
        fd.on_unclaimed = self._on_unclaimed
        # Puts writing into this session's pool space now (one item each), and what retire() left for the
        # last of them. Once the session ends the daemon frees its arenas and reserved leases, and may hand
        # the space to another producer at once: a put still writing there would overwrite that feature.
        # A list, not a counter under a lock: append and pop are atomic, and every put does both.
        self._writers: list[None] = []
        self._retiring = False
        self._teardown_lock = threading.Lock()
        self._teardown: Optional[Callable[[], None]] = None
        self.feed: Optional[KeyFeed] = None  # the daemon's key feed, where the Client follows one (open_feed)

    def begin_write(self) -> bool:
        """Count a put that places a feature in this session's space, until its ``end_write``; False
        once the session is being closed (then the put needs the client's next session)."""
        self._writers.append(None)
        if self._retiring:  # set before retire() looks at _writers: either it sees this put, or this put sees it
            self.end_write()
            return False
        return True

    def end_write(self) -> None:
        writers = self._writers
        writers.pop()
        if self._retiring and not writers:
            self._run_teardown()  # retire() gave up waiting: the last put ends the session

    def retire(self, teardown: Callable[[], None], wait: float) -> bool:
        """Run ``teardown`` (which ends the session) once no put is writing into its space: now, after
        waiting up to ``wait`` seconds for those in flight, or else when the last of them ends. Whether
        it ran here. No put begins writing here after this call."""
        if self.pid != os.getpid():
            # A forked child's copy: the writes it counts are its parent's.
            teardown()
            return True
        self._retiring = True
        deadline = time.monotonic() + wait
        while self._writers and time.monotonic() < deadline:
            time.sleep(0.001)  # only while another thread's put copies: closing is rare, a put short
        with self._teardown_lock:
            self._teardown = teardown
        # Stored before this look: a put that ends after it finds the teardown, one that ended before is seen.
        return not self._writers and self._run_teardown()

    def _run_teardown(self) -> bool:
        with self._teardown_lock:
            teardown, self._teardown = self._teardown, None
        if teardown is None:
            return False
        teardown()  # exactly once: whoever took it from _teardown
        return True

    def alive(self) -> bool:
        """False once the daemon closed the fd channel (it exited or restarted)."""
        return self.fd.alive()

    def publish(self, lease: dict[str, Any], stream_ready: bool = False, wait: bool = False) -> Any:
        """Publish a reserved lease on the fd channel; ``stream_ready``: its GPU stream writes READY
        (SPEC.md, section 5); ``wait``: for the daemon's reply, which is returned."""
        fields: dict[str, Any] = {"lease": lease, "stream_ready": True} if stream_ready else {"lease": lease}
        if wait:
            return self.fd.call("publish", **fields)
        self.fd.send("publish", **fields)
        return None

    def _on_unclaimed(self, reply: dict[str, Any]) -> None:
        if "arena" in reply:
            # An arena granted after its request timed out: nobody will place features in it.
            try:
                self.fd.send("arena_return", arena=ArenaReply.from_wire(reply).arena.id)
            except DaemonUnavailableError:
                pass  # the session is ending: the daemon takes its arenas back anyway
            except MmfeatError as exc:  # a grant that does not parse names no arena to return
                self.fd.failures.record("arena", exc.code.value, exc.message)

    # --- mappings ------------------------------------------------------------------------------

    def pool_on_local_device(self, ordinal: int) -> Optional[PoolInfo]:
        """The GPU pool on this process's CUDA device ``ordinal``, matched by GPU UUID: the daemon and
        this process may number GPUs differently (CUDA_VISIBLE_DEVICES in a pod)."""
        from mmfeat.cuda_driver import gpu_ordinal

        for info in self.pools.values():
            if info.kind == "cuda" and gpu_ordinal(info.uuid, info.device) == ordinal:
                return info
        return None

    def mapping(self, pool_id: int, device: Optional[int] = None) -> Any:
        """The process-wide mapping of a pool: host pools once, GPU pools once per device (default: the
        caller's current one)."""
        info = self.pools[pool_id]
        if info.kind == "host":
            key = (pool_id, -1)
            if key not in self.mappings:
                fd = self.fds.pop(pool_id, None)
                if fd is None:
                    raise MmfeatError(ErrorCode.INTERNAL, f"daemon sent no fd for host pool {pool_id}")
                self.mappings[key] = mapping_cache.map_host_pool(
                    self.endpoint, pool_id, info.epoch, fd, info.size, self.readonly)
            return self.mappings[key]
        if device is None:
            import torch

            if not torch.cuda.is_available():
                # torch would assert (a CPU-only build) or raise deep inside; a PoolMapError is what put and
                # reserve fall back inline on, and what a get raises for a pool it cannot map.
                from ..gpu.cuda_import import PoolMapError

                raise PoolMapError(f"pool {pool_id} is GPU memory (device {info.device}), and this process sees "
                                   "no CUDA device: get it where one is, or give the daemon a host pool "
                                   "(host_pool_mb) for features made on the CPU")
            device = torch.cuda.current_device()
        key = (pool_id, device)
        if key not in self.mappings:
            from ..gpu.cuda_import import map_cuda_pool

            fd = self.fds.get(pool_id)
            self.mappings[key] = map_cuda_pool(self.endpoint, info, os.dup(fd) if fd is not None else None,
                                               self.readonly, device)
        return self.mappings[key]

    def fabric_mapping(self, node: str, info: PoolInfo) -> Any:
        """Another node's GPU pool, mapped through the FABRIC handle its daemon relayed, once per (node,
        pool, device) for as long as this session lives; a new epoch of that node's daemon (it restarted)
        replaces the mapping, and the old pool is unmapped once no tensor views it."""
        import torch

        device = torch.cuda.current_device() if torch.cuda.is_available() else -1
        key = (node, info.pool, device)
        held = self.fabric_mappings.get(key)
        if held is not None and held.epoch == info.epoch:
            return held
        from ..gpu.cuda_import import map_cuda_pool

        mapping = map_cuda_pool(f"mesh:{node}", info, None, self.readonly)
        self.fabric_mappings[key] = mapping
        return mapping

    def settle_ready_writes(self, timeout: float) -> bool:
        """Wait, ``timeout`` seconds at most, for the READY words this session's features have queued on
        GPU streams: once its fd channel closes the daemon takes a feature still unwritten for a dead
        producer's, and after a grace ends it, its reads lost. Only those streams' latest writes are
        waited for (events, never a device synchronise, which would wait for other processes' words
        too). Whether they ran."""
        streams = list(self.ready_streams)
        if not streams or self.pid != os.getpid():
            return True
        from ..gpu import ready_word

        return ready_word.settled(self.table, streams, timeout)

    def settle_quietly(self, timeout: float) -> None:
        """settle_ready_writes, for a session that is closing: what has not run by then, or a broken
        device, is left to the daemon, which keeps an unwritten feature's range for its grace once this
        session's channel closes (and its consumers learn their reads were lost)."""
        try:
            left = len(self.ready_streams)
            if not self.settle_ready_writes(timeout):
                log.warning("closing with READY writes still queued on %d GPU stream(s) after %g s: features whose "
                            "write has not run by the daemon's grace end as lost reads", left, timeout)
        except Exception:
            pass

    def open_feed(self, endpoint: str, prefix: str) -> None:
        """Follow the key feed at ``endpoint`` (hello's) for keys under ``prefix``, its subscription in
        place before this returns unless the daemon is slow to take it (then keys bound meanwhile are
        missed, and asked for). A feed that cannot open is logged: lookups go to the daemon instead."""
        import zmq

        # An endpoint the daemon names could be anywhere: a feed is a file beside its control socket.
        if not endpoint.startswith("ipc://"):
            log.warning("mmfeatd names key feed %r, not an ipc:// endpoint: not followed", endpoint)
            return
        try:
            feed = KeyFeed(zmq.Context.instance(), endpoint, prefix)
        except (zmq.ZMQError, OSError, MmfeatError) as exc:  # MmfeatError: FdLimitError
            log.warning("cannot follow mmfeatd's key feed at %s (%s): keys are asked for instead", endpoint, exc)
            return
        if not feed.wait_ready(min(self.timeout, 2.0)):
            log.info("mmfeatd's key feed at %s has not confirmed its subscription yet", endpoint)
        self.feed = feed

    def close(self) -> None:
        """End the session here. Its READY writes are not waited for: a closing Client does that first
        (settle_quietly), and a session whose daemon closed its channel has nobody left to end them."""
        if self.arenas is not None and self.pid == os.getpid():
            # Only here: a forked child's copy has no reaper thread to stop, and the parent's may have held
            # the stop event's lock at the fork.
            self.arenas.close()
        if self.feed is not None:
            self.feed.close()  # in a forked child, without touching the parent's socket
            self.feed = None
        self.fd.close()
        # The callback is the only reference back to this session: without it a closed session is freed
        # by its last user, not by a garbage collection, and its pool mappings go with it.
        self.fd.on_unclaimed = None
        self.fabric_mappings.clear()  # other nodes' pools go once no tensor views them
        for fd in self.fds.values():
            os.close(fd)
        self.fds.clear()


def open_session(channel: ControlChannel, runtime_dir: Path, name: str, timeout: float,
                 readonly: bool = False, map_pools: bool = True, key_feed: Optional[str] = None) -> Session:
    """hello, the fd channel handshake (which checks who serves it), the lease table and the host pools
    (read-only with ``readonly``), and with ``key_feed`` (a key prefix) the daemon's key feed where hello
    names one. FdLimitError, before anything is half open, when this process cannot spare the fds that takes."""
    try:
        session = _open_session(channel, runtime_dir, name, timeout, readonly, map_pools)
    except OSError as exc:
        if fd_budget.is_exhaustion(exc):
            raise fd_budget.exhausted(exc, "opening a session with mmfeatd") from None
        raise
    if key_feed is not None and session.feed_endpoint:
        try:
            session.open_feed(session.feed_endpoint, key_feed)
        except BaseException:
            session.close()
            raise
    return session


def _open_session(channel: ControlChannel, runtime_dir: Path, name: str, timeout: float,
                  readonly: bool, map_pools: bool = True) -> Session:
    # One pool for the count before hello (a daemon has at least one); the exact count once it says.
    fd_budget.ensure(fd_budget.session_fds(1), "opening a session with mmfeatd")
    sent = time.monotonic()
    hello = HelloReply.from_wire(channel.call("hello", name=name[:128], pid=os.getpid()))
    # Same kernel, same CLOCK_MONOTONIC (unless a time namespace shifts it): then deadlines mean the same.
    channel.send_deadlines = sent - 1.0 <= hello.clock <= time.monotonic() + 1.0
    fd_budget.ensure(fd_budget.session_fds(len(hello.pools)), "opening a session with mmfeatd")
    # A control-only client (map_pools False) asks for the lease table's fd alone: no pool reaches it.
    fd_sock, fds, table_fd = open_fd_channel(fd_socket_path(runtime_dir), hello.session, timeout, map_pools)
    try:
        # Writable only where this process will publish and ack in it (SPEC.md, section 9).
        writable = hello.arenas and atomics.AVAILABLE
        table = map_lease_table(channel.endpoint, hello.epoch, table_fd, hello.table_slots, writable)
    except BaseException:
        fd_sock.close()
        for fd in fds.values():
            os.close(fd)
        raise
    fd = FdTransport(fd_sock, timeout, channel.failures)
    fd.send_deadlines = channel.send_deadlines
    session = Session(hello, channel.endpoint, fd, fds, table, timeout, readonly)
    if not map_pools:
        return session
    try:
        for pool_id, info in session.pools.items():
            if info.kind == "host":  # map host pools now; GPU pools on first use, on the caller's device
                session.mapping(pool_id, None)
    except BaseException:
        session.close()
        raise
    return session
