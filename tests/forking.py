"""Forks whose parent holds a lock: what the fork tests' child processes share.

A fork copies each lock as it is, so a lock that a parent thread holds at that moment stays held in the
child, where no thread will release it. ``fork_holding`` makes that moment on purpose; ``reap`` waits,
boundedly, for the child to show it did not wait for ever.
"""

from __future__ import annotations

import contextlib
import os
import signal
import sys
import threading
import time
from typing import Any, Callable, Sequence


def fork_holding(locks: Sequence[Any], call: Callable[[], Any], name: str = "child") -> int:
    """Fork while a thread of this process holds every one of ``locks``; the child runs ``call`` and
    exits 0 if it returns, 1 (printing why) if it raises. The child's pid."""
    import torch

    torch.set_num_threads(1)  # torch's own thread pool does not survive a fork
    held, release = threading.Event(), threading.Event()

    def hold() -> None:
        with contextlib.ExitStack() as stack:
            for lock in locks:
                stack.enter_context(lock)
            held.set()
            release.wait(60)

    t = threading.Thread(target=hold)
    t.start()
    assert held.wait(60)
    pid = os.fork()
    if pid == 0:
        try:
            call()
            code = 0
        except BaseException as exc:
            print(f"{name}: {exc!r}", file=sys.stderr, flush=True)
            code = 1
        os._exit(code)
    release.set()
    t.join(60)
    return pid


def reap(pid: int, hung: str, seconds: float = 30.0) -> int:
    """The forked child's exit status within ``seconds``; killed, and AssertionError(``hung``) raised, if it
    is still running then."""
    deadline = time.monotonic() + seconds
    while time.monotonic() < deadline:
        done, status = os.waitpid(pid, os.WNOHANG)
        if done:
            return status
        time.sleep(0.1)
    os.kill(pid, signal.SIGKILL)
    os.waitpid(pid, 0)
    raise AssertionError(hung)
