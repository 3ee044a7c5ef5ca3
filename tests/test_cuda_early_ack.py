"""An arena feature acked before its GPU wrote it (a cancelled request, an ack without after=), on the fake
driver (tests/fake_cuda/early_ack_scenarios.py): the producer publishes behind a fill the fake holds, a
consumer process acks at once without reading. Whatever happens to the arena meanwhile (the sweep ends the
feature, its producer closes, the idle reaper or a size class's hand-back returns the arena, the producer
is SIGKILLed), the range the fill still writes into goes to no other reservation before the fill's READY
word is written, or, its producer dead, before the daemon lets that word go."""

from __future__ import annotations

import re
from pathlib import Path

import pytest

from . import fake_cuda
from .conftest import start_daemon


def _run(fake_libcuda: Path, runtime_dir: Path, tmp_path: Path, scenario: str, *args: str) -> str:
    """The scenario's log, against a daemon of its own over the fake driver's GPU 0 (``args``: its flags)."""
    env = {"LD_LIBRARY_PATH": str(fake_libcuda), "STUB_LOG": str(tmp_path / "daemon.log")}
    d = start_daemon(runtime_dir, "--devices", "0", "--pool-mb", "16", *args, backend="cuda_vmm", env=env)
    try:
        others = {"MMFEAT_RUNTIME_DIR": str(runtime_dir), "FAKE_CUDA_CONSUMER_LOG": str(tmp_path / "other.log")}
        log = fake_cuda.run(fake_libcuda, tmp_path / f"{scenario}.log", scenario, others)
    finally:
        rc = d.stop()
        _, err = d.proc.communicate()
    assert rc == 0, err
    assert "!!" not in log, log
    return log


def test_a_feature_the_sweep_finds_acked_before_its_gpu_wrote_it_keeps_its_range_until_the_write(
        fake_libcuda, runtime_dir, tmp_path) -> None:
    log = _run(fake_libcuda, runtime_dir, tmp_path, "early_ack_in_the_sweeps_batch")
    assert "=== acked before the fill: unwritten 1, unready_ended 1" in log, log
    assert re.search(r"=== its lookup: LOST: .*before its producer's GPU wrote it", log), log
    assert "=== the fill landed: True" in log, log
    # The producer's ring reuses the space once the word is written: the daemon takes that feature at once.
    assert "=== the next feature in its space: True; taken: True" in log, log
    assert "=== range back after the fill: True" in log, log


# (scenario, daemon flags, what its log must say)
_ARENA_GOES_BACK = {
    "its producer closes": (
        "close_with_an_early_acked_feature", [],
        ["=== close waits for the fill: True",
         "=== arenas back before the fill: False; the next producer's range over the feature: False",
         "=== closed after the fill: True", "=== arenas back after it: True"]),
    "the idle reaper": (
        "reap_with_an_early_acked_feature", [],
        ["=== the reaper kept it: True; the next producer's range over the feature: False",
         "=== the fill landed: True", "=== the reaper gives it back after the fill: True"]),
    "a size class's hand-back": (
        "hand_back_with_an_early_acked_feature", ["--arenas-per-session", "1"],
        ["=== a reservation of kind lease; the usual arena kept: True; its range over the feature: False",
         "=== the fill landed: True"]),
}


@pytest.mark.parametrize("case", list(_ARENA_GOES_BACK))
def test_an_arena_goes_back_only_once_the_gpu_wrote_what_was_acked_early(
        fake_libcuda, runtime_dir, tmp_path, case) -> None:
    scenario, flags, marks = _ARENA_GOES_BACK[case]
    log = _run(fake_libcuda, runtime_dir, tmp_path, scenario, *flags)
    for text in marks:
        assert text in log, log


def test_a_dead_producers_early_acked_feature_keeps_its_range_until_the_daemon_lets_its_word_go(
        fake_libcuda, runtime_dir, tmp_path) -> None:
    log = _run(fake_libcuda, runtime_dir, tmp_path, "producer_killed_after_an_early_ack")
    # Ended as unwritten, so kept: its range goes back only after the grace for a dead producer's GPU work.
    assert ("=== its session ended: True; the next producer's range over the feature while it was kept: False; "
            "unready_ended 1") in log, log
    assert "=== let go after its grace: True; its word: True" in log, log
