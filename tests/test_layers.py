"""The parts depend on each other only as docs/design.md ("Parts") says: protos on nothing of ours,
client and daemon on protos (and the shared CUDA wrapper in the top package), never on each other; and
none of them on the tools (the `mmfeat` command, the bench, the helpers that start daemons), which a
producer or consumer process never loads. Inside them no module imports itself back through others,
and the wings of the daemon and of the client import each other and their tops only as
docs/design.md says."""

from __future__ import annotations

import ast
import inspect
import shutil
import subprocess
import sys
from pathlib import Path
from typing import Optional

import pytest

ROOT = Path(__file__).parent.parent
TOOLS = ("mmfeat.bench", "mmfeat.cli", "mmfeat.testing")
# The client parses no command line either: flags are a tool's, and a tool inside the client package
# would be loaded by every process that imports it.
FORBIDDEN = {"protos": ("mmfeat.client", "mmfeat.daemon", *TOOLS), "daemon": ("mmfeat.client", *TOOLS),
             "client": ("mmfeat.daemon", "argparse", *TOOLS)}


def _package(path: Path) -> list[str]:
    """The package a file of a part belongs to: client/x.py is in mmfeat.client, daemon/pools/y.py in
    mmfeat.daemon.pools."""
    return ["mmfeat", *path.parent.relative_to(ROOT).parts]


def _imports(path: Path) -> set[str]:
    names = set()
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.Import):
            names |= {a.name for a in node.names}
        elif isinstance(node, ast.ImportFrom):
            # A relative import names its module from the file's package: `from ..cli import main` in
            # client/ is mmfeat.cli as surely as the absolute spelling is.
            package = _package(path)
            base = package[: len(package) - node.level + 1] if node.level else []
            module = ".".join(base + ([node.module] if node.module else []))
            names.add(module)
            names |= {f"{module}.{a.name}" for a in node.names}
    return names


def _under(name: str, prefixes: tuple[str, ...]) -> bool:
    return any(name == p or name.startswith(p + ".") for p in prefixes)


@pytest.mark.parametrize("part", sorted(FORBIDDEN))
def test_no_part_imports_what_it_must_not(part: str) -> None:
    for path in sorted((ROOT / part).rglob("*.py")):
        for name in _imports(path):
            assert not _under(name, FORBIDDEN[part]), f"{path.relative_to(ROOT)} imports {name}"


def test_importing_the_whole_client_loads_no_tool() -> None:
    """What a producer or consumer process imports: every module of mmfeat.client, in a fresh interpreter.
    None of the tools' modules may come with it."""
    code = ("import importlib, pkgutil, sys, mmfeat.client as c\n"
            "for m in pkgutil.walk_packages(c.__path__, 'mmfeat.client.'):\n"
            "    importlib.import_module(m.name)\n"
            "from mmfeat.client import Client, Parcel, Pooled, dumps, loads\n"
            "print(' '.join(sorted(m for m in sys.modules if m.startswith('mmfeat.'))))")
    r = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=300)
    assert r.returncode == 0, r.stderr[-3000:]
    loaded = r.stdout.split()
    assert "mmfeat.client.client" in loaded and "mmfeat.client.parcel" in loaded, loaded
    tools = [m for m in loaded if _under(m, TOOLS)]
    assert not tools, f"importing mmfeat.client loads {tools}"


def test_a_daemon_without_a_mesh_loads_none_of_the_meshs_code(daemon) -> None:
    """The mesh's modules, and asyncio that ZeroMQ's authenticator brings, were a tenth of every daemon's
    start-up. A daemon without --listen imports none of them: its module graph, and what the running
    process mapped (asyncio's and NIXL's shared objects, where this Python builds asyncio as one)."""
    code = ("import sys, mmfeat.daemon.main; print(sorted(m for m in sys.modules if m in "
            "('asyncio', 'zmq.auth', 'mmfeat.nixl') or m.startswith('mmfeat.daemon.mesh')))")
    loaded = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True).stdout.strip()
    assert loaded == "[]", f"importing mmfeatd loads {loaded}"
    maps = Path(f"/proc/{daemon.pid}/maps").read_text()
    assert "/_asyncio." not in maps and "nixl" not in maps.lower(), "a daemon without a mesh mapped asyncio or NIXL"


