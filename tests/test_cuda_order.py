"""GPU order on the fake driver's streams and events (tests/fake_cuda): every path that gives pool
memory back does so only after the GPU work that may still touch it, never with a host wait on the
caller's thread, in the context of the work's device, and without breaking another thread's capture.
The fake keeps GPU work queued until the scenario releases it, and logs each completion."""

from __future__ import annotations

import re
from pathlib import Path
from typing import Iterator

import pytest

from . import fake_cuda
from .conftest import Daemon, start_daemon
from .test_fabric_route import _feature
from .ttls import ttls


@pytest.fixture
def gpu_daemon(fake_libcuda: Path, runtime_dir: Path, tmp_path: Path) -> Iterator[Daemon]:
    env = {"LD_LIBRARY_PATH": str(fake_libcuda), "STUB_LOG": str(tmp_path / "daemon.log")}
    d = start_daemon(runtime_dir, "--devices", "0", "--pool-mb", "16", backend="cuda_vmm", env=env)
    yield d
    rc = d.stop()
    _, err = d.proc.communicate()
    assert rc == 0, err


def _run(fake_libcuda: Path, tmp_path: Path, d: Daemon, scenario: str, **env: str) -> str:
    return fake_cuda.run(fake_libcuda, tmp_path / f"{scenario}.log", scenario,
                         {"MMFEAT_RUNTIME_DIR": str(d.runtime_dir), **env})


def _no_misuse(log: str) -> None:
    assert "!!" not in log, log


def test_a_parcels_gpu_view_that_dies_under_a_queued_kernel_is_acked_after_the_kernel(
        fake_libcuda, gpu_daemon, tmp_path) -> None:
    log = _run(fake_libcuda, tmp_path, gpu_daemon, "parcel_view_dies_under_a_kernel",
               FAKE_CUDA_SCENARIO_DESC=_feature(gpu_daemon).to_bytes().hex())
    assert "=== views dropped with a kernel queued; still live: True" in log, log
    assert "=== acked once the kernel is done: True" in log, log
    _no_misuse(log)


def test_an_ack_after_another_stream_still_waits_for_the_staged_copy(fake_libcuda, host_daemon, tmp_path) -> None:
    log = _run(fake_libcuda, tmp_path, host_daemon, "staged_ack_names_another_stream")
    assert "=== acked after an idle stream, copy queued; still live: True" in log, log
    assert "=== acked once the copy is done: True" in log, log
    _no_misuse(log)


def test_an_ack_waits_for_every_staged_copy_of_the_feature(fake_libcuda, host_daemon, tmp_path) -> None:
    log = _run(fake_libcuda, tmp_path, host_daemon, "two_staged_gets_one_ack")
    assert "=== acked with the first copy queued; still live: True" in log, log
    assert "=== acked once both copies are done: True" in log, log
    _no_misuse(log)


def test_the_acker_waits_in_the_context_of_the_events_device(fake_libcuda, host_daemon, tmp_path) -> None:
    log = _run(fake_libcuda, tmp_path, host_daemon, "acker_on_device_1")
    assert "=== acked: True" in log, log
    syncs = re.findall(r"^cuEventSynchronize\(event \d+\)\n    \[current ctx (\S+)\]", log, re.M)
    assert syncs and set(syncs) == {"0x1001"}, log
    assert "primary ctx dev 0 CREATED" not in log, "a process that uses only GPU 1 made a context on GPU 0"
    _no_misuse(log)


def test_the_ackers_wait_does_not_break_another_threads_graph_capture(fake_libcuda, host_daemon, tmp_path) -> None:
    log = _run(fake_libcuda, tmp_path, host_daemon, "ack_while_another_thread_captures")
    assert "=== capture: ok; acked: True" in log, log
    assert "capture invalidated" not in log, log


def test_an_ack_behind_a_long_kernel_delays_no_ack_on_another_stream(fake_libcuda, host_daemon, tmp_path) -> None:
    log = _run(fake_libcuda, tmp_path, host_daemon, "long_kernel_delays_no_other_ack")
    assert "=== the short one's ack while the long kernel runs: True" in log, log
    assert "=== the long one's ack meanwhile: False" in log, log
    assert "=== the long one's ack after it: True" in log, log


def test_an_ack_after_a_stream_with_wait_returns_the_daemons_answer_after_the_work(
        fake_libcuda, host_daemon, tmp_path) -> None:
    log = _run(fake_libcuda, tmp_path, host_daemon, "ack_after_and_wait")
    assert "=== returned while the work is queued: False" in log, log
    assert re.search(r"=== answer: \[\{'remaining': 0, 'freed': True, 'over_acked': 0\}\]", log), log


def test_a_dropped_or_discarded_gpu_reservation_comes_back_after_the_kernel_writing_it(
        fake_libcuda, gpu_daemon, tmp_path) -> None:
    log = _run(fake_libcuda, tmp_path, gpu_daemon, "dropped_reservation_under_a_kernel")
    for how in ("drop", "discard"):
        assert f"=== {how}: given back while the kernel is queued: False" in log, log
        assert f"=== {how}: given back after it: True" in log, log
    _no_misuse(log)


