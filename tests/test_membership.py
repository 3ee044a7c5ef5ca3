"""Where the mesh's peers come from (daemon/mesh/membership.py) and how a peer's liveness moves
(daemon/mesh/liveness.py): the settings that choose a source, peer files and key files as a mounted
ConfigMap lays them out, DNS through the system's resolver, a node finding itself; the daemons that
use them are tested in test_mesh_members.py and, three namespaces apart, test_mesh_cluster.py."""

from __future__ import annotations

import os
import socket
import time
from pathlib import Path

import pytest

from mmfeat.daemon.config import ConfigError, Settings, load_settings
from mmfeat.daemon.mesh import keys as mesh_keys
from mmfeat.daemon.mesh.liveness import GONE, JOINING, MISSING, UP, Cadence, Liveness
from mmfeat.daemon.mesh.membership import Listed, Membership, SourceError
from mmfeat.testing import free_tcp_port


def _key(directory: Path) -> str:
    mesh_keys.generate(directory)
    return (directory / "mesh.public").read_text().strip()


@pytest.fixture
def keys(tmp_path) -> dict[str, str]:
    return {n: _key(tmp_path / f"keys-{n}") for n in ("a", "b", "c", "d")}


def test_each_source_needs_its_own_settings_and_no_other(tmp_path) -> None:
    listen = {"listen": "tcp://127.0.0.1:7400"}
    for kw, needle in (
        ({"peers_from": "dns"}, "peers_dns"),
        ({"peers_from": "dns", "peers_dns": "mesh:7400"}, "keys_dir"),
        ({"peers_from": "dir"}, "peers_dir"),
        ({"keys_dir": tmp_path}, "keys_dir is read with peers_from = dns or dir only"),
        ({"peers_dns": "mesh:7400"}, "peers_dns is read with peers_from = dns only"),
        ({"peers_from": "dir", "peers_dir": tmp_path, "peers_dns": "mesh:7400"}, "peers_dns"),
        ({"forget_after_s": 6.0}, r"forget_after_s \(6\) must be longer"),  # 2 s x 3 misses: not after missing
        ({"peers_dns": "no port"}, "peers_dns"),
    ):
        with pytest.raises(ValueError, match=needle):
            Settings(**listen, **kw)
    with pytest.raises(ValueError, match="listen"):
        Settings(peers_from="dir", peers_dir=tmp_path)
    s = Settings(**listen, peers_from="dns", peers_dns="mesh.example:7400", keys_dir=tmp_path)
    # The defaults agree: a silent peer is missing after 2 s x 3, the source is read more often than
    # that, and it is forgotten only after ack_ttl, the longest a feature of its can live.
    assert (s.probe_interval_s, s.miss_limit, s.peers_refresh_s, s.forget_after_s) == (2.0, 3, 5.0, 600.0)
    assert s.peers_refresh_s < s.probe_interval_s * s.miss_limit and s.forget_after_s > s.ack_ttl
    assert Settings(listen="tcp://[fd00::1]:7400").listen == "tcp://[fd00::1]:7400"


def test_a_mesh_table_holds_mesh_settings_and_relative_directories_are_beside_the_file(tmp_path) -> None:
    cfg = tmp_path / "mmfeatd.toml"
    cfg.write_text('[mmfeatd]\npool_mb = 64\n\n[mesh]\nlisten = "tcp://127.0.0.1:7400"\npeers_from = "dir"\n'
                   'peers_dir = "peers"\nkeys_dir = "/etc/mmfeat/keys"\nmiss_limit = 5\n')
    s, sources = load_settings(cfg, {}, environ={})
    assert (s.pool_mb, s.peers_from, s.peers_dir, s.keys_dir, s.miss_limit) == (
        64, "dir", tmp_path / "peers", Path("/etc/mmfeat/keys"), 5)
    assert sources["peers_dir"] == f"file {cfg}"
    cfg.write_text('[mmfeatd]\n[mesh]\npool_mb = 64\n')
    with pytest.raises(ConfigError, match="'pool_mb' is not a mesh setting"):
        load_settings(cfg, {}, environ={})
    cfg.write_text('[mmfeatd]\nlisten = "tcp://127.0.0.1:7400"\n[mesh]\nlisten = "tcp://127.0.0.1:7401"\n')
    with pytest.raises(ConfigError, match="listen is set twice"):
        load_settings(cfg, {}, environ={})
    s, _ = load_settings(None, {}, environ={"MMFEAT_PEERS_FROM": "dns", "MMFEAT_PEERS_DNS": "m:7400",
                                            "MMFEAT_KEYS_DIR": str(tmp_path), "MMFEAT_LISTEN": "tcp://10.0.0.1:7400"})
    assert (s.peers_from, s.peers_dns, s.keys_dir) == ("dns", "m:7400", tmp_path)


