"""The package as an sdist and a wheel, outside this checkout: what a node that runs `pip install` on a
checkout, a git URL or a built wheel gets."""

from __future__ import annotations

import re
import shutil
import subprocess
import sys
import tempfile
import time
import venv
from dataclasses import dataclass
from pathlib import Path
from typing import Iterator

import pytest

REPO = Path(__file__).resolve().parent.parent

_USE = """
import sys, torch
from pathlib import Path
site = sys.argv[2]
import mmfeat.client, mmfeat.daemon, mmfeat.protos
for m in (mmfeat.client, mmfeat.daemon, mmfeat.protos):
    assert m.__file__.startswith(site), f"{m.__name__} came from {m.__file__}, not the wheel"
from mmfeat.client import Client
from mmfeat.testing import spawn_daemon
from importlib.resources import files
assert "Protocol version" in files("mmfeat.protos").joinpath("SPEC.md").read_text()  # package data
d = spawn_daemon(Path(sys.argv[1]), ["--pool-mb", "16", "--backend", "host"])
try:
    with Client(sys.argv[1], inline_threshold=0) as c:
        x = torch.arange(50_000, dtype=torch.float32)
        desc = c.put(x)
        assert not desc.is_inline and torch.equal(c.get(desc), x)
        c.ack(desc)
    print("wheel ok")
finally:
    d.terminate()
    assert d.wait(30) == 0
"""


@dataclass
class Installed:
    wheel: Path
    sdist: Path
    prefix: Path
    site: Path

    def bin(self, name: str) -> str:
        return str(self.prefix / "bin" / name)


def _fresh_venv(prefix: Path) -> Path:
    """A venv without mmfeat whose dependencies come from the test environment through a .pth line (the
    registry is not needed, and torch is not installed twice); that path holds no mmfeat (the checkout is
    installed editable, through a finder that a plain path line does not run). Returns its site dir."""
    venv.create(prefix, with_pip=False, symlinks=True)
    purelib = "import sysconfig; print(sysconfig.get_path('purelib'))"
    site = Path(subprocess.run([str(prefix / "bin" / "python"), "-c", purelib], capture_output=True, text=True,
                               check=True).stdout.strip())
    deps = [p for p in sys.path if p.endswith("site-packages")]
    (site / "test-dependencies.pth").write_text("\n".join(deps) + "\n")
    return site


@pytest.fixture(scope="module")
def installed(tmp_path_factory) -> Installed:
    """The wheel built from a copy of the sources and installed into a fresh venv (_fresh_venv), as `pip
    install` would, console scripts included."""
    tmp = tmp_path_factory.mktemp("wheel")
    src = tmp / "src"
    # A copy of the sources alone: a build/ left in the checkout could put stale modules in the wheel.
    shutil.copytree(REPO, src, ignore=shutil.ignore_patterns(".git", ".venv*", "build", "*.egg-info", "__pycache__",
                                                             ".whl", ".pytest_cache", "dist"))
    dist, fresh = tmp / "dist", tmp / "venv"
    pip = [sys.executable, "-m", "pip", "-q", "--disable-pip-version-check"]
    # As README's Install says: an sdist, then the wheel built from that sdist (so the sdist is complete).
    # --no-isolation: the build tools come from this environment, not from a registry.
    built = subprocess.run([sys.executable, "-m", "build", "--no-isolation", "--outdir", str(dist), str(src)],
                           capture_output=True, text=True, timeout=600)
    assert built.returncode == 0, built.stdout[-3000:] + built.stderr[-3000:]
    # Byte-compiling is off wherever PYTHONDONTWRITEBYTECODE is set; any other warning is the project's.
    warned = [line for line in (built.stdout + built.stderr).splitlines()
              if re.search(r"warning|deprecat", line, re.I) and "byte-compiling is disabled" not in line]
    assert not warned, warned
    wheels, sdists = list(dist.glob("mmfeat-*.whl")), list(dist.glob("mmfeat-*.tar.gz"))
    assert len(wheels) == 1 and len(sdists) == 1, (wheels, sdists)
    site = _fresh_venv(fresh)
    subprocess.run([*pip, "--python", str(fresh / "bin" / "python"), "install", "--no-deps", "--no-compile",
                    str(wheels[0])], check=True, timeout=300)
    return Installed(wheels[0], sdists[0], fresh, site)


