"""mmfeatd settings: defaults, then the TOML file, then MMFEAT_* environment variables, then flags.

Each effective value remembers where it came from, for ``mmfeatd --print-config``.
"""

from __future__ import annotations

import os
import socket
import sys
from pathlib import Path
from typing import Any, Literal, Mapping, Optional

from pydantic import BaseModel, ConfigDict, Field, ValidationError, field_validator, model_validator

from mmfeat.protos.paths import default_runtime_dir

if sys.version_info >= (3, 11):
    import tomllib
else:  # pragma: no cover - exercised on 3.10 only
    import tomli as tomllib

ENV_PREFIX = "MMFEAT_"

# name -> one line of help; the order here is the order of --print-config and deploy/mmfeatd.toml.
HELP: dict[str, str] = {
    "runtime_dir": "directory holding mmfeatd.sock and mmfeatd.fds.sock",
    "backend": "auto (cuda_vmm where a CUDA device is usable, else host), host, or cuda_vmm",
    "pool_mb": "pool size in MiB (per device for cuda_vmm)",
    "devices": "CUDA device ordinals that get a pool (cuda_vmm only)",
    "host_pool_mb": "MiB of a host pool beside the GPU pools (cuda_vmm): CPU tensors go there and GPU consumers "
                    "stage them with one DMA each; 0: none",
    "nnodes": "nodes in the NVLink domain; > 1 asks for FABRIC handles where the fabric probe passes",
    "reserve_ttl": "seconds a RESERVED lease may stay unpublished; a later publish is refused, and its range "
                   "stays its producer's until that producer releases it or ends",
    "ack_ttl": "seconds a PUBLISHED lease may wait for its acks before it is freed",
    "max_leases": "live leases at most, over all pools",
    "arena_mb": "MiB of each producer arena (at most a sixteenth of the pool); 0: no arenas, every feature reserves",
    "arena_slots": "features one arena holds at most at a time (lease slots per arena)",
    "arenas_per_session": "arenas one producer may hold at a time",
    "gpu_publish": "auto: producers publish a GPU feature behind their stream's write, with no host wait (a "
                   "lease table READY word the consumers' streams wait on), where the device has stream memory "
                   "operations and this daemon runs no mesh; host_wait: they wait for the write first",
    "ready_ttl": "seconds a GPU feature published behind its stream may wait for that stream's write: clients wait on "
                 "the host for it that long at most, and an ended feature's range is kept for its live producer's "
                 "late write that long at most",
    "max_clients": "client processes at most (fd channels); 0: as many as the fd limit allows, 4 fds each",
    "control_memory_mb": "MiB the daemon may grow by, plus 64 KiB per connection, before it resets its control socket",
    "max_session_mb": "MiB one session's live leases may hold (a stuck producer cannot fill the pool); 0: no limit",
    "max_session_leases": "leases outside arenas (reserved ones) one session may hold at a time; each holds a lease "
                          "table slot that every sweep reads",
    "max_refused_words": "lease table words, in slots one session holds, the daemon may refuse before it cuts that "
                         "session (ends its leases, takes its arenas back, closes its fd channel)",
    "allowed_uids": "uids that may receive pool handles; empty means the daemon's own uid and root",
    "allowed_gids": "gids whose members may receive pool handles; empty means the daemon's own primary group",
    "socket_mode": "file mode of the socket files (octal in TOML as a string, e.g. \"0660\")",
    "log_level": "DEBUG, INFO, WARNING or ERROR",
    "metrics_port": "port of the Prometheus endpoint; 0 turns it off",
    "metrics_host": "address the Prometheus endpoint binds to",
    "drain_timeout": "seconds SIGTERM waits for published leases to be acknowledged",
    "node_id": "name of this node in descriptors; default: the host name",
    "listen": "tcp://ADDRESS:PORT where this daemon meets the daemons of other nodes (CURVE); empty: no mesh",
    "mesh_secret_file": "this node's CURVE secret key (mmfeatd --gen-keys; relative: beside the config file); "
                        "default: systemd's credential, else mesh.secret beside the config file",
    "data_devices": "network devices NIXL's UCX may use for pulls (UCX_NET_DEVICES, e.g. \"mlx5_0:1,eth1\"); "
                    "empty: the interface of listen and every RDMA port",
    "peers_from": "where the mesh's peers come from: static (peers), dns (every address of peers_dns) or dir (the "
                  "peer files in peers_dir); dns and dir are re-read every peers_refresh_s, no restart needed",
    "peers": "the other nodes' daemons (peers_from = static): a list of {endpoint = \"tcp://...\", "
             "public_key = \"...\"}; no other key gets in",
    "peers_dns": "NAME:PORT (peers_from = dns), a headless Service's name: each of its A/AAAA records is a peer "
                 "listening on PORT, whose public key is keys_dir/ADDRESS",
    "peers_dir": "directory of peer files (peers_from = dir), one NAME.toml per node with endpoint and public_key "
                 "(or keys_dir/NAME); a mounted ConfigMap works",
    "keys_dir": "directory of the peers' public keys, one file each named by the peer's address (dns) or peer file "
                "name (dir); a peer without one is refused. Remove a file to revoke its key",
    "peers_refresh_s": "seconds between reads of peers_dns or peers_dir and keys_dir: a peer or key added or removed "
                       "takes effect within this",
    "probe_interval_s": "seconds between probes (pings) of each peer",
    "miss_limit": "probes in a row a peer may leave unanswered before it is missing: no pulls go to it, and it is "
                  "probed on so that it rejoins",
    "forget_after_s": "seconds a peer may be missing before it is forgotten (gone): its incarnation and what it "
                      "announced are dropped, and a peer no longer listed leaves stats",
}