def _dir_source(tmp_path: Path, own: str, keys_dir: Path | None = None) -> tuple[Membership, Path]:
    peers = tmp_path / "peers"
    peers.mkdir(parents=True, exist_ok=True)
    settings = Settings(listen="tcp://127.0.0.1:7400", peers_from="dir", peers_dir=peers, keys_dir=keys_dir)
    return Membership(settings, own), peers


def test_peer_files_list_peers_with_their_keys_and_leave_out_this_node(tmp_path, keys) -> None:
    key_dir = tmp_path / "keys"
    key_dir.mkdir()
    (key_dir / "c").write_text(keys["c"] + "\n")
    members, peers = _dir_source(tmp_path, keys["a"], key_dir)
    (peers / "a.toml").write_text(f'endpoint = "tcp://10.0.0.1:7400"\npublic_key = "{keys["a"]}"\n')  # itself
    (peers / "self-by-address.toml").write_text('endpoint = "tcp://127.0.0.1:7400"\n')  # itself again
    (peers / "b.toml").write_text(f'endpoint = "tcp://10.0.0.2:7400"\npublic_key = "{keys["b"]}"\n')
    (peers / "c.toml").write_text('endpoint = "tcp://10.0.0.3:7400"\n')  # its key from keys_dir/c
    (peers / "d.toml").write_text('endpoint = "tcp://10.0.0.4:7400"\n')  # no key anywhere: listed, refused
    (peers / "e.toml").write_text('endpoint = "tcp://10.0.0.5:7400"\nnode = "e"\n')  # not a peer file
    (peers / "notes.txt").write_text("not a peer")
    (peers / ".hidden.toml").write_text('endpoint = "tcp://10.0.0.6:7400"\n')
    listing = members.read()
    assert listing.peers == (Listed("b", "tcp://10.0.0.2:7400", keys["b"]),
                             Listed("c", "tcp://10.0.0.3:7400", keys["c"]), Listed("d", "tcp://10.0.0.4:7400", None))
    assert listing.addresses == {"10.0.0.2", "10.0.0.3", "10.0.0.4"}
    problems = "\n".join(listing.problems)
    assert "e.toml: unknown key(s) node" in problems and "d.toml has no public_key" in problems, problems
    (peers / "b2.toml").write_text(f'endpoint = "tcp://10.0.0.7:7400"\npublic_key = "{keys["b"]}"\n')
    listing = members.read()
    assert [p.name for p in listing.peers] == ["b", "c", "d"]  # a key listed twice counts once
    assert any("b2 has the key of a peer listed before it" in p for p in listing.problems)


def _configmap(root: Path, version: int, files: dict[str, str]) -> None:
    """What the kubelet does on each change of a mounted ConfigMap: a new timestamped directory, the
    ``..data`` symlink swapped to it atomically, and a symlink per key through ``..data``."""
    data = root / f"..2024_01_0{version}_00_00_00.{version}"
    data.mkdir(parents=True)
    for name, text in files.items():
        (data / name).write_text(text)
    tmp = root / "..data_tmp"
    tmp.symlink_to(data.name)
    os.replace(tmp, root / "..data")
    for name in files:
        if not (root / name).is_symlink():
            (root / name).symlink_to(f"..data/{name}")
    for name in os.listdir(root):
        if not name.startswith(".") and name not in files:
            (root / name).unlink()


def test_a_configmap_change_is_read_whole_and_a_half_written_file_keeps_what_it_held(tmp_path, keys) -> None:
    members, peers = _dir_source(tmp_path, keys["a"])
    b = f'endpoint = "tcp://10.0.0.2:7400"\npublic_key = "{keys["b"]}"\n'
    c = f'endpoint = "tcp://10.0.0.3:7400"\npublic_key = "{keys["c"]}"\n'
    _configmap(peers, 1, {"b.toml": b})
    assert [p.name for p in members.read().peers] == ["b"]
    _configmap(peers, 2, {"b.toml": b.replace("10.0.0.2", "10.0.0.12"), "c.toml": c})  # b moved, c joined
    assert [(p.name, p.endpoint) for p in members.read().peers] == [("b", "tcp://10.0.0.12:7400"),
                                                                    ("c", "tcp://10.0.0.3:7400")]
    _configmap(peers, 3, {"c.toml": c})  # b taken away
    assert [p.name for p in members.read().peers] == ["c"]

    plain, _ = _dir_source(tmp_path / "plain", keys["a"])
    (tmp_path / "plain" / "peers" / "b.toml").write_text(b)
    assert [p.name for p in plain.read().peers] == ["b"]
    (tmp_path / "plain" / "peers" / "b.toml").write_text(b[:30])  # caught half written
    listing = plain.read()
    assert [p.public_key for p in listing.peers] == [keys["b"]] and "b.toml" in listing.problems[0]
    (tmp_path / "plain" / "peers" / "b.toml").unlink()  # removing it is how a peer is taken away
    assert plain.read().peers == ()
    os.rmdir(tmp_path / "plain" / "peers")
    with pytest.raises(SourceError, match="cannot list"):
        plain.read()