@pytest.fixture
def short_runtime_dir() -> Iterator[Path]:
    runtime = Path(tempfile.mkdtemp(prefix="mmf-wheel-", dir="/tmp"))  # AF_UNIX paths are short
    yield runtime
    shutil.rmtree(runtime, ignore_errors=True)


def test_the_wheel_installs_and_serves_outside_the_checkout(installed, tmp_path, short_runtime_dir) -> None:
    config = subprocess.run([installed.bin("mmfeatd"), "--print-config"], cwd=tmp_path, capture_output=True,
                            text=True, timeout=300)
    assert config.returncode == 0 and "pool_mb" in config.stdout and "arena_mb" in config.stdout, config.stderr
    used = subprocess.run([installed.bin("python"), "-c", _USE, str(short_runtime_dir), str(installed.site)],
                          cwd=tmp_path, capture_output=True, text=True, timeout=300)
    assert used.returncode == 0 and "wheel ok" in used.stdout, used.stderr[-3000:]


# Runs a console script's module with torch unimportable, as in the container image.
_WITHOUT_TORCH = ("import runpy, sys; sys.modules['torch'] = None; sys.argv[0] = {name!r}; "
                  "runpy.run_module({module!r}, run_name='__main__')")


def test_the_image_installs_no_torch_and_its_daemon_and_probes_need_none(installed, tmp_path,
                                                                          short_runtime_dir) -> None:
    """deploy/container/Containerfile installs the wheel's requirements less torch: the daemon and the
    `mmfeat health` probe of the DaemonSet must run without it."""
    listed = subprocess.run([sys.executable, str(REPO / "deploy" / "container" / "requirements.py"),
                             str(installed.wheel), "--extra", "cuda", "--without", "torch"],
                            capture_output=True, text=True, check=True, timeout=300).stdout.splitlines()
    names = {re.match(r"[A-Za-z0-9._-]+", line).group(0).lower() for line in listed}
    assert ({"pyzmq", "msgpack", "pydantic", "numpy", "cuda-python", "nvidia-ml-py"} <= names
            and "torch" not in names), listed
    assert not any("extra" in line for line in listed), listed  # pip would skip a line whose marker names an extra
    daemon = subprocess.Popen(
        [installed.bin("python"), "-c", _WITHOUT_TORCH.format(name="mmfeatd", module="mmfeat.daemon"), "--runtime-dir",
         str(short_runtime_dir), "--backend", "host", "--pool-mb", "8"],
        cwd=tmp_path, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
    )
    try:
        probe = [installed.bin("python"), "-c", _WITHOUT_TORCH.format(name="mmfeat", module="mmfeat.cli"),
                 "--runtime-dir", str(short_runtime_dir), "--timeout", "2", "health"]
        deadline = time.monotonic() + 300  # a busy machine takes many seconds to start it
        while subprocess.run(probe, cwd=tmp_path, capture_output=True, timeout=300).returncode != 0:
            assert daemon.poll() is None, daemon.communicate()[1][-3000:]
            assert time.monotonic() < deadline, "the daemon without torch never answered the health probe"
            time.sleep(0.2)
    finally:
        daemon.terminate()
        _, err = daemon.communicate(timeout=30)
    assert daemon.returncode == 0, err[-3000:]


