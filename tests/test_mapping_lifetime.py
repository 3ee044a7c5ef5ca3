"""How long a host pool and the lease table stay mapped in a client process: while anything the library
handed out views them, and not after. Each attack runs in a process of its own, so that a read of
unmapped memory shows as the SIGSEGV it is instead of ending the test run."""

from __future__ import annotations

import subprocess
import sys

# Every child starts with these: its runtime dir in ``rt`` and ``mapped(name)``, how many mappings of
# that name the process has now (without a garbage collection unless ``collect``).
PROLOGUE = """
import gc, os, sys, threading, time
import torch
from mmfeat.client import Client
rt = sys.argv[1]

def mapped(name="mmfeat-pool0", collect=False):
    if collect:
        gc.collect()
    return open("/proc/self/maps").read().count(name)
"""


def run_child(code: str, *args: str, timeout: float = 120.0) -> str:
    """Run ``code`` after PROLOGUE in a fresh interpreter; its stdout, once it exited 0 (a signal, such
    as SIGSEGV, is a negative return code)."""
    out = subprocess.run([sys.executable, "-c", PROLOGUE + code, *args], capture_output=True, text=True,
                         timeout=timeout)
    assert out.returncode == 0, f"child exited {out.returncode}: {out.stderr[-4000:]}"
    return out.stdout


def test_a_closed_clients_pool_is_unmapped_by_its_last_view_without_a_garbage_collection(daemon) -> None:
    """A closed session refers to nothing that refers back to it, so reference counting frees it and its
    pool mapping goes with the last view: a consumer that outlives its daemon and allocates little
    would otherwise keep the whole pool until a full collection that may not come for a long time."""
    code = """
gc.disable()
c = Client(rt, inline_threshold=0)
d = c.put(torch.arange(100_000, dtype=torch.float32))
view = c.get(d)
c.ack(d)
c.close()
assert mapped() == 1 and float(view[-1]) == 99_999.0, "the view holds the pages"
del view
assert mapped() == 0, "nothing uses the pool, yet it is still mapped"
print("ok")
"""
    assert run_child(code, str(daemon.runtime_dir)).strip() == "ok"
    daemon.wait_for(lambda s: s["pools"][0]["used"] == 0, what="the feature to be freed")