def test_only_protos_envelope_makes_request_and_reply_frames() -> None:
    """The envelope is written once (protos/envelope.py) and used at both ends: no client or daemon module
    spells out a frame's envelope ({"v": ..., "op"/"ok": ...}) by hand, where it could drift from the
    other end's. The fd channel's handshake (protos/handshake.py) is its own message, not a request;
    client/bench's transport benchmark times raw ZeroMQ frames of its own, which no daemon reads."""
    offenders = []
    for part in ("client", "daemon"):
        for path in sorted((ROOT / part).rglob("*.py")):
            if "bench" in path.relative_to(ROOT).parts:
                continue
            for node in ast.walk(ast.parse(path.read_text())):
                if isinstance(node, ast.Dict):
                    keys = {k.value for k in node.keys if isinstance(k, ast.Constant)}
                    if "v" in keys and keys & {"op", "ok", "id"}:
                        offenders.append(f"{path.relative_to(ROOT)}:{node.lineno}")
            if "ENVELOPE_FIELDS" in path.read_text():
                offenders.append(f"{path.relative_to(ROOT)} strips the envelope's fields itself")
    assert not offenders, f"frames built or read by hand, not with mmfeat.protos.envelope: {offenders}"


def test_a_put_in_flight_travels_as_one_object() -> None:
    """The producer's path (client/produce/producer.py) and the zero-copy one (client/produce/reservations.py) hand a
    feature on its way into the pool from step to step as one PutInFlight (client/produce/put_in_flight.py), not
    as loose (tensors, specs, nbytes, many, ...) arguments each step must pass on in the same order."""
    loose = {"specs", "nbytes", "many", "tensors", "consumers"}
    offenders = []
    for name in ("producer.py", "reservations.py"):
        path = ROOT / "client" / "produce" / name
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.FunctionDef) and node.name.startswith("_"):  # put and reserve make one
                args = {a.arg for a in node.args.args + node.args.kwonlyargs}
                if len(args & loose) >= 2:
                    offenders.append(f"{name}:{node.lineno} {node.name}({', '.join(sorted(args & loose))})")
    assert not offenders, f"a put's parts passed loose instead of as a PutInFlight: {offenders}"


PARTS = ("protos", "client", "daemon")
# What each wing of the daemon may import of the daemon outside itself: other wings, and modules of the
# daemon's top by name. The top (server, dispatch, handlers, main, core, ...) may import any wing.
WINGS = {
    "leases": set(),
    "sockets": {"leases"},
    "pools": {"config"},
    "mesh": {"leases", "sockets", "config", "core"},
}


def _module(root: Path, path: Path) -> str:
    parts = ["mmfeat", *path.relative_to(root).with_suffix("").parts]
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def _graph(root: Path) -> dict[str, set[str]]:
    """Module -> the modules of the three parts it imports, anywhere in it: at the top, in a function, or
    for type checking alone (a circle a checker must follow is a circle a reader must follow too)."""
    files = {_module(root, p): p for part in PARTS for p in (root / part).rglob("*.py")}
    graph = {}
    for name, path in files.items():
        package = name.split(".") if path.name == "__init__.py" else name.split(".")[:-1]
        deps = set()
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.Import):
                deps |= {a.name for a in node.names if a.name in files}
            elif isinstance(node, ast.ImportFrom):
                base = package[: len(package) - node.level + 1] if node.level else []
                module = ".".join(base + ([node.module] if node.module else []))
                # `from . import x` imports the submodule x, not what the package's __init__ imports.
                for a in node.names:
                    sub = f"{module}.{a.name}"
                    deps.add(sub if sub in files else module)
        graph[name] = {d for d in deps if d in files and d != name}
    return graph