def test_a_get_for_device_1_maps_the_pool_for_device_1(fake_libcuda, gpu_daemon, tmp_path) -> None:
    log = _run(fake_libcuda, tmp_path, gpu_daemon, "get_for_device_1",
               FAKE_CUDA_SCENARIO_DESC=_feature(gpu_daemon).to_bytes().hex())
    assert "=== got (4096,)" in log, log
    assert re.search(r"^cuMemSetAccess\(.*dev=1, ", log, re.M), log
    assert not re.search(r"^cuDevicePrimaryCtxRetain\(dev=0\)", log, re.M), "mapped for the current device, not 1"


@pytest.mark.parametrize("where", ["while_another_thread_captures", "in_a_capturing_thread"])
def test_a_gpu_pool_unmapped_by_a_collection_breaks_no_graph_capture(fake_libcuda, gpu_daemon, tmp_path,
                                                                     where) -> None:
    """The unmap synchronises the GPU first, and a collection runs wherever it happens: in a thread that
    captures a graph, the unmap waits for a thread of its own; elsewhere it runs with the thread in
    relaxed capture mode, so another thread's global-mode capture is not invalidated either way."""
    log = _run(fake_libcuda, tmp_path, gpu_daemon, f"pool_unmapped_{where}",
               FAKE_CUDA_SCENARIO_DESC=_feature(gpu_daemon).to_bytes().hex())
    assert "=== capture: ok" in log, log
    assert "capture invalidated" not in log, log
    if where == "in_a_capturing_thread":
        assert "=== unmapped after it: True" in log, log
    else:
        assert "=== unmapped: True" in log, log
    _no_misuse(log)


@pytest.fixture
def host_wait_daemon(fake_libcuda: Path, runtime_dir: Path, tmp_path: Path) -> Iterator[Daemon]:
    env = {"LD_LIBRARY_PATH": str(fake_libcuda), "STUB_LOG": str(tmp_path / "daemon.log"),
           "MMFEAT_GPU_PUBLISH": "host_wait"}
    d = start_daemon(runtime_dir, "--devices", "0", "--pool-mb", "16", backend="cuda_vmm", env=env)
    yield d
    rc = d.stop()
    _, err = d.proc.communicate()
    assert rc == 0, err


def _ready_run(fake_libcuda: Path, tmp_path: Path, d: Daemon, scenario: str, **env: str) -> tuple[str, str]:
    """The scenario's log and its second process's."""
    other = tmp_path / "consumer.log"
    log = _run(fake_libcuda, tmp_path, d, scenario, FAKE_CUDA_CONSUMER_LOG=str(other), **env)
    return log, other.read_text() if other.exists() else ""


@pytest.mark.parametrize("size", [1 << 20, 1 << 16], ids=["reserved lease", "arena"])
def test_a_gpu_feature_is_published_behind_its_fill_and_read_behind_it_on_the_gpu(
        fake_libcuda, gpu_daemon, tmp_path, size) -> None:
    log, consumer = _ready_run(fake_libcuda, tmp_path, gpu_daemon, "publish_behind_the_fill", FAKE_CUDA_SIZE=str(size))
    assert "=== published before the fill was done: True" in log, log
    assert "=== ready before the fill: False" in log, log
    assert "=== ready after the fill: True" in log, log
    assert "=== consumer exited 0" in log, consumer
    # The READY store is the producer stream's, behind the fill: no host wait, no store of its own.
    fill_done = log.index(".. done op 1 'fill'")
    assert re.search(r"\.\. done op \d+ 'write 0x[0-9a-f]+=\d+'", log[fill_done:]), log
    assert "cuEventSynchronize" not in log.split("=== published before")[0], log
    assert "=== the consumer had its view before the fill: True" in log, log
    assert consumer.count("=== said: device 0 writes and waits on READY words on its streams") == 1, consumer
    assert "waits queued on the stream: 1" in consumer, consumer
    assert re.search(r"^cuStreamWaitValue64\(stream \d+, 0x[0-9a-f]+, \d+, flags=0\)", consumer, re.M), consumer
    assert "=== the stream went on: True; ready: True" in consumer, consumer
    assert "=== lookup: live" in consumer, consumer
    _no_misuse(log)
    _no_misuse(consumer)


def test_a_consumer_whose_gpu_cannot_wait_on_the_word_waits_on_the_host(fake_libcuda, gpu_daemon, tmp_path) -> None:
    log, consumer = _ready_run(fake_libcuda, tmp_path, gpu_daemon, "publish_behind_the_fill",
                               FAKE_CUDA_CONSUMER_NO_MEM_OPS="1")
    assert "=== published before the fill was done: True" in log, log
    assert "=== the consumer had its view before the fill: False" in log, log
    assert "=== consumer exited 0" in log, consumer
    assert "waits queued on the stream: 0" in consumer, consumer
    assert "cuStreamWaitValue64" not in consumer, consumer
    # Said once, for the device: nothing else tells an operator that READY words are off there.
    said = "=== said: device 0 has no 64-bit stream memory operations (CAN_USE_64_BIT_STREAM_MEM_OPS is 0)"
    assert consumer.count(said) == 1, consumer


