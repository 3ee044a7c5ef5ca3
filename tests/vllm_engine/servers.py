"""`vllm serve` instances for tests/test_vllm_engine.py, and the encoder-disaggregated routing of vLLM's
own proxy (examples/online_serving/disaggregated_encoder) in front of them.

Each server runs in a process group of its own (its API server, EngineCore and workers), on a port
that was free when it started (another is tried if something took it meanwhile), is waited for by its
``/health`` and stopped by signalling that group, then killing what is left, and reaping it, whatever
the test did. Its output goes to a log file whose tail is in every error about it.
"""

from __future__ import annotations

import base64
import io
import json
import os
import signal
import socket
import subprocess
import time
import urllib.error
import urllib.request
from pathlib import Path
from typing import Any, Optional

START_S = 900.0  # an engine start on two busy cores; a server that has not answered by then failed
REQUEST_S = 300.0  # one chat completion on that machine


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


class ServerError(RuntimeError):
    pass


class Server:
    """One ``vllm serve MODEL`` with ``args``, started by ``start`` and stopped by ``stop``."""

    def __init__(self, venv: str, model: Path, name: str, log_dir: Path, args: list[str],
                 env: Optional[dict[str, str]] = None) -> None:
        self.name, self.model, self.args, self.env = name, model, args, env or {}
        self.python = str(Path(venv) / "bin" / "python")
        self.log = log_dir / f"{name}.log"
        self.proc: Optional[subprocess.Popen] = None
        self.port = 0

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    def start(self) -> "Server":
        """Starts the server, without waiting for it (``wait`` does): servers start side by side."""
        self.port = free_port()
        cmd = [self.python, str(Path(__file__).parent / "serve.py"), str(self.model), "--host", "127.0.0.1",
               "--port", str(self.port), "--load-format", "dummy", "--dtype", "bfloat16", "--max-model-len", "256",
               "--enforce-eager", "--seed", "0", "--kv-cache-memory-bytes", str(64 << 20), *self.args]
        with open(self.log, "a") as log:
            log.write(f"$ {' '.join(cmd)}\n")
            log.flush()
            self.proc = subprocess.Popen(cmd, stdout=log, stderr=subprocess.STDOUT, start_new_session=True,
                                         env={**os.environ, "HF_HUB_OFFLINE": "1", **self.env})
        return self

    def wait(self, timeout: float = START_S) -> "Server":
        """Until ``/health`` answers 200; a server that exits first failed (on a port taken meanwhile,
        it is started again on another)."""
        deadline = time.monotonic() + timeout
        for attempt in range(3):
            while time.monotonic() < deadline:
                if self.proc.poll() is not None:
                    break
                try:
                    with urllib.request.urlopen(self.url + "/health", timeout=10) as r:
                        if r.status == 200:
                            return self
                except (urllib.error.URLError, OSError):
                    pass
                time.sleep(0.5)
            else:
                raise ServerError(f"{self.name} did not answer /health in {timeout:.0f} s:\n{self.tail()}")
            if "address already in use" not in self.tail().lower() or attempt == 2:
                raise ServerError(f"{self.name} exited {self.proc.returncode} before it served:\n{self.tail()}")
            self.start()
        raise AssertionError("unreachable")

    def tail(self, chars: int = 6000) -> str:
        return self.log.read_text(errors="replace")[-chars:] if self.log.exists() else ""

    def alive(self) -> bool:
        return self.proc is not None and self.proc.poll() is None

    def stop(self) -> Optional[int]:
        """SIGTERM to the server's process group, SIGKILL to what is left of it after 60 s, and reaped."""
        if self.proc is None:
            return None
        for sig, grace in ((signal.SIGTERM, 60.0), (signal.SIGKILL, 30.0)):
            try:
                os.killpg(self.proc.pid, sig)
            except ProcessLookupError:
                pass
            try:
                self.proc.wait(timeout=grace)
            except subprocess.TimeoutExpired:
                continue
            if _group_gone(self.proc.pid):
                break
        rc = self.proc.returncode
        return rc

    def chat(self, body: dict[str, Any]) -> tuple[int, dict[str, Any]]:
        """POST /v1/chat/completions: the status and the JSON answer (an error's too)."""
        req = urllib.request.Request(self.url + "/v1/chat/completions", data=json.dumps(body).encode(),
                                     headers={"Content-Type": "application/json"})
        try:
            with urllib.request.urlopen(req, timeout=REQUEST_S) as r:
                return r.status, json.loads(r.read())
        except urllib.error.HTTPError as e:
            return e.code, json.loads(e.read() or b"{}")


