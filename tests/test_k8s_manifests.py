"""Every manifest under deploy/kubernetes, checked with no cluster: each object against Kubernetes' own API
schemas (kubernetes-validate ships them, so nothing is fetched), then what no schema knows: the config a
ConfigMap carries loads with the daemon's own loader in the environment its DaemonSet gives it, the mesh
key reaches the daemon as a file only its user may read, the Service lists the daemons on the port they
listen on, and every image is the one `make image` builds."""

from __future__ import annotations

import copy
import os
import re
import shlex
import subprocess
import sys
import tempfile
import textwrap
from pathlib import Path
from typing import Any

import pytest
import yaml

from mmfeat.daemon.config import load_settings, tomllib

REPO = Path(__file__).resolve().parent.parent
K8S = REPO / "deploy" / "kubernetes"
# The oldest Kubernetes the manifests are written for; kubernetes-validate >= this version ships its schemas.
KUBERNETES = "1.30"
MANIFESTS = sorted(K8S.rglob("*.yaml"))
MESHED = [p for p in MANIFESTS if p.parent != K8S]
# What the kubelet fills in from the downward API, as a node would.
POD_FIELDS = {"status.podIP": "10.0.0.2", "spec.nodeName": "gpu-node-1"}


def _docs(path: Path) -> list[dict[str, Any]]:
    return [d for d in yaml.safe_load_all(path.read_text()) if d]


def _one(path: Path, kind: str) -> dict[str, Any]:
    found = [d for d in _docs(path) if d["kind"] == kind]
    assert len(found) == 1, f"{path.relative_to(REPO)}: {len(found)} {kind} objects"
    return found[0]


def _pod(path: Path) -> dict[str, Any]:
    return _one(path, "DaemonSet")["spec"]["template"]["spec"]


def _daemon(pod: dict[str, Any]) -> dict[str, Any]:
    return next(c for c in pod["containers"] if c["name"] == "mmfeatd")


def _env(container: dict[str, Any]) -> dict[str, str]:
    """The container's environment as the kubelet makes it: downward API fields filled in, $(VAR) expanded."""
    env: dict[str, str] = {}
    for var in container.get("env", []):
        if "valueFrom" in var:
            env[var["name"]] = POD_FIELDS[var["valueFrom"]["fieldRef"]["fieldPath"]]
        else:
            env[var["name"]] = re.sub(r"\$\((\w+)\)", lambda m: env[m.group(1)], var["value"])
    return env


def _mounts(container: dict[str, Any], pod: dict[str, Any]) -> dict[str, dict[str, Any]]:
    """mountPath -> the volume mounted there."""
    volumes = {v["name"]: v for v in pod["volumes"]}
    return {m["mountPath"]: volumes[m["name"]] for m in container.get("volumeMounts", [])}


def _settings(path: Path, tmp: Path):
    """The daemon's settings from the manifest's ConfigMap, at the path its --config names, in the
    environment the DaemonSet gives the daemon."""
    daemon = _daemon(_pod(path))
    config = Path(daemon["args"][daemon["args"].index("--config") + 1])
    data = _one(path, "ConfigMap")["data"]
    (tmp / config.name).write_text(data[config.name])
    env = {k: v for k, v in _env(daemon).items() if k.startswith("MMFEAT_")}
    settings, _ = load_settings(tmp / config.name, environ=env)
    return settings, config


@pytest.mark.parametrize("path", MANIFESTS, ids=lambda p: str(p.relative_to(K8S)))
def test_every_object_matches_the_kubernetes_schemas(path: Path) -> None:
    """Strict: a field the API does not know fails, where kubectl would drop it with a warning. Each file
    is applied alone, so the namespace its objects name is among them."""
    import kubernetes_validate

    docs = _docs(path)
    assert docs
    for doc in docs:
        kubernetes_validate.validate(doc, KUBERNETES, strict=True)
    namespaces = {d["metadata"]["name"] for d in docs if d["kind"] == "Namespace"}
    assert {d["metadata"]["namespace"] for d in docs if "namespace" in d["metadata"]} <= namespaces


