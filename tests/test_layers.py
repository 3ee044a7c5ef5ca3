"""The parts depend on each other only as DESIGN.md says: protos on nothing of ours, client and daemon
on protos (and the shared CUDA wrapper in the top package), never on each other."""

from __future__ import annotations

import ast
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).parent.parent
FORBIDDEN = {"protos": ("mmfeat.client", "mmfeat.daemon"), "daemon": ("mmfeat.client",), "client": ("mmfeat.daemon",)}


def _imports(path: Path) -> set[str]:
    names = set()
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.Import):
            names |= {a.name for a in node.names}
        elif isinstance(node, ast.ImportFrom) and node.module and node.level == 0:
            names.add(node.module)
            names |= {f"{node.module}.{a.name}" for a in node.names}
    return names


@pytest.mark.parametrize("part", sorted(FORBIDDEN))
def test_no_part_imports_what_it_must_not(part: str) -> None:
    for path in sorted((ROOT / part).rglob("*.py")):
        for name in _imports(path):
            assert not name.startswith(FORBIDDEN[part]), f"{path.relative_to(ROOT)} imports {name}"


def test_a_daemon_without_a_mesh_loads_none_of_the_meshs_code(daemon) -> None:
    """The mesh's modules, and asyncio that ZeroMQ's authenticator brings, were a tenth of every daemon's
    start-up. A daemon without --listen imports none of them: its module graph, and what the running
    process mapped (asyncio's and NIXL's shared objects, where this Python builds asyncio as one)."""
    code = ("import sys, mmfeat.daemon.main; print(sorted(m for m in sys.modules if m in "
            "('asyncio', 'zmq.auth', 'mmfeat.nixl', 'mmfeat.daemon.mesh', 'mmfeat.daemon.remote', 'mmfeat.daemon.puller')))")
    loaded = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True).stdout.strip()
    assert loaded == "[]", f"importing mmfeatd loads {loaded}"
    maps = Path(f"/proc/{daemon.pid}/maps").read_text()
    assert "/_asyncio." not in maps and "nixl" not in maps.lower(), "a daemon without a mesh mapped asyncio or NIXL"