def ec_args(role: str, extra: dict[str, Any], connector: str = "MmfeatECConnector",
            module: str = "mmfeat.integrations.vllm") -> list[str]:
    """``--ec-transfer-config`` for ``role``: mmfeat's connector by configuration alone, unless the test
    names another class and module (tests/vllm_engine/trap_connector.py)."""
    return ["--ec-transfer-config", json.dumps({"ec_connector": connector, "ec_connector_module_path": module,
                                                "ec_role": role, "ec_connector_extra_config": extra})]


def _group_gone(pgid: int) -> bool:
    try:
        os.killpg(pgid, 0)
    except ProcessLookupError:
        return True
    return False


def image_url(seed: int) -> str:
    """The seeded random 56x56 picture of engine.py (4 image tokens) as a base64 data URL."""
    import numpy as np
    from PIL import Image

    im = Image.fromarray((np.random.RandomState(seed).rand(56, 56, 3) * 255).astype("uint8"))
    buf = io.BytesIO()
    im.save(buf, format="PNG")
    return "data:image/png;base64," + base64.b64encode(buf.getvalue()).decode("ascii")


def chat_body(model: Path, seeds: list[int], text: str = "w1 w2", max_tokens: int = 8) -> dict[str, Any]:
    content = [{"type": "image_url", "image_url": {"url": image_url(s)}} for s in seeds]
    return {"model": str(model), "messages": [{"role": "user", "content": [*content, {"type": "text", "text": text}]}],
            "max_tokens": max_tokens, "temperature": 0, "return_token_ids": True}


def epd_chat(encoder: Server, consumer: Server, body: dict[str, Any]) -> tuple[int, dict[str, Any]]:
    """The routing of vLLM's disagg_encoder proxy: each image alone, without the text, to the encoder
    (ec_producer) with max_tokens 1, then the whole request to the consumer, which finds each item by
    its key. Each encoder request's ec_transfer_params (the producer's connector names a descriptor
    there for a consumer on another node) go with the consumer's request."""
    params: dict[str, Any] = {}
    for item in body["messages"][0]["content"]:
        if item["type"] != "image_url":
            continue
        status, answer = encoder.chat({"model": body["model"], "messages": [{"role": "user", "content": [item]}],
                                       "max_tokens": 1, "stream": False})
        if status != 200:
            raise ServerError(f"the encoder answered {status}: {answer}")
        params.update(answer.get("ec_transfer_params") or {})
    return consumer.chat({**body, "ec_transfer_params": params} if params else body)


class Deployment:
    """The servers of the online tests, started side by side and each waited for, and all stopped and
    reaped by ``stop`` (which ``with`` calls whatever happened): a plain server, an encode-only
    producer, and two consumer instances on its items."""

    def __init__(self, servers: dict[str, Server]) -> None:
        self.servers = servers

    def __getitem__(self, name: str) -> Server:
        return self.servers[name]

    def __enter__(self) -> "Deployment":
        try:
            for s in self.servers.values():
                s.start()
            for s in self.servers.values():
                s.wait()
        except BaseException:
            self.stop()
            raise
        return self

    def __exit__(self, *exc: object) -> None:
        self.stop()

    def stop(self) -> dict[str, Optional[int]]:
        return {name: s.stop() for name, s in self.servers.items()}