@pytest.mark.parametrize("path", MANIFESTS, ids=lambda p: str(p.relative_to(K8S)))
def test_the_config_loads_with_the_daemons_own_loader(path: Path, tmp_path: Path) -> None:
    settings, config = _settings(path, tmp_path)
    pod = _pod(path)
    daemon = _daemon(pod)
    assert _mounts(daemon, pod)[str(config.parent)]["configMap"]["name"] == _one(path, "ConfigMap")["metadata"]["name"]
    if path not in MESHED:
        assert not settings.listen
        return
    # The mesh binds the node's own address on the configured port; the directories it reads are mounted.
    listen = tomllib.loads(_one(path, "ConfigMap")["data"][config.name])["mesh"]["listen"]
    port = int(listen.rsplit(":", 1)[1])
    assert settings.listen == f"tcp://{POD_FIELDS['status.podIP']}:{port}"
    assert settings.metrics_host == POD_FIELDS["status.podIP"] and settings.node_id == POD_FIELDS["spec.nodeName"]
    assert {p["containerPort"] for p in daemon["ports"] if p["name"] == "mesh"} == {port}
    mounts = _mounts(daemon, pod)
    for directory in (settings.peers_dir, settings.keys_dir):
        if directory is not None:
            assert "configMap" in mounts[str(directory)], f"{directory} is not a mounted ConfigMap"
    assert settings.mesh_secret_file is not None and "emptyDir" in mounts[str(settings.mesh_secret_file.parent)]


@pytest.mark.parametrize("path", MESHED, ids=lambda p: str(p.relative_to(K8S)))
def test_the_mesh_secret_is_mounted_0400_for_the_init_container_alone(path: Path, tmp_path: Path) -> None:
    """The kubelet makes a Secret's files root's whatever the pod says, and an fsGroup would add group
    read; mmfeatd refuses a key others may read. So the Secret is mounted 0400 into an init container
    (root) that copies the node's key, 0400 and the daemon's, into memory the daemon mounts."""
    settings, _ = _settings(path, tmp_path)
    pod = _pod(path)
    secrets = [v for v in pod["volumes"] if "secret" in v]
    assert [v["secret"]["defaultMode"] for v in secrets] == [0o400]
    assert "fsGroup" not in pod["securityContext"]
    assert not any("secret" in v for v in _mounts(_daemon(pod), pod).values()), "the daemon mounts the Secret"
    copier = next(c for c in pod["initContainers"] if secrets[0] in _mounts(c, pod).values())
    memory = _mounts(copier, pod)[str(settings.mesh_secret_file.parent)]
    assert memory["emptyDir"]["medium"] == "Memory"
    uid, gid = pod["securityContext"]["runAsUser"], pod["securityContext"]["runAsGroup"]
    assert f"install -o {uid} -g {gid} -m 0400" in copier["command"][-1]
    assert f"{settings.mesh_secret_file}" in copier["command"][-1]


def test_the_headless_service_lists_every_daemon_on_its_mesh_port(tmp_path: Path) -> None:
    path = K8S / "mesh-dns" / "mmfeatd.yaml"
    settings, _ = _settings(path, tmp_path)
    svc, ds = _one(path, "Service"), _one(path, "DaemonSet")
    pod = ds["spec"]["template"]["spec"]
    assert svc["spec"]["clusterIP"] == "None"
    # Membership is the daemons' own liveness: a pod is a peer from its start to its drain's end.
    assert svc["spec"]["publishNotReadyAddresses"] is True
    assert svc["spec"]["selector"].items() <= ds["spec"]["template"]["metadata"]["labels"].items()
    port = int(settings.listen.rsplit(":", 1)[1])
    assert [(p["port"], p["targetPort"]) for p in svc["spec"]["ports"]] == [(port, port)]
    assert settings.peers_from == "dns"
    assert settings.peers_dns == f"{svc['metadata']['name']}.{svc['metadata']['namespace']}.svc.cluster.local:{port}"
    # A host-network pod asks the node's resolver unless told otherwise, and that knows no Service.
    assert pod["hostNetwork"] is True and pod["dnsPolicy"] == "ClusterFirstWithHostNet"


def test_every_image_is_the_one_make_image_builds() -> None:
    out = subprocess.run(["make", "-n", "image", "CONTAINER_ENGINE=podman"], cwd=REPO, capture_output=True, text=True,
                         timeout=60, check=True).stdout
    build = next(shlex.split(line) for line in out.splitlines() if line.startswith("podman build"))
    image = build[build.index("-t") + 1]
    for path in MANIFESTS:
        pod = _pod(path)
        for c in pod.get("initContainers", []) + pod["containers"]:
            assert c["image"] == image, f"{path.relative_to(REPO)}: {c['name']} runs {c['image']}, not {image}"