def _cycle(graph: dict[str, set[str]]) -> Optional[list[str]]:
    """A circle of imports (its modules, the first repeated at the end), or None."""
    done: set[str] = set()
    for start in sorted(graph):
        if start in done:
            continue
        path, on_path = [start], {start}
        stack = [iter(sorted(graph[start]))]
        while stack:
            nxt = next(stack[-1], None)
            if nxt is None:
                stack.pop()
                node = path.pop()
                done.add(node)
                on_path.discard(node)
                continue
            if nxt in on_path:
                return path[path.index(nxt):] + [nxt]
            if nxt not in done:
                path.append(nxt)
                on_path.add(nxt)
                stack.append(iter(sorted(graph[nxt])))
    return None


def test_no_module_imports_itself_back() -> None:
    circle = _cycle(_graph(ROOT))
    assert circle is None, "an import circle: " + " -> ".join(circle or [])


def test_a_planted_circle_is_found(tmp_path: Path) -> None:
    """The check above must see a circle that exists only for the type checker."""
    for part in PARTS:
        shutil.copytree(ROOT / part, tmp_path / part)
    lease = tmp_path / "daemon" / "leases" / "lease.py"
    lease.write_text(lease.read_text() + "\nif False:\n    from .ledger import Ledger\n")
    circle = _cycle(_graph(tmp_path))
    assert circle is not None and {"mmfeat.daemon.leases.lease", "mmfeat.daemon.leases.ledger"} <= set(circle), circle


# The same for the client's wings. Its top holds the Client and dumps/loads, which may import any wing,
# and the modules the wings share (SHARED), which import nothing of the client: no wing imports the top
# above it, link/ and gpu/ nothing of either side, and neither side the other.
CLIENT_WINGS = {
    "gpu": {"neutral"},
    "link": {"gpu", "fork_locks", "neutral"},
    "produce": {"link", "gpu", "fork_locks", "neutral", "policy", "tensors"},
    "consume": {"link", "gpu", "fork_locks", "neutral", "policy", "tensors"},
}
CLIENT_TOP = {"arguments", "client", "parcel"}
SHARED = {"fork_locks", "neutral", "policy", "tensors"}
LEAVES = {"fork_locks", "neutral"}  # shared modules the other shared ones may import: they import nothing of ours


def _wing(module: str) -> str:
    """leases, sockets, mesh or pools (produce, consume, link or gpu) for a module of a wing; the module's
    own name for one of the top."""
    return module.split(".")[2] if module.count(".") >= 2 else ""


def _wing_offences(graph: dict[str, set[str]], part: str, wings: dict[str, set[str]]) -> list[str]:
    prefix = f"mmfeat.{part}"
    offences = []
    for module, deps in sorted(graph.items()):
        if not module.startswith(prefix + ".") or _wing(module) not in wings:
            continue
        wing = _wing(module)
        for dep in sorted(deps):
            if dep.startswith(prefix + ".") and _wing(dep) != wing and _wing(dep) not in wings[wing]:
                offences.append(f"{module} (wing {wing}) imports {dep}: not in the wing's rules")
    return offences


def test_the_daemons_wings_import_as_documented() -> None:
    graph = _graph(ROOT)
    wings = {m.split(".")[2] for m in graph if m.startswith("mmfeat.daemon.") and m.count(".") >= 3}
    assert wings == set(WINGS), f"the daemon's wings are {sorted(wings)}; docs/design.md and WINGS say {sorted(WINGS)}"
    assert not _wing_offences(graph, "daemon", WINGS)


