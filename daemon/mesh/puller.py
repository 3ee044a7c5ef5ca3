"""Pulls of other nodes' features into this daemon's pool, with NIXL (UCX: RDMA, GPUDirect, shared
memory or TCP, whatever the nodes have). Not a transfer engine of ours: one NIXL READ per feature.

The control loop owns the agent (NIXL's agent is not thread-safe as the daemon creates it; its own
progress thread moves the bytes): it posts a READ when a get asks for one and polls transfers in
flight at a growing interval, 20 to 200 us, and not at all otherwise. An earlier version ran the agent
on a thread of its own; the two hand-offs to and from it cost 0.3 to 1 ms per get on the reference
machine. A transfer that outlives its deadline is aborted by releasing its handle; until NIXL lets go,
the job is not reported, so the local range it writes into is never handed to anyone else.
"""

from __future__ import annotations

import ctypes
import logging
import mmap
import os
import time
from dataclasses import dataclass
from typing import Any, Optional

from mmfeat.nixl import NixlUnavailable, load_nixl, make_agent
from mmfeat.protos.lease_table import ENTRY_BYTES, POOL, STATE, check_entry, word_offset

log = logging.getLogger("mmfeatd.puller")

# A transfer NIXL would not let go of when it failed or ran late: kept, with the range it may still
# write into, and its release retried every _STUCK_RETRY_S until it goes.
_STUCK = object()
_STUCK_RETRY_S = 1.0
_SCRATCH_SLOTS = 1024  # verify READs in flight at most, 64 bytes each
_POLL_MIN_S = 20e-6
_POLL_MAX_S = 2e-4  # a finished transfer waits at most this for the loop to notice


@dataclass(frozen=True)
class Region:
    """Memory of this daemon's that peers may READ: one pool's mapping."""

    pool: int
    addr: int
    size: int
    mem: str  # "DRAM" or "VRAM"
    device: int  # 0 for DRAM; the CUDA ordinal for VRAM


@dataclass(frozen=True)
class Verify:
    """After the bytes, READ the owner's lease-table STATE word and entry of the feature's slot: if they
    still show the feature (generation, range, token), the bytes read were its bytes."""

    table_addr: int
    slots: int
    slot: int
    gen: int
    pool: int
    offset: int
    nbytes: int
    token: bytes


@dataclass(frozen=True)
class ReadJob:
    job: int
    peer: str  # the peer's public key
    remote_addr: int
    remote_mem: str
    remote_device: int
    local_addr: int
    local_mem: str
    local_device: int
    nbytes: int
    deadline: float  # time.monotonic()
    verify: Optional[Verify] = None


@dataclass(frozen=True)
class Result:
    job: int
    ok: bool
    error: str = ""
    code: str = ""  # set when the verify READ showed the feature gone (STALE) or not as named (FORBIDDEN)


# A NIXL build registers no GPU memory where its CUDA runtime cannot be loaded (nixl-cu12 on a CUDA 13
# node); mmfeat.nixl.preload_cuda_runtime loads the mesh extra's copy, and this hint says what is missing.
_VRAM_HINT = ("; NIXL's UCX registers GPU memory through the CUDA runtime of its build (nixl-cu12: libcudart.so.12, "
              "nixl-cu13: libcudart.so.13), which the mesh extras install (mmfeat[mesh], mmfeat[mesh-cu13])")