def _without_mesh(pod: dict[str, Any]) -> dict[str, Any]:
    """A meshed pod spec less what the mesh adds, to compare with the plain DaemonSet's."""
    pod = copy.deepcopy(pod)
    for key in ("hostNetwork", "dnsPolicy"):
        pod.pop(key)
    mesh_volumes = {v["name"] for v in pod["volumes"] if "secret" in v or "emptyDir" in v or v["name"] in
                    ("public-keys", "peers")}
    pod["volumes"] = [v for v in pod["volumes"] if v["name"] not in mesh_volumes]
    pod["initContainers"] = [c for c in pod["initContainers"] if c["name"] != "mesh-key"]
    c = _daemon(pod)
    c["volumeMounts"] = [m for m in c["volumeMounts"] if m["name"] not in mesh_volumes]
    c["ports"] = [p for p in c["ports"] if p["name"] != "mesh"]
    c["env"] = [e for e in c["env"] if e["name"] in ("NVIDIA_VISIBLE_DEVICES", "NVIDIA_DRIVER_CAPABILITIES")]
    return pod


@pytest.mark.parametrize("path", MESHED, ids=lambda p: str(p.relative_to(K8S)))
def test_a_meshed_daemonset_is_the_plain_one_plus_the_mesh(path: Path) -> None:
    """The variants are whole files, each applied alone: nothing of the plain DaemonSet may drift in them."""
    plain = copy.deepcopy(_pod(K8S / "daemonset.yaml"))
    plain["securityContext"].pop("fsGroup")  # see the previous test
    assert _without_mesh(_pod(path)) == plain
    plain_cfg, cfg = (tomllib.loads(_one(p, "ConfigMap")["data"]["mmfeatd.toml"])
                      for p in (K8S / "daemonset.yaml", path))
    assert cfg["mmfeatd"] == plain_cfg["mmfeatd"] and set(cfg) == {"mmfeatd", "mesh"}


needs_root = pytest.mark.skipif(os.geteuid() != 0, reason="running the init container as the kubelet does needs root")


@needs_root
@pytest.mark.parametrize("path", MESHED, ids=lambda p: str(p.relative_to(K8S)))
def test_the_init_container_hands_the_daemon_its_nodes_key(path: Path, tmp_path: Path) -> None:
    """The init container's command, as root with only its listed capabilities, on a Secret laid out as the
    kubelet lays one out (root's files, mode 0400, behind ..data): the daemon's user can load the copy with
    the daemon's own key loader, and again after a restart; a node with no key in the Secret is told so."""
    settings, _ = _settings(path, tmp_path)
    pod = _pod(path)
    copier = next(c for c in pod["initContainers"] if c["name"] == "mesh-key")
    mounts = _mounts(copier, pod)
    secret_at = next(p for p, v in mounts.items() if "secret" in v)
    node = Path(tempfile.mkdtemp(prefix="mmf-node-", dir="/tmp"))
    node.chmod(0o755)  # the node's /run, /var/lib/kubelet: root's, traversed by all
    try:
        secret, memory = node / "secret", node / "memory"
        data = secret / "..2030_01_01_00_00_00.000000000"
        data.mkdir(parents=True)
        keys = node / "keys"
        subprocess.run([sys.executable, "-m", "mmfeat.daemon", "--gen-keys", str(keys)], check=True,
                       capture_output=True, timeout=60)
        (data / POD_FIELDS["spec.nodeName"]).write_bytes((keys / "mesh.secret").read_bytes())
        (data / POD_FIELDS["spec.nodeName"]).chmod(0o400)
        (secret / "..data").symlink_to(data.name)
        (secret / POD_FIELDS["spec.nodeName"]).symlink_to(f"..data/{POD_FIELDS['spec.nodeName']}")
        memory.mkdir()
        memory.chmod(0o777)  # an emptyDir as the kubelet makes it
        command = [a.replace(secret_at, str(secret)).replace(str(settings.mesh_secret_file.parent), str(memory))
                   for a in copier["command"]]
        caps = ",".join(["-all", *(f"+{c.lower()}" for c in copier["securityContext"]["capabilities"]["add"])])
        as_init = ["setpriv", f"--bounding-set={caps}", "--inh-caps=-all"]
        uid, gid = pod["securityContext"]["runAsUser"], pod["securityContext"]["runAsGroup"]
        copied = memory / settings.mesh_secret_file.name
        as_daemon = ["setpriv", f"--reuid={uid}", f"--regid={gid}", "--clear-groups"]
        probe = subprocess.run([*as_daemon, sys.executable, "-c", "import mmfeat.daemon"], capture_output=True,
                               timeout=60)
        if probe.returncode:
            pytest.skip(f"uid {uid} may not run this checkout's interpreter: {probe.stderr.decode()[-300:]}")
        load = ("import sys; from pathlib import Path; from mmfeat.daemon.mesh.keys import load_secret; "
                "print(load_secret(Path(sys.argv[1]))[0].decode())")
        for _ in range(2):  # the pod's start, then a restart that finds the copy there
            done = subprocess.run([*as_init, *command], capture_output=True, text=True, timeout=60,
                                  env={**os.environ, **_env(copier)})
            assert done.returncode == 0, done.stderr
            st = copied.stat()
            assert (st.st_uid, st.st_gid, st.st_mode & 0o777) == (uid, gid, 0o400)
            loaded = subprocess.run([*as_daemon, sys.executable, "-c", load, str(copied)], capture_output=True,
                                    text=True, timeout=60)
            assert loaded.returncode == 0, loaded.stderr
            assert loaded.stdout.strip() == (keys / "mesh.public").read_text().strip()
        missing = subprocess.run([*as_init, *command], capture_output=True, text=True, timeout=60,
                                 env={**os.environ, "NODE_NAME": "gpu-node-2"})
        assert missing.returncode != 0 and "has no key named gpu-node-2" in missing.stderr, missing.stderr
    finally:
        subprocess.run(["rm", "-rf", str(node)], timeout=60)