def test_the_clients_wings_import_as_documented() -> None:
    graph = _graph(ROOT)
    client = {m for m in graph if m.startswith("mmfeat.client.")}
    wings = {_wing(m) for m in client if m.count(".") >= 3}
    assert wings == set(CLIENT_WINGS), \
        f"the client's wings are {sorted(wings)}; docs/design.md and CLIENT_WINGS say {sorted(CLIENT_WINGS)}"
    top = {_wing(m) for m in client if _wing(m) not in CLIENT_WINGS}
    assert top == CLIENT_TOP | SHARED, f"the client's top holds {sorted(top)}: a new module there is either " \
        "of the top (CLIENT_TOP) or shared by the wings (SHARED), or it belongs in a wing"
    offences = _wing_offences(graph, "client", CLIENT_WINGS)
    for name in sorted(SHARED):
        allowed = {f"mmfeat.client.{leaf}" for leaf in LEAVES} if name not in LEAVES else set()
        offences += [f"mmfeat.client.{name} (shared) imports {dep}" for dep in sorted(graph[f"mmfeat.client.{name}"])
                     if dep.startswith("mmfeat.client") and dep not in allowed]
    assert not offences, offences


def test_a_planted_back_arrow_between_the_clients_wings_is_found(tmp_path: Path) -> None:
    """The check above must see an arrow from the link back up to the producer's side, even one that
    exists only for the type checker."""
    for part in PARTS:
        shutil.copytree(ROOT / part, tmp_path / part)
    session = tmp_path / "client" / "link" / "session.py"
    session.write_text(session.read_text() + "\nif False:\n    from ..produce.producer import Producer\n")
    offences = _wing_offences(_graph(tmp_path), "client", CLIENT_WINGS)
    assert offences == ["mmfeat.client.link.session (wing link) imports mmfeat.client.produce.producer: "
                        "not in the wing's rules"], offences


# What `mmfeat.client` offers a user, besides its submodules: the names some load on first use included.
PUBLIC = {"Client", "DaemonUnavailableError", "Descriptor", "ErrorCode", "FdLimitError", "MAX_KEY_BYTES",
          "MAX_LOOKUP_KEYS", "MmfeatError", "Namespace", "Parcel", "PeerUnavailableError", "Pooled", "dumps", "loads"}


def test_the_clients_public_names_stay_put() -> None:
    """Each public name resolves, from a fresh interpreter, to the same object wherever a user reaches it
    (Client and the parcel's names load on first use), and the package offers no other (its typing
    helpers and submodules aside)."""
    code = ("import json, types, mmfeat.client as c, mmfeat.protos as p\n"
            "from mmfeat.client import *  # noqa: F403\n"
            "star = sorted(k for k in dir() if k in c.__all__)\n"
            "from mmfeat.client.client import Client\n"
            "from mmfeat.client import parcel\n"
            "same = {n: getattr(c, n) is (Client if n == 'Client' else getattr(parcel, n, None) or getattr(p, n))\n"
            "        for n in c.__all__}\n"
            "offered = sorted(n for n in dir(c) if not n.startswith('_') and n not in ('Any', 'TYPE_CHECKING')\n"
            "                 and not isinstance(getattr(c, n), types.ModuleType))\n"
            "print(json.dumps({'all': sorted(c.__all__), 'star': star, 'same': same, 'offered': offered}))")
    r = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=300)
    assert r.returncode == 0, r.stderr[-3000:]
    import json

    got = json.loads(r.stdout)
    assert set(got["all"]) == PUBLIC and len(got["all"]) == len(PUBLIC), got["all"]
    assert got["star"] == sorted(PUBLIC), got["star"]
    assert all(got["same"].values()), got["same"]
    assert set(got["offered"]) <= PUBLIC, f"mmfeat.client offers {sorted(set(got['offered']) - PUBLIC)} too"


def _same_signatures(protocol: type, cls: type, names: tuple[str, ...]) -> None:
    for name in names:
        want, got = inspect.signature(getattr(protocol, name)), inspect.signature(getattr(cls, name))
        assert list(want.parameters.items()) == list(got.parameters.items()), \
            f"{cls.__name__}.{name}{got} is not {want}"


def test_the_protocols_that_cut_circles_match_what_they_stand_for() -> None:
    """The Protocols that name a module's counterpart without importing it stay true to it."""
    from mmfeat.daemon.core import Remote
    from mmfeat.daemon.mesh.remote import RemoteFeatures

    _same_signatures(Remote, RemoteFeatures, ("get", "relay_ack"))