class Puller:
    def __init__(self, name: str, regions: list[Region], table: Optional[tuple[int, int]] = None,
                 net_devices: Optional[str] = None) -> None:
        """``table``: (address, size) of this daemon's lease table, registered so that pullers can check
        features in it; ``net_devices``: UCX_NET_DEVICES for the agent (daemon/mesh/data_plane.py)."""
        api = load_nixl()
        try:
            self._agent = make_agent(api, name, net_devices)
            if "UCX" not in self._agent.backends:
                raise NixlUnavailable("NIXL has no UCX backend here")
            registered = []
            for r in regions:
                try:
                    self._agent.register_memory([(r.addr, r.size, r.device, f"pool{r.pool}")], r.mem)
                    registered.append(r)
                except Exception as exc:  # e.g. VRAM with a UCX built without CUDA: that pool is not pulled
                    hint = _VRAM_HINT if r.mem == "VRAM" else ""
                    log.warning("NIXL cannot register pool %d (%s memory): %s: %s%s",
                                r.pool, r.mem, type(exc).__name__, exc, hint)
            if not registered:
                raise NixlUnavailable("NIXL could register none of this daemon's pools")
            self.table_addr = 0
            if table is not None:
                self._agent.register_memory([(table[0], table[1], 0, "lease-table")], "DRAM")
                self.table_addr = table[0]
            # Where verify READs land: the owner's STATE word and entry, 64 bytes a job.
            self._scratch = mmap.mmap(-1, 64 * _SCRATCH_SLOTS)
            view = ctypes.c_char.from_buffer(self._scratch)
            self._scratch_addr = ctypes.addressof(view)
            del view
            self._agent.register_memory([(self._scratch_addr, len(self._scratch), 0, "scratch")], "DRAM")
            self.metadata: bytes = self._agent.get_agent_metadata()
        except NixlUnavailable:
            raise
        except Exception as exc:  # nixl raises its bindings' own exception types
            raise NixlUnavailable(f"NIXL failed to start: {type(exc).__name__}: {exc}") from None
        self.regions = {r.pool: r for r in registered}
        self._agents: dict[str, bytes] = {}  # peer -> its NIXL agent name
        self._leaving: set[str] = set()
        self._active: list[tuple[ReadJob, Any]] = []
        self._free_scratch = list(range(_SCRATCH_SLOTS))
        self._verifying: dict[int, int] = {}  # job -> scratch slot of its verify READ in flight
        self._stuck: list[tuple[ReadJob, Any, str]] = []
        self._next_stuck_retry = 0.0
        self._pause = _POLL_MIN_S
        self.next_poll = float("inf")  # when the loop should call poll() next

    @property
    def in_flight(self) -> int:
        return len(self._active)

    def add_peer(self, peer: str, metadata: bytes) -> None:
        self._forget(peer)
        self._leaving.discard(peer)
        try:
            self._agents[peer] = self._agent.add_remote_agent(metadata)
        except Exception as exc:
            log.warning("NIXL refused a peer's metadata: %s: %s", type(exc).__name__, exc)

    def remove_peer(self, peer: str) -> None:
        """Forget a peer's agent, once no transfer from it is in flight (NIXL may still use it)."""
        self._leaving.add(peer)
        self._drop_leaving()

    def read(self, job: ReadJob, now: float) -> Optional[Result]:
        """Post the job's READ; its Result now if it ended at once, else from a later poll()."""
        started = self._start(job, *self._data_descs(job))
        if isinstance(started, Result):
            started = self._advance(job, started)
        if isinstance(started, Result):
            return started
        if started is not _STUCK:
            self._active.append((job, started))
        self._pause = _POLL_MIN_S
        self.next_poll = min(self.next_poll, now + self._pause)
        return None

    def poll(self, now: float) -> list[Result]:
        """Advance every transfer in flight; the jobs that ended. Polled at a growing interval while
        transfers run, from _POLL_MIN_S to _POLL_MAX_S, and not at all otherwise."""
        done, still = [], []
        for job, handle in self._active:
            result = self._poll(job, handle)
            if result is None:
                still.append((job, handle))
                continue
            after = result if result is _STUCK else self._advance(job, result)
            if isinstance(after, Result):
                done.append(after)
            elif after is not _STUCK:
                still.append((job, after))
        self._active = still
        if self._stuck and now >= self._next_stuck_retry:
            kept = []
            for job, handle, why in self._stuck:
                if self._release(handle):
                    done.append(self._finish(job, Result(job.job, False, why)))
                else:
                    kept.append((job, handle, why))
            self._stuck, self._next_stuck_retry = kept, now + _STUCK_RETRY_S
        self._drop_leaving()
        if self._active:
            self._pause = _POLL_MIN_S if done else min(self._pause * 2, _POLL_MAX_S)
            self.next_poll = now + self._pause
        else:
            self.next_poll = self._next_stuck_retry if self._stuck else float("inf")
        return done

    def close(self) -> None:
        for handle in [h for _, h in self._active] + [h for _, h, _ in self._stuck]:
            self._release(handle)
        self._active, self._stuck = [], []

    def _drop_leaving(self) -> None:
        for peer in [p for p in self._leaving if not any(j.peer == p for j, _ in self._active)]:
            self._forget(peer)
            self._leaving.discard(peer)

    @staticmethod
    def _data_descs(job: ReadJob) -> tuple[list, str, list, str]:
        return ([(job.local_addr, job.nbytes, job.local_device)], job.local_mem,
                [(job.remote_addr, job.nbytes, job.remote_device)], job.remote_mem)

    def _advance(self, job: ReadJob, result: Result) -> Any:
        """A transfer of ``job`` ended with ``result``: its verify READ next (a handle), or its last Result."""
        if result.ok and job.verify is not None and job.job not in self._verifying:
            started = self._start_verify(job)  # the bytes are in: now their STATE word and entry
            return self._advance(job, started) if isinstance(started, Result) else started  # a handle, or _STUCK
        return self._finish(job, result)

    def _start_verify(self, job: ReadJob) -> Any:
        v = job.verify
        assert v is not None
        if not self._free_scratch:
            return Result(job.job, False, "too many pulls at once to verify")
        slot = self._verifying[job.job] = self._free_scratch.pop()
        local = self._scratch_addr + 64 * slot
        return self._start(job, [(local, 8, 0), (local + 8, ENTRY_BYTES, 0)], "DRAM",
                           [(v.table_addr + word_offset(v.slots, v.slot, STATE), 8, 0),
                            (v.table_addr + word_offset(v.slots, v.slot, POOL), ENTRY_BYTES, 0)], "DRAM")

    def _finish(self, job: ReadJob, result: Result) -> Result:
        """A job's last transfer ended: with a verify READ, what the owner's table says decides."""
        slot = self._verifying.pop(job.job, None)
        if slot is None:
            return result
        self._free_scratch.append(slot)
        if not result.ok:
            return result
        v = job.verify
        assert v is not None
        raw = self._scratch[64 * slot: 64 * slot + 8 + ENTRY_BYTES]
        why = check_entry(int.from_bytes(raw[:8], "little"), raw[8:], v.gen, v.pool, v.offset, v.nbytes, v.token)
        if why == "STALE":
            return Result(job.job, False, f"lease {v.slot} generation {v.gen} ended or its slot was reused", why)
        if why:
            return Result(job.job, False, f"lease {v.slot}'s range or token differ from the descriptor's", why)
        return result

    def _start(self, job: ReadJob, local_list: list, local_mem: str, remote_list: list, remote_mem: str) -> Any:
        name = self._agents.get(job.peer)
        if name is None:
            return Result(job.job, False, "no NIXL metadata from this peer (it has no NIXL, or its hello was refused)")
        try:
            local = self._agent.get_xfer_descs(local_list, local_mem)
            remote = self._agent.get_xfer_descs(remote_list, remote_mem)
            handle = self._agent.initialize_xfer("READ", local, remote, name)
            state = self._agent.transfer(handle)
        except Exception as exc:
            return Result(job.job, False, f"NIXL READ failed to start: {type(exc).__name__}: {exc}")
        if state == "DONE":
            self._release(handle)
            return Result(job.job, True)
        if state == "ERR":
            return self._end(handle, job, "NIXL READ failed")
        return handle

    def _poll(self, job: ReadJob, handle: Any) -> Any:
        """None while the transfer runs; else its Result, or _STUCK."""
        try:
            state = self._agent.check_xfer_state(handle)
        except Exception as exc:
            state, why = "ERR", f"{type(exc).__name__}: {exc}"
        else:
            why = "NIXL READ failed"
        if state == "DONE":
            self._release(handle)
            return Result(job.job, True)
        if state == "ERR":
            return self._end(handle, job, why)
        if time.monotonic() > job.deadline:
            return self._end(handle, job, "NIXL READ did not finish in time")
        return None

    def _end(self, handle: Any, job: ReadJob, why: str) -> Any:
        """A failed or late transfer: its Result once NIXL has let go of its buffers. If NIXL will not,
        _STUCK: the job is reported only when a later release succeeds, so the local range it may still
        write into is never handed to anyone else."""
        if self._release(handle):
            return Result(job.job, False, why)
        log.warning("NIXL kept a transfer it was asked to give up (%s); its %d B stay reserved until it lets go",
                    why, job.nbytes)
        self._stuck.append((job, handle, why))
        return _STUCK

    def _release(self, handle: Any) -> bool:
        try:
            self._agent.release_xfer_handle(handle)
            return True
        except Exception:
            return False

    def _forget(self, peer: str) -> None:
        name = self._agents.pop(peer, None)
        if name is not None:
            try:
                self._agent.remove_remote_agent(name.decode() if isinstance(name, bytes) else name)
            except Exception as exc:
                log.debug("NIXL remove_remote_agent: %s", exc)


def agent_name(node: str, epoch: int) -> str:
    """Unique per daemon run: a restarted peer is a new agent, never confused with its old self."""
    return f"mmfeatd:{node}:{epoch:x}:{os.getpid()}"
