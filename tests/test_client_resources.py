"""A producer short of fds, a daemon SIGKILLed under its clients, a feature too large to go inline: put
returns (inline, counted) or raises a typed error, at once, and never kills or hangs its process."""

from __future__ import annotations

import fcntl
import os
import subprocess
import sys
import threading
import time
from pathlib import Path

import pytest
import torch

from mmfeat.client import Client
from mmfeat.protos import DaemonUnavailableError, ErrorCode, MmfeatError

from . import fd_workers


def _put_short_of_fds(children, runtime_dir: Path, free: int, connect_first: bool) -> dict:
    receive, send = children.Pipe(duplex=False)
    p = children.Process(target=fd_workers.put_with_free_fds, args=(str(runtime_dir), free, connect_first, send))
    p.start()
    send.close()
    result = None
    try:
        try:
            result = receive.recv() if receive.poll(60) else None
        except EOFError:
            pass  # it died before sending: its exit code says how
        p.join(30)
    finally:
        if p.is_alive():
            p.kill()
            p.join()
        receive.close()
    assert p.exitcode == 0, f"with {free} fds free the producer died (exit code {p.exitcode}; negative: a signal)"
    assert result is not None, f"with {free} fds free the producer sent nothing"
    return result


@pytest.mark.parametrize("free", range(11))
def test_a_producer_short_of_fds_falls_back_inline_and_lives(daemon, children, free: int) -> None:
    result = _put_short_of_fds(children, daemon.runtime_dir, free, connect_first=False)
    if "error" in result:  # allowed: a typed error; say which in a failure
        assert result["error"] in ("FdLimitError", "MmfeatError", "DaemonUnavailableError"), result
    else:
        assert result["intact"], result
        assert not result["inline"] or result["fallbacks"] == {"fd_limit": 1}, result
    assert daemon.pool()["used"] == 0


def test_fd_limit_fallbacks_are_what_a_starved_producer_gets(daemon, children) -> None:
    """With no fd to spare the put goes inline, counted as fd_limit; with plenty it uses the pool; a
    producer that connected first needs no new fd to put."""
    starved = _put_short_of_fds(children, daemon.runtime_dir, 0, connect_first=False)
    assert starved == {"inline": True, "fallbacks": {"fd_limit": 1}, "intact": True}
    roomy = _put_short_of_fds(children, daemon.runtime_dir, 64, connect_first=False)
    assert roomy == {"inline": False, "fallbacks": {}, "intact": True}
    connected = _put_short_of_fds(children, daemon.runtime_dir, 0, connect_first=True)
    assert connected == {"inline": False, "fallbacks": {}, "intact": True}
