"""A mesh set up as the README says starts: the key files mmfeatd --gen-keys writes are found beside the
config, or where systemd hands them over."""

from __future__ import annotations

import re
import shutil
import subprocess
import sys
import tempfile
from pathlib import Path

from .cluster import _free_port, _gen_keys
from .conftest import Daemon, start_daemon

README = (Path(__file__).parent.parent / "README.md").read_text()


def _stop(d: Daemon) -> str:
    """Stop ``d`` (it must exit 0 on SIGTERM) and give its log."""
    rc = d.stop()
    _, err = d.proc.communicate()
    shutil.rmtree(d.runtime_dir, ignore_errors=True)
    assert rc == 0, err[-2000:]
    return err


def test_the_readmes_mesh_example_starts_a_daemon_as_written(tmp_path) -> None:
    etc = tmp_path / "etc-mmfeat"  # /etc/mmfeat in the README
    command = re.search(r"^mmfeatd --gen-keys /etc/mmfeat\b", README, re.M)
    assert command is not None, "the README's key command changed; update this test with it"
    r = subprocess.run([sys.executable, "-m", "mmfeat.daemon", "--gen-keys", str(etc)], capture_output=True, text=True,
                       timeout=60)
    assert r.returncode == 0, r.stderr
    example = re.search(r"```toml\n# /etc/mmfeat/mmfeatd.toml on node A\n(.*?)```", README, re.S)
    assert example is not None, "the README's mesh example changed; update this test with it"
    other_key = _gen_keys(tmp_path / "node-b")
    port, other_port = _free_port(), _free_port()
    # Only what cannot be the same here changes: the addresses, and the placeholder for B's key.
    config = (example.group(1).replace("10.0.0.1:7400", f"127.0.0.1:{port}")
              .replace("10.0.0.2:7400", f"127.0.0.1:{other_port}").replace("<node B's mesh.public>", other_key))
    (etc / "mmfeatd.toml").write_text(config)
    runtime = Path(tempfile.mkdtemp(prefix="mmf-readme-", dir="/tmp"))
    d = start_daemon(runtime, "--config", str(etc / "mmfeatd.toml"), "--pool-mb", "8")
    mesh = d.stats()["mesh"]
    assert mesh["listen"] == f"tcp://127.0.0.1:{port}"
    assert mesh["public_key"] == (etc / "mesh.public").read_text().strip()  # the key beside the config
    _stop(d)

    # Under systemd the unit's mesh drop-in hands over a copy in $CREDENTIALS_DIRECTORY, which wins over
    # the file beside the config (that one may be root's alone).
    creds = tmp_path / "credentials"
    handed = _gen_keys(creds)
    d = start_daemon(runtime, "--config", str(etc / "mmfeatd.toml"), "--pool-mb", "8",
                     env={"CREDENTIALS_DIRECTORY": str(creds)})
    assert d.stats()["mesh"]["public_key"] == handed
    _stop(d)

    # A relative mesh_secret_file is beside the config, wherever the daemon runs from.
    (etc / "keys").mkdir()
    (etc / "mesh.secret").rename(etc / "keys" / "mesh.secret")
    (etc / "mmfeatd.toml").write_text(config + 'mesh_secret_file = "keys/mesh.secret"\n')
    d = start_daemon(runtime, "--config", str(etc / "mmfeatd.toml"), "--pool-mb", "8")
    assert d.stats()["mesh"]["public_key"] == (etc / "mesh.public").read_text().strip()
    _stop(d)