# The settings a [mesh] table of the config file may hold besides the [mmfeatd] table.
MESH_SETTINGS = ("listen", "mesh_secret_file", "data_devices", "peers_from", "peers", "peers_dns", "peers_dir",
                 "keys_dir", "peers_refresh_s", "probe_interval_s", "miss_limit", "forget_after_s")
# Peers a mesh may have at most (each costs the daemon a DEALER and the two ends of its monitor).
MAX_PEERS = 1024

# A host name or IPv4 address, or an IPv6 address in brackets (a dns source's AAAA records).
_TCP = r"^tcp://([^\s:/\[\]]+|\[[0-9A-Fa-f:.]+\]):[0-9]{1,5}$"


class Peer(BaseModel):
    """Another node's daemon: where it listens and the public key it must prove it holds."""

    model_config = ConfigDict(extra="forbid", frozen=True)

    endpoint: str = Field(pattern=_TCP)
    public_key: str = Field(min_length=40, max_length=40)

    @field_validator("public_key")
    @classmethod
    def _z85(cls, v: str) -> str:
        import zmq.utils.z85

        try:
            zmq.utils.z85.decode(v)
        except Exception:
            raise ValueError("public_key is not a Z85 CURVE key (40 characters, from mesh.public)") from None
        return v


class Settings(BaseModel):
    model_config = ConfigDict(extra="forbid", frozen=True)

    runtime_dir: Path = Field(default_factory=default_runtime_dir)
    backend: Literal["auto", "host", "cuda_vmm"] = "auto"
    pool_mb: int = Field(1024, ge=1, le=1 << 22)
    devices: list[int] = Field(default_factory=lambda: [0])
    host_pool_mb: int = Field(0, ge=0, le=1 << 22)
    nnodes: int = Field(1, ge=1, le=1024)
    reserve_ttl: float = Field(30.0, gt=0, le=86400)
    ack_ttl: float = Field(300.0, gt=0, le=7 * 86400)
    max_leases: int = Field(65536, ge=1, le=1 << 24)
    max_session_mb: int = Field(0, ge=0, le=1 << 22)
    max_session_leases: int = Field(4096, ge=1, le=1 << 24)
    max_refused_words: int = Field(4096, ge=1, le=1 << 40)
    arena_mb: int = Field(64, ge=0, le=1 << 20)
    arena_slots: int = Field(256, ge=1, le=1 << 16)
    arenas_per_session: int = Field(4, ge=1, le=1024)
    gpu_publish: Literal["auto", "host_wait"] = "auto"
    ready_ttl: float = Field(60.0, gt=0, le=86400)
    max_clients: int = Field(0, ge=0, le=1 << 20)
    control_memory_mb: int = Field(256, ge=16, le=1 << 20)
    allowed_uids: list[int] = Field(default_factory=list)
    allowed_gids: list[int] = Field(default_factory=list)
    socket_mode: int = Field(0o660, ge=0, le=0o777)
    log_level: Literal["DEBUG", "INFO", "WARNING", "ERROR"] = "INFO"
    metrics_port: int = Field(0, ge=0, le=65535)
    metrics_host: str = "127.0.0.1"
    drain_timeout: float = Field(10.0, ge=0, le=3600)
    node_id: str = Field(default_factory=socket.gethostname, min_length=1, max_length=128)
    listen: str = Field("", pattern=f"^$|{_TCP}")
    mesh_secret_file: Optional[Path] = None
    data_devices: str = Field("", pattern=r"^$|^all$|^[A-Za-z0-9_.@-]+(:[0-9]+)?(,[A-Za-z0-9_.@-]+(:[0-9]+)?)*$")
    peers_from: Literal["static", "dns", "dir"] = "static"
    peers: list[Peer] = Field(default_factory=list, max_length=MAX_PEERS)
    peers_dns: str = Field("", pattern=r"^$|^[A-Za-z0-9_.-]+:[0-9]{1,5}$")
    peers_dir: Optional[Path] = None
    keys_dir: Optional[Path] = None
    peers_refresh_s: float = Field(5.0, gt=0, le=3600)
    probe_interval_s: float = Field(2.0, gt=0, le=600)
    miss_limit: int = Field(3, ge=1, le=1000)
    forget_after_s: float = Field(600.0, gt=0, le=30 * 86400)

    @field_validator("devices")
    @classmethod
    def _devices(cls, v: list[int]) -> list[int]:
        if not v or any(d < 0 for d in v) or len(set(v)) != len(v):
            raise ValueError("devices must be a non-empty list of distinct ordinals >= 0")
        return v

    @field_validator("socket_mode", mode="before")
    @classmethod
    def _octal(cls, v: Any) -> Any:
        return int(v, 8) if isinstance(v, str) else v

    @field_validator("log_level", mode="before")
    @classmethod
    def _upper(cls, v: Any) -> Any:
        return v.upper() if isinstance(v, str) else v

    @model_validator(mode="after")
    def _peers_need_listen(self) -> "Settings":
        if self.peers and not self.listen:
            raise ValueError("peers are set but listen is not: the mesh needs both")
        if self.peers_from != "static" and not self.listen:
            raise ValueError(f"peers_from is {self.peers_from} but listen is not set: the mesh needs both")
        return self

    @model_validator(mode="after")
    def _one_source(self) -> "Settings":
        """Each source reads its own settings and nothing else: a setting another source would read is a
        mistake here, not something to ignore."""
        needs = {"static": (), "dns": ("peers_dns", "keys_dir"), "dir": ("peers_dir",)}[self.peers_from]
        for name in needs:
            if not getattr(self, name):
                raise ValueError(f"peers_from = {self.peers_from} needs {name}")
        if self.peers_from != "static" and self.peers:
            raise ValueError(f"peers lists the static source's peers, but peers_from is {self.peers_from}")
        for name, source in (("peers_dns", "dns"), ("peers_dir", "dir")):
            if getattr(self, name) and self.peers_from != source:
                raise ValueError(f"{name} is read with peers_from = {source} only, not {self.peers_from}")
        if self.keys_dir is not None and self.peers_from == "static":
            raise ValueError("keys_dir is read with peers_from = dns or dir only; static peers carry their keys")
        return self

    @model_validator(mode="after")
    def _liveness_agrees(self) -> "Settings":
        missing_after = self.probe_interval_s * self.miss_limit
        if self.forget_after_s <= missing_after:
            raise ValueError(f"forget_after_s ({self.forget_after_s:g}) must be longer than a peer takes to be "
                             f"missing (probe_interval_s x miss_limit = {missing_after:g} s)")
        return self

    @field_validator("peers")
    @classmethod
    def _distinct_peers(cls, v: list[Peer]) -> list[Peer]:
        if len({p.public_key for p in v}) != len(v) or len({p.endpoint for p in v}) != len(v):
            raise ValueError("each peer needs its own endpoint and public key")
        return v

    def uid_allowed(self, uid: int, gids: set[int]) -> bool:
        # The defaults follow the socket files: they belong to the daemon's user and primary group.
        uids = set(self.allowed_uids) or {os.getuid(), 0}
        allowed_gids = set(self.allowed_gids) or {os.getgid()}
        return uid in uids or bool(gids & allowed_gids)


