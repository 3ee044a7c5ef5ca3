"""The parts depend on each other only as DESIGN.md says: protos on nothing of ours, client and daemon
on protos (and the shared CUDA wrapper in the top package), never on each other."""

from __future__ import annotations

import ast
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
