"""Every wait a client makes for GPU work ends within a bound it states, with a typed error, and waits
only for its own work; a read of a GPU feature its producer's GPU never wrote is told as such (LOST,
Client.lost_reads); the contracts of a view read on another stream and of a slow producer. On the fake
driver (tests/fake_cuda), whose streams hold GPU work until the scenario lets it go, with producers,
consumers and mmfeatd in separate processes."""

from __future__ import annotations

import os
import re
from pathlib import Path
from typing import Iterator

import pytest

from . import fake_cuda
from .conftest import Daemon, start_daemon


def _daemon(fake_libcuda: Path, runtime_dir: Path, tmp_path: Path, *args: str) -> Daemon:
    env = {"LD_LIBRARY_PATH": str(fake_libcuda), "STUB_LOG": str(tmp_path / "daemon.log")}
    return start_daemon(runtime_dir, "--devices", "0", "--pool-mb", "16", *args, backend="cuda_vmm", env=env)


def _stopped(d: Daemon) -> None:
    rc = d.stop()
    _, err = d.proc.communicate()
    assert rc == 0, err


@pytest.fixture
def gpu_daemon(fake_libcuda: Path, runtime_dir: Path, tmp_path: Path) -> Iterator[Daemon]:
    d = _daemon(fake_libcuda, runtime_dir, tmp_path)
    yield d
    _stopped(d)


def _run(fake_libcuda: Path, tmp_path: Path, runtime_dir: Path, scenario: str, **env: str) -> tuple[str, str]:
    """The scenario's driver log, and its second process's."""
    other = tmp_path / "other.log"
    log = fake_cuda.run(fake_libcuda, tmp_path / f"{scenario}.log", scenario,
                        {"MMFEAT_RUNTIME_DIR": str(runtime_dir), "FAKE_CUDA_CONSUMER_LOG": str(other), **env})
    return log, other.read_text() if other.exists() else ""


def test_a_feature_its_gpu_never_writes_bounds_every_wait_and_its_reads_are_told_lost(
        fake_libcuda, runtime_dir, tmp_path) -> None:
    """A live producer whose fill never runs: a copying get gives up after the daemon's ready_ttl with
    no GPU wait left on its stream; a view's stream goes on once the daemon ends the feature (ack_ttl)
    and lets its word go (ready_ttl); the ack after that stream then finds the read lost, and so do a
    later get and a waited ack, under a code of their own and a counter."""
    d = _daemon(fake_libcuda, runtime_dir, tmp_path, "--ack-ttl", "3", "--ready-ttl", "1")
    try:
        log, _ = _run(fake_libcuda, tmp_path, runtime_dir, "a_feature_its_gpu_never_writes")
    finally:
        _stopped(d)
    assert "=== a copying get: TIMED_OUT; waits queued on the stream: 0; within ready_ttl and the client's " \
           "timeout: True" in log, log
    assert "=== a view: waits queued on the stream: 1" in log, log
    assert "=== the stream went on once the daemon let the word go: True" in log, log
    assert "=== the ack after it found the read lost: True; lost_reads 1" in log, log
    assert "=== a later get: LOST" in log, log
    assert "=== a waited ack: LOST" in log, log
    failures = re.search(r"=== async failures: (.*); lost_reads (\d+)", log)
    assert failures and "NOT_FOUND" not in failures.group(1) and failures.group(2) == "1", log
    assert re.search(r"=== stats lost_reads [1-9]", log), log
    assert "!!" not in log, log


def test_a_consumer_outlives_its_producer_and_daemon_dying_under_its_streams_wait(
        fake_libcuda, runtime_dir, tmp_path) -> None:
    """Nobody is left to write the word the consumer's stream waits on: its next session (the new
    daemon's) lets its wait on the old table go, counted as a lost read; close returns; the old table
    is unpinned once its stream ran, with no device synchronise in the way."""
    d = _daemon(fake_libcuda, runtime_dir, tmp_path)
    log, _ = _run(fake_libcuda, tmp_path, runtime_dir, "daemon_and_producer_die_under_a_wait",
                  FAKE_CUDA_DAEMON_PID=str(d.pid), FAKE_CUDA_DAEMON2_LOG=str(tmp_path / "daemon2.log"))
    d.proc.wait(30)
    assert "=== waits queued on the stream: 1" in log, log
    assert "=== the next call returned: True (['returned'])" in log, log
    assert "=== the stream went on: True; lost_reads 1" in log, log
    assert "=== closed: True" in log, log
    # The old table was dropped with the old session, its registration once its stream had run.
    assert "cuMemHostUnregister" in fake_cuda.section(log, "waits queued on the stream: 1"), log


def test_a_get_on_the_legacy_stream_while_another_thread_captures_waits_on_the_host(
        fake_libcuda, gpu_daemon, tmp_path) -> None:
    """The driver answers an error, not whether the legacy stream captures, while a blocking stream of
    its context does: the get neither raises it nor queues anything there, and the capture survives."""
    log, _ = _run(fake_libcuda, tmp_path, gpu_daemon.runtime_dir, "get_on_the_legacy_stream_while_another_captures")
    assert "=== waiting on the host: True ([])" in log, log
    assert "=== the get: ['returned']" in log, log
    assert "=== the capture: ['ok']" in log, log
    assert "!!" not in log, log


