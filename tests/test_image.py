"""The container image: deploy/container/Containerfile, `make image` and the DaemonSet that runs it agree.

No container engine runs here or in CI, so the image itself is not built in `make test`;
test_wheel.py runs what the image runs (the wheel, without torch, the daemon and its health probe).
"""

from __future__ import annotations

import json
import re
import shlex
import subprocess
from pathlib import Path

import yaml

REPO = Path(__file__).resolve().parent.parent
DEPLOY = REPO / "deploy"


def _instructions() -> list[tuple[str, str]]:
    text = (DEPLOY / "container" / "Containerfile").read_text().replace("\\\n", " ")
    lines = [line.strip() for line in text.splitlines() if line.strip() and not line.lstrip().startswith("#")]
    return [(line.split(None, 1)[0].upper(), line.split(None, 1)[1]) for line in lines]


def _daemonset_container() -> tuple[dict, dict]:
    ds = next(d for d in yaml.safe_load_all((DEPLOY / "kubernetes" / "daemonset.yaml").read_text())
              if d["kind"] == "DaemonSet")
    pod = ds["spec"]["template"]["spec"]
    return pod, pod["containers"][0]


def test_the_containerfile_runs_mmfeatd_as_the_daemonsets_user() -> None:
    ins = dict(_instructions())  # one of each that matters
    pod, c = _daemonset_container()
    assert json.loads(ins["ENTRYPOINT"]) == ["mmfeatd"]
    assert "command" not in c, "the DaemonSet must keep the image's entry point and pass args only"
    assert json.loads(ins["CMD"]) == c["args"], "the image's default arguments and the DaemonSet's differ"
    uid, gid = (int(x) for x in ins["USER"].split(":"))
    assert uid != 0 and (uid, gid) == (pod["securityContext"]["runAsUser"], pod["securityContext"]["runAsGroup"])
    assert int(ins["EXPOSE"]) == c["ports"][0]["containerPort"]
    run = ins["RUN"]
    assert "--extra cuda" in run and "--without torch" in run and "--no-deps" in run and "mmfeatd --print-config" in run
    assert f"--uid {uid}" in run and f"--gid {gid}" in run


def test_make_image_builds_the_image_the_daemonset_names() -> None:
    _, c = _daemonset_container()
    out = subprocess.run(["make", "-n", "image", "CONTAINER_ENGINE=podman"], cwd=REPO, capture_output=True, text=True,
                         timeout=300, check=True).stdout
    build = next(shlex.split(line) for line in out.splitlines() if line.startswith("podman build"))
    assert build[build.index("-t") + 1] == c["image"]
    assert build[build.index("-f") + 1] == "deploy/container/Containerfile"
    context = build[-1]
    assert f"-w {context}" in out and f"cp deploy/container/requirements.py {context}/" in out


def test_make_image_without_an_engine_says_what_it_needs() -> None:
    r = subprocess.run(["make", "image", "CONTAINER_ENGINE="], cwd=REPO, capture_output=True, text=True, timeout=300)
    assert r.returncode != 0 and "needs podman, buildah or docker" in r.stdout + r.stderr


def test_the_docs_name_the_image_the_daemonset_runs() -> None:
    """The image is a placeholder until an operator pushes one: every doc that names a registry names the
    one the manifest and `make image` use, so that following either gives the same name."""
    _, c = _daemonset_container()
    registry = c["image"].split("/")[0]
    for doc in (REPO / "README.md", DEPLOY / "kubernetes" / "README.md"):
        named = set(re.findall(r"registry\.example\.[a-z]+", doc.read_text()))
        assert named <= {registry}, f"{doc.name} names {named - {registry}}; the DaemonSet runs {c['image']}"