class ConfigError(Exception):
    """A setting that cannot be used; the message names it and where it came from."""


class MeshConfigError(Exception):
    """The mesh cannot start as configured (found when it starts: keys, the listen address); the
    message says what to change. Here, not in mesh/peers.py, so that a daemon without a mesh never imports it."""


# Fields the daemon may change on SIGHUP without a restart.
RELOADABLE = ("log_level", "reserve_ttl", "ack_ttl", "ready_ttl", "allowed_uids", "allowed_gids", "max_session_mb")


def _from_env(name: str, raw: str) -> Any:
    annotation = Settings.model_fields[name].annotation
    if annotation == list[int]:
        return [int(x) for x in raw.replace(" ", "").split(",") if x]
    if name == "peers":
        raise ValueError("peers come from the config file only")
    return raw


def _file_settings(config_file: Path, data: dict[str, Any]) -> dict[str, Any]:
    """The settings of a config file: its [mmfeatd] table (or its top level), and a [mesh] table (at the
    top level or as [mmfeatd.mesh]) holding mesh settings only."""
    section = dict(data.get("mmfeatd", data))
    tables = [section.pop("mesh", None)]
    if "mmfeatd" in data:
        tables.append(data.get("mesh"))
    for mesh in (t for t in tables if t is not None):
        if not isinstance(mesh, dict):
            raise ConfigError(f"mesh in {config_file} must be a table ([mesh]) of mesh settings")
        for name, value in mesh.items():
            if name not in MESH_SETTINGS:
                raise ConfigError(f"{name!r} is not a mesh setting ([mesh] in {config_file}); mesh settings: "
                                  f"{', '.join(MESH_SETTINGS)}")
            if name in section:
                raise ConfigError(f"{name} is set twice in {config_file}: in [mesh] and outside it")
            section[name] = value
    return section