def test_a_publish_inside_a_capture_is_refused_and_the_capture_survives(fake_libcuda, gpu_daemon, tmp_path) -> None:
    log, _ = _run(fake_libcuda, tmp_path, gpu_daemon.runtime_dir, "publish_inside_a_capture")
    assert "=== publish inside a capture: BAD_STATE; the capture: ok" in log, log
    assert "=== published after it: returned" in log, log
    assert "!!" not in log, log


def test_the_tables_first_gpu_use_breaks_no_capture_and_locks_the_table(fake_libcuda, gpu_daemon, tmp_path) -> None:
    """Its registration and its device address, while another thread captures in global mode; and its
    pages locked in memory, where registration would not pin them (Grace)."""
    log, _ = _run(fake_libcuda, tmp_path, gpu_daemon.runtime_dir, "first_gpu_use_while_another_thread_captures")
    assert "=== the capture: ['ok']" in log, log
    assert "=== the table locked in memory: True" in log, log
    assert "!!" not in log, log


def test_a_view_read_on_a_stream_the_get_names_has_that_stream_wait(fake_libcuda, gpu_daemon, tmp_path) -> None:
    log, consumer = _run(fake_libcuda, tmp_path, gpu_daemon.runtime_dir, "publish_behind_the_fill",
                         FAKE_CUDA_CONSUMER_STREAM="1")
    assert "=== consumer exited 0" in log, consumer
    assert "waits queued on the stream: 1; on the current stream: 0" in consumer, consumer
    assert "=== the stream went on: True; ready: True" in consumer, consumer


def test_a_consumer_waits_on_the_host_for_a_slow_fill_past_its_own_timeout(fake_libcuda, gpu_daemon, tmp_path) -> None:
    """A producer publishes before its GPU has run its queue: a consumer that cannot wait on the GPU
    waits on the host for the daemon's ready_ttl, not for its own (short) timeout."""
    log, consumer = _run(fake_libcuda, tmp_path, gpu_daemon.runtime_dir, "publish_behind_the_fill",
                         FAKE_CUDA_CONSUMER_NO_MEM_OPS="1", FAKE_CUDA_CONSUMER_TIMEOUT="1")
    assert "=== the consumer had its view before the fill: False" in log, log
    assert "=== consumer exited 0" in log, consumer
    assert "the get raised" not in consumer, consumer
    assert re.search(r"=== got \(\d+,\); waits queued on the stream: 0", consumer), consumer


def test_a_range_kept_for_an_unwritten_feature_goes_back_after_ready_ttl(fake_libcuda, runtime_dir, tmp_path) -> None:
    """A live producer's feature that ended before its GPU wrote it keeps its range (and its consumers'
    streams wait) for the daemon's ready_ttl, not for another ack_ttl."""
    d = _daemon(fake_libcuda, runtime_dir, tmp_path, "--ack-ttl", "300", "--ready-ttl", "2")
    try:
        log = fake_cuda.run(fake_libcuda, tmp_path / "kept.log", "early_ack_of_a_reserved_lease",
                            {"MMFEAT_RUNTIME_DIR": str(runtime_dir), "FAKE_CUDA_KEEP_CAPPED": "1"})
    finally:
        _stopped(d)
    assert "=== ended: True; range back before the fill: False" in log, log
    assert "=== range back with the fill still queued, past ack_ttl: True; ready: True" in log, log


def test_a_read_only_tables_ready_load_is_an_acquire(runtime_dir, tmp_path) -> None:
    """A consumer that sees READY written goes on to read, and to queue kernels on, bytes another
    process's GPU wrote: on a CPU whose plain loads are not acquires (aarch64), a read-only mapping's
    load of READY is followed by the fence _live_entry uses. Checked in a child with the fence marked
    needed and counted (x86-64 needs none)."""
    import subprocess
    import sys

    d = start_daemon(runtime_dir, "--pool-mb", "16", "--arena-mb", "0")  # no arenas: the table is read-only
    code = """
import time
import torch
from mmfeat.client import Client
from mmfeat.client.link import lease_table as lt
calls = []
lt.FENCE_NEEDED = True
lt.fence_acquire = lambda: calls.append(1)
with Client() as c:
    desc = c.put(torch.ones(1 << 20, dtype=torch.uint8))
    table = c._connect().table
    assert not table.writable
    deadline = time.monotonic() + 30
    while not table.is_ready(desc.lease, desc.gen) and time.monotonic() < deadline:
        time.sleep(0.01)  # until the daemon has handled the publish
    before = len(calls)
    print(table.is_ready(desc.lease, desc.gen), len(calls) - before)
    c.ack(desc)
"""
    try:
        r = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120,
                           env={**os.environ, "MMFEAT_RUNTIME_DIR": str(runtime_dir)})
    finally:
        _stopped(d)
    assert r.returncode == 0, r.stderr
    assert r.stdout.split() == ["True", "1"], r.stdout