def test_dns_lists_every_address_of_the_name_keys_by_address_and_finds_this_node(tmp_path, keys) -> None:
    key_dir = tmp_path / "keys"
    key_dir.mkdir()
    port = free_tcp_port()
    addresses = sorted({i[4][0] for i in socket.getaddrinfo("localhost", port, type=socket.SOCK_STREAM)})
    for k, address in enumerate(addresses):
        (key_dir / address.replace(":", "-")).write_text(keys["bcd"[k]])  # a ConfigMap key cannot hold ":"

    def members(listen_port: int, own: str = keys["a"], name: str = "localhost") -> Membership:
        return Membership(Settings(listen=f"tcp://127.0.0.1:{listen_port}", peers_from="dns",
                                   peers_dns=f"{name}:{port}", keys_dir=key_dir), own)

    assert members(port).read().peers == ()  # every address of localhost is this node's, on its own port
    listing = members(port + 1).read()
    assert [(p.name, p.public_key) for p in listing.peers] == [(a, keys["bcd"[k]]) for k, a in enumerate(addresses)]
    assert listing.peers[0].endpoint.endswith(f":{port}")
    assert addresses[0] not in [p.name for p in members(port + 1, own=keys["b"]).read().peers]  # its own key
    (key_dir / addresses[0].replace(":", "-")).unlink()
    assert members(port + 1).read().peers[0] == Listed(addresses[0], f"tcp://{addresses[0]}:{port}", None)
    failing = members(port + 1, name="no-such-host.invalid")
    with pytest.raises(SourceError, match="cannot resolve no-such-host.invalid"):
        failing.read()


def _until(check, what: str, timeout: float = 20.0):
    deadline = time.monotonic() + timeout
    while not (result := check()):
        assert time.monotonic() < deadline, f"timed out waiting for {what}"
        time.sleep(0.01)
    return result


def test_the_thread_rereads_the_source_and_a_failed_read_keeps_the_last_listing(tmp_path, keys) -> None:
    peers = tmp_path / "peers"
    peers.mkdir()
    (peers / "b.toml").write_text(f'endpoint = "tcp://10.0.0.2:7400"\npublic_key = "{keys["b"]}"\n')
    members = Membership(Settings(listen="tcp://127.0.0.1:7400", peers_from="dir", peers_dir=peers,
                                  peers_refresh_s=0.05), keys["a"])
    members.start()
    try:
        first = _until(members.take, "the first listing")
        assert [p.name for p in first.peers] == ["b"]
        peers.rename(tmp_path / "away")
        error = _until(lambda: members.stats()["error"], "a failed read")
        assert "cannot list" in error and members.take() is None  # nothing new to apply: b stays
        (tmp_path / "away").rename(peers)
        (peers / "c.toml").write_text(f'endpoint = "tcp://10.0.0.3:7400"\npublic_key = "{keys["c"]}"\n')
        listing = _until(members.take, "the listing with c")
        assert [p.name for p in listing.peers] == ["b", "c"] and members.stats()["error"] is None
        assert members.stats()["errors"] >= 1
    finally:
        members.close()


def test_liveness_counts_misses_per_probe_sent_and_has_hysteresis() -> None:
    cadence = Cadence(probe_interval_s=1.0, miss_limit=3, forget_after_s=10.0)
    live = Liveness(changed_at=0.0)
    assert live.state == JOINING and live.probe(0.0, cadence)  # probed as soon as it is listed
    assert not live.probe(0.5, cadence)
    assert live.heard(0.2) == JOINING and live.state == UP
    for t in (1.0, 2.0, 3.0):  # unanswered: the first counts no miss (it answered the one before)
        assert live.probe(t, cadence) and live.due(t, cadence) is None
    assert live.probe(4.0, cadence) and live.misses == 3 and live.due(4.0, cadence) == MISSING
    live.set(MISSING, 4.0)
    assert live.heard(4.1) == MISSING and live.state == UP and live.misses == 0  # back at once
    # A daemon stopped for a long time sends no probes meanwhile: no misses for that time.
    assert live.probe(100.0, cadence) and live.misses == 0 and live.due(100.0, cadence) is None
    for t in (101.0, 102.0, 103.0):
        live.probe(t, cadence)
    live.set(live.due(103.0, cadence) or UP, 103.0)
    assert live.state == MISSING and live.due(112.9, cadence) is None and live.due(113.0, cadence) == GONE