def load_settings(
    config_file: Optional[Path] = None,
    flags: Optional[Mapping[str, Any]] = None,
    environ: Optional[Mapping[str, str]] = None,
) -> tuple[Settings, dict[str, str]]:
    """Merge the four layers; return the settings and, per setting, where its value came from."""
    environ = os.environ if environ is None else environ
    values: dict[str, Any] = {}
    sources: dict[str, str] = {name: "default" for name in HELP}
    if config_file is not None:
        try:
            data = tomllib.loads(Path(config_file).read_text())
        except (OSError, tomllib.TOMLDecodeError) as exc:
            raise ConfigError(f"cannot read config file {config_file}: {exc}") from None
        for name, value in _file_settings(Path(config_file), data).items():
            if name not in HELP:
                raise ConfigError(f"unknown setting {name!r} in {config_file}; known: {', '.join(HELP)}")
            values[name] = value
            sources[name] = f"file {config_file}"
    for name in HELP:
        var = ENV_PREFIX + name.upper()
        if var in environ:
            try:
                values[name] = _from_env(name, environ[var])
            except ValueError:
                raise ConfigError(f"invalid setting {name} from environment {var}={environ[var]!r}") from None
            sources[name] = f"environment {var}"
    for name, value in (flags or {}).items():
        if value is not None:
            values[name] = value
            sources[name] = "flag"
    if config_file is not None:
        _secret_next_to(Path(config_file), values, sources, environ)
    try:
        settings = Settings(**values)
    except ValidationError as exc:
        lines = []
        for err in exc.errors():
            name = str(err["loc"][0]) if err["loc"] else "?"
            where = ".".join(str(part) for part in err["loc"]) or "settings"  # peers.0.public_key, not just peers
            lines.append(f"invalid setting {where} (from {sources.get(name, 'default')}): "
                         f"{err['msg']}{_unit(name, err)}")
        raise ConfigError("; ".join(lines)) from None
    return settings, sources