@pytest.mark.parametrize("why", ["the daemon asks for it", "the device has no stream memory operations"])
def test_a_producer_waits_for_its_fill_where_ready_words_are_not_used(
        fake_libcuda, request, tmp_path, why) -> None:
    d = request.getfixturevalue("host_wait_daemon" if why == "the daemon asks for it" else "gpu_daemon")
    env = {} if why == "the daemon asks for it" else {"STUB_NO_STREAM_MEM_OPS": "1"}
    log, _ = _ready_run(fake_libcuda, tmp_path, d, "publish_behind_the_fill", **env)
    assert "=== published before the fill was done: False" in log, log
    assert "=== published after it: True; ready then: True" in log, log
    assert "cuStreamWriteValue64" not in log, log
    _no_misuse(log)


# (scenario, what its log must say, what the other process's log must say)
_PRODUCER_ENDS = {
    "a producer SIGKILLed before its GPU wrote: the consumer's stream goes on and the feature ends": (
        "producer_dies_before_its_gpu_writes",
        ["waits queued on the stream: 1", "=== the stream went on after the producer died: True",
         "=== unready_ended 1"], ["cuStreamWriteValue64"]),
    "a producer that closes behind its fill waits for it, and its feature stays": (
        "close_behind_the_fill",
        ["=== closed before the fill was done: False", "=== closed after it: True", "=== still live, ready: True",
         "=== unready_ended 0"], []),
}


@pytest.mark.parametrize("case", list(_PRODUCER_ENDS))
def test_a_gpu_feature_outlives_its_producer_only_as_far_as_its_gpu_wrote_it(
        fake_libcuda, gpu_daemon, tmp_path, case) -> None:
    scenario, in_log, in_other = _PRODUCER_ENDS[case]
    log, other = _ready_run(fake_libcuda, tmp_path, gpu_daemon, scenario)
    for text in in_log:
        assert text in log, log
    for text in in_other:
        assert text in other, other
    if scenario == "producer_dies_before_its_gpu_writes":
        assert re.search(r"=== a later get: (STALE|LOST)", log), log
        assert re.search(r"=== its waited ack: LOST: .*before its producer.s GPU wrote it", log), log


# (scenario, what its log must say), each a GPU feature whose fill is still queued when others move on
_WHILE_THE_FILL_RUNS = {
    "a slow fill delays no other stream's READY word": (
        "two_fills_on_two_streams",
        ["=== the quick one ready while the slow fill runs: True; the slow one ready: False"]),
    "an arena feature acked before its fill keeps its space until the fill is written": (
        "early_ack_before_the_fill",
        ["=== acked: DONE True; space back before the fill: False", "=== space back after it: True"]),
    "a reserved GPU lease acked before its fill keeps its range until the fill is written": (
        "early_ack_of_a_reserved_lease",
        ["=== a reservation of kind lease", "=== ended: True; range back before the fill: False", "=== unwritten 1",
         "=== range back after it: True; ready: True", "=== unready_ended 1"]),
}


@pytest.mark.parametrize("case", list(_WHILE_THE_FILL_RUNS))
def test_nothing_waits_for_or_lands_in_another_features_fill(fake_libcuda, gpu_daemon, tmp_path, case) -> None:
    scenario, marks = _WHILE_THE_FILL_RUNS[case]
    log = _run(fake_libcuda, tmp_path, gpu_daemon, scenario)
    for text in marks:
        assert text in log, log
    _no_misuse(log)


def test_a_range_kept_for_an_unwritten_feature_goes_back_after_ack_ttl(fake_libcuda, runtime_dir, tmp_path) -> None:
    """A READY word that never comes (a stuck fill, or a peer of the group rewriting the word) keeps the
    range out of the pool for ack_ttl at most, not for the life of its producer's session."""
    for k, ttl in enumerate(ttls(3.0)):
        run = tmp_path / f"try{k}"
        run.mkdir()
        env = {"LD_LIBRARY_PATH": str(fake_libcuda), "STUB_LOG": str(run / "daemon.log")}
        d = start_daemon(runtime_dir, "--devices", "0", "--pool-mb", "16", "--ack-ttl", str(ttl), backend="cuda_vmm",
                         env=env)
        try:
            log = _run(fake_libcuda, run, d, "early_ack_of_a_reserved_lease", FAKE_CUDA_KEEP_CAPPED=str(ttl))
        finally:
            rc = d.stop()
            d.proc.communicate()
        assert rc == 0
        if "=== looked within ack_ttl: True" in log:
            break  # else the range was looked at only after ack_ttl: again, with a longer one
    assert "=== ended: True; range back before the fill: False" in log, log
    assert "=== looked within ack_ttl: True" in log, log
    assert "=== range back with the fill still queued, past ack_ttl: True; ready: True" in log, log