_FAKE_KUBECTL = """#!/bin/sh
# kubectl as far as the README's key steps use it: the nodes, and what each create was given.
echo "$*" >> "$KUBECTL_LOG"
case "$*" in
  *"get nodes"*) printf 'gpu-node-1 10.0.0.2\\ngpu-node-2 fd00::3\\n' ;;
esac
"""


def _readme_block(containing: str) -> str:
    text = (K8S / "README.md").read_text()
    blocks = [textwrap.dedent(b) for b in re.findall(r"```sh\n(.*?)```", text, re.S)]
    found = [b for b in blocks if containing in b]
    assert len(found) == 1, f"{len(found)} sh blocks of deploy/kubernetes/README.md hold {containing!r}"
    return found[0]


def test_the_readmes_key_steps_make_what_the_manifests_mount(tmp_path: Path) -> None:
    """deploy/kubernetes/README.md's key loop, run in bash with this checkout's mmfeatd and a kubectl that
    lists two nodes (one IPv6): the Secret and ConfigMaps it creates are the ones the manifests mount, and
    what it files is what the daemon reads there (a secret key per node name, its public key under the
    node's address, a peer file per node)."""
    from mmfeat.daemon.config import Peer
    from mmfeat.daemon.mesh.keys import load_secret

    bin_dir = tmp_path / "bin"
    bin_dir.mkdir()
    (bin_dir / "kubectl").write_text(_FAKE_KUBECTL)
    (bin_dir / "kubectl").chmod(0o755)
    (bin_dir / "mmfeatd").symlink_to(Path(sys.executable).parent / "mmfeatd")
    log = tmp_path / "kubectl.log"
    done = subprocess.run(["bash", "-euc", _readme_block("--gen-keys")], cwd=tmp_path, capture_output=True, text=True,
                          timeout=120, env={**os.environ, "PATH": f"{bin_dir}:{os.environ['PATH']}",
                                            "KUBECTL_LOG": str(log)})
    assert done.returncode == 0, done.stderr
    created = {}  # name -> what it was made from
    for argv in (line.split() for line in log.read_text().splitlines()):
        if "create" in argv and argv[argv.index("create") + 1] in ("secret", "configmap"):
            kind = argv.index("create") + 1
            created[argv[kind + 2 if argv[kind] == "secret" else kind + 1]] = argv[-1]
    keys = tmp_path / "mesh-keys"
    assert os.stat(keys).st_mode & 0o077 == 0, "the secret keys' directory is open to others"
    nodes = {"gpu-node-1": "10.0.0.2", "gpu-node-2": "fd00::3"}
    for node, ip in nodes.items():
        public = load_secret(keys / "secret" / node)[0].decode()
        assert (keys / "public" / ip.replace(":", "-")).read_text().strip() == public
        peer = Peer(**tomllib.loads((keys / "peers" / f"{node}.toml").read_text()))
        assert peer.public_key == public and peer.endpoint.endswith(":7400")
    for path in MESHED:
        pod = _pod(path)
        for volume in pod["volumes"]:
            name = volume.get("secret", {}).get("secretName") or volume.get("configMap", {}).get("name")
            if name and name != _one(path, "ConfigMap")["metadata"]["name"]:
                assert name in created, f"{path.relative_to(REPO)} mounts {name}, which the README never creates"
    assert set(created.values()) == {"--from-file=secret/", "--from-file=public/", "--from-file=peers/"}


def test_the_readme_names_the_files_that_are_there() -> None:
    for named in set(re.findall(r"deploy/kubernetes/[\w./-]+", (K8S / "README.md").read_text())):
        assert (REPO / named.rstrip(".")).exists(), named