def _secret_next_to(config_file: Path, values: dict[str, Any], sources: dict[str, str],
                    environ: Mapping[str, str]) -> None:
    """The key files ``mmfeatd --gen-keys DIR`` writes are looked for where the config is: a relative
    ``mesh_secret_file`` in the file names one beside it, and with none set, ``mesh.secret`` beside the
    config is used unless systemd handed the daemon one (a copy it can read; the file beside the config
    may be root's alone). A relative ``peers_dir`` or ``keys_dir`` in the file is beside it as well."""
    from .mesh.keys import credential

    here = config_file.parent
    for directory in ("peers_dir", "keys_dir"):  # relative in the file: beside it too
        given = values.get(directory)
        if given is not None and sources[directory].startswith("file ") and not Path(given).is_absolute():
            values[directory] = here / given
    name = values.get("mesh_secret_file")
    if name is not None:
        if sources["mesh_secret_file"].startswith("file ") and not Path(name).is_absolute():
            values["mesh_secret_file"] = here / name
        return
    if not values.get("listen") or credential(environ) is not None:
        return
    beside = here / "mesh.secret"
    if beside.exists():
        values["mesh_secret_file"] = beside
        sources["mesh_secret_file"] = f"beside file {config_file}"


# A bound in an error means nothing without its unit: "less than or equal to 4194304" MiB, not bytes.
_UNITS = {"_mb": "MiB", "_ttl": "seconds", "_timeout": "seconds", "_s": "seconds"}
_BOUNDS = ("less_than", "less_than_equal", "greater_than", "greater_than_equal")


def _unit(name: str, err: Mapping[str, Any]) -> str:
    unit = next((u for suffix, u in _UNITS.items() if name.endswith(suffix)), None)
    if unit is None or err.get("type") not in _BOUNDS:
        return ""
    return f" {unit}, not {err.get('input')}"


def adjusted(settings: Settings) -> dict[str, str]:
    """Settings the daemon uses at another value than the one given: name -> the value it uses, and why."""
    notes = {}
    if settings.arena_mb * 16 > settings.pool_mb:
        notes["arena_mb"] = (f"{settings.pool_mb / 16:g}, not {settings.arena_mb}: an arena takes at most a "
                             f"sixteenth of the pool (pool_mb = {settings.pool_mb}), so that a few sessions' "
                             "arenas cannot fill it")
    return notes


def render_config(settings: Settings, sources: Mapping[str, str]) -> str:
    """The effective settings as TOML, each with its help and where it came from."""
    out = ["[mmfeatd]"]
    notes = adjusted(settings)
    for name, help_text in HELP.items():
        value = getattr(settings, name)
        if name == "socket_mode":
            rendered = f'"{value:04o}"'
        elif isinstance(value, (Path, str)):
            rendered = f'"{value}"'
        elif value is None:
            out.append(f"# {help_text}")
            out.append(f"# {name} =   # unset, from {sources[name]}")
            continue
        elif name == "peers":
            rendered = "[" + ", ".join(f'{{endpoint = "{p.endpoint}", public_key = "{p.public_key}"}}'
                                       for p in value) + "]"
        elif isinstance(value, list):
            rendered = "[" + ", ".join(str(v) for v in value) + "]"
        else:
            rendered = str(value)
        out.append(f"# {help_text}")
        out.append(f"{name} = {rendered}  # from {sources[name]}")
        if name in notes:
            out.append(f"# effective {name}: {notes[name]}")
    return "\n".join(out) + "\n"