def test_the_gpu_runs_wheel_slimmer_drops_a_folder_and_its_record_lines(tmp_path) -> None:
    """tests/gpu/slim_wheel.py makes NIXL's wheel fit the device run's carry: what it repacks still installs,
    without the dropped folder, and pip's RECORD of it names no dropped file."""
    import zipfile

    from tests.gpu.slim_wheel import slim

    wheel = tmp_path / "demo-1.0-py3-none-any.whl"
    files = {"demo/__init__.py": "X = 1\n", "demo_ep/big.bin": "x" * 100_000,
             "demo-1.0.dist-info/METADATA": "Metadata-Version: 2.1\nName: demo\nVersion: 1.0\n",
             "demo-1.0.dist-info/WHEEL": ("Wheel-Version: 1.0\nGenerator: test\nRoot-Is-Purelib: true\n"
                                          "Tag: py3-none-any\n")}
    record = "".join(f"{name},,\n" for name in files) + "demo-1.0.dist-info/RECORD,,\n"
    with zipfile.ZipFile(wheel, "w") as z:
        for name, text in {**files, "demo-1.0.dist-info/RECORD": record}.items():
            z.writestr(name, text)
    dropped, size = slim(str(wheel), ["demo_ep"])
    assert dropped == 1 and size < 10_000
    with zipfile.ZipFile(wheel) as z:
        assert "demo_ep/big.bin" not in z.namelist() and "demo_ep" not in z.read("demo-1.0.dist-info/RECORD").decode()
    target = tmp_path / "site"
    subprocess.run([sys.executable, "-m", "pip", "install", "-q", "--no-index", "--no-deps", "--target", str(target),
                    str(wheel)], check=True, timeout=300)
    assert (target / "demo" / "__init__.py").exists() and not (target / "demo_ep").exists()


_RECORD_ARGS = '#!/bin/sh\nprintf "%s\\n" "$(basename "$0") $*" >> "{log}"\n'


def test_the_containerfiles_build_steps_run_as_a_script(installed, tmp_path) -> None:
    """No container engine runs here (and no base image can be pulled): the Containerfile's COPY and RUN
    steps run as a shell script instead, against a fresh venv standing in for the base image's Python.
    pip may not reach a registry (--no-index): the requirements it lists must already be met, as the test
    environment meets them. groupadd and useradd only record their arguments, so the host's users stay
    as they are."""
    pytest.importorskip("nixl_cu12", reason="the image installs the [mesh] extra: make setup installs it")
    steps = (REPO / "deploy" / "container" / "Containerfile").read_text().replace("\\\n", " ").splitlines()
    copy = next(line.split()[1:] for line in steps if line.startswith("COPY "))
    run = next(line.split(None, 1)[1] for line in steps if line.startswith("RUN "))
    staged = tmp_path / "stage"
    staged.mkdir()
    assert copy[-1] == "/tmp/mmfeat/" and copy[:-1] == ["mmfeat-*.whl", "requirements.py"], copy
    shutil.copy(installed.wheel, staged)
    shutil.copy(REPO / "deploy" / "container" / "requirements.py", staged)
    tools, log = tmp_path / "bin", tmp_path / "useradd.log"
    tools.mkdir()
    image = tmp_path / "image"
    site = _fresh_venv(image)
    pip = f'#!/bin/sh\nexec {sys.executable} -m pip --python {image / "bin" / "python"} "$@"\n'
    recorder = _RECORD_ARGS.format(log=log)
    for name, text in {"groupadd": recorder, "useradd": recorder, "pip": pip}.items():
        (tools / name).write_text(text)
        (tools / name).chmod(0o755)
    env = {"PATH": f"{tools}:{image / 'bin'}:/usr/bin:/bin", "PIP_NO_INDEX": "1", "HOME": str(tmp_path)}
    done = subprocess.run(["sh", "-c", run.replace("/tmp/mmfeat/", f"{staged}/").replace("/tmp/mmfeat", str(staged))],
                          cwd=tmp_path, env=env, capture_output=True, text=True, timeout=600)
    assert done.returncode == 0, done.stderr[-3000:]
    assert not staged.exists(), "the build step leaves its staging dir in the image"
    assert (site / "mmfeat" / "daemon" / "main.py").exists() and (image / "bin" / "mmfeatd").exists()
    user = next(line.split(None, 1)[1] for line in steps if line.startswith("USER ")).strip()
    uid, gid = user.split(":")
    assert log.read_text().splitlines() == [f"groupadd --system --gid {gid} mmfeat",
                                            f"useradd --system --uid {uid} --gid {gid} --no-create-home --home-dir "
                                            "/nonexistent --shell /usr/sbin/nologin mmfeat"]
