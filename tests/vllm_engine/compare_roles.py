"""The four processes of tests/vllm_engine/compare.py: a producer instance's scheduler and worker, a consumer
instance's scheduler and worker, each holding one EC connector built by vLLM's own factory, and each
timing the connector's calls it makes, in the order vLLM 0.32's scheduler and model runner make them.

vLLM's own objects wherever they are cheap: ECTransferConfig, ParallelConfig, Request, MultiModalFeatureSpec,
SchedulerOutput and ECConnectorOutput; on the workers vLLM's parallel state (the mmfeat connector asks it
for the rank), ``ensure_ec_transfer_initialized`` and the model runner's ``ECConnectorModelRunnerMixin``,
which binds the step's metadata, starts the saves and loads, and collects the worker's report exactly as
a model runner does. The one stand-in is the model config: a real ModelConfig needs a model on disk and
loads its HF config and processor, and the connectors read only its name and dtype.

Each process serves calls from the driver over a pipe and answers with the call's result and the seconds
each connector call took. No digest, tensor fill or clean-up is inside a timed call.
"""

from __future__ import annotations

import cProfile
import dataclasses
import hashlib
import logging
import os
import pickle
import shutil
import time
import traceback
from typing import Any, Callable, Optional

import torch
from vllm.config import ECTransferConfig, ParallelConfig, VllmConfig, set_current_vllm_config
from vllm.distributed.ec_transfer import ec_transfer_state
from vllm.distributed.ec_transfer.ec_connector.base import ECConnectorRole
from vllm.distributed.ec_transfer.ec_connector.factory import ECConnectorFactory
from vllm.distributed.parallel_state import ensure_model_parallel_initialized, init_distributed_environment
from vllm.multimodal.inputs import MultiModalFeatureSpec, PlaceholderRange
from vllm.sampling_params import SamplingParams
from vllm.v1.core.sched.output import CachedRequestData, SchedulerOutput
from vllm.v1.outputs import ECConnectorOutput
from vllm.v1.request import Request, RequestStatus
from vllm.v1.worker.ec_connector_model_runner_mixin import ECConnectorModelRunnerMixin

# Imported by the forkserver once for all eight processes, not in each: the connector, and the slow
# modules vLLM's ParallelConfig and VllmConfig import on first use.
import mmfeat.integrations.vllm.connector  # noqa: F401
import vllm._aiter_ops  # noqa: F401
import vllm.v1.executor  # noqa: F401

from .compare_table import item_shape

IMAGE_TOKEN = 151655  # any id: no tokenizer reads it
CONNECTORS = {"mmfeat": ("MmfeatECConnector", "mmfeat.integrations.vllm"), "example": ("ECExampleConnector", None)}


@dataclasses.dataclass(frozen=True)
class ModelConfigStandIn:
    """What the connectors read of vllm.config.ModelConfig: the model's name and dtype (mmfeat's namespace),
    and the object itself for vLLM's PlaceholderMetadataResolver. The resolver finds no processor for it
    and so publishes no placeholder fields, the same for both connectors."""

    model: str = "ec-compare/encoder"
    dtype: torch.dtype = torch.bfloat16


@dataclasses.dataclass
class VllmConfigStandIn:
    """The three fields of vllm.config.VllmConfig that the connectors and their factory read."""

    ec_transfer_config: ECTransferConfig
    model_config: ModelConfigStandIn
    parallel_config: ParallelConfig


def vllm_config(connector: str, ec_role: str, extra: dict[str, Any]) -> VllmConfigStandIn:
    name, module = CONNECTORS[connector]
    return VllmConfigStandIn(ECTransferConfig(ec_connector=name, ec_connector_module_path=module, ec_role=ec_role,
                                              ec_connector_extra_config=extra),
                             ModelConfigStandIn(), ParallelConfig())


def digest(t: torch.Tensor) -> str:
    return hashlib.sha256(t.contiguous().view(torch.uint8).numpy()).hexdigest()


class Timer:
    """Seconds per connector call, summed under a name; the calls alone go into the profile, if any."""

    def __init__(self, profile: Optional[cProfile.Profile]) -> None:
        self.profile, self.seconds = profile, {}

    def __call__(self, name: str, fn: Callable[..., Any], *args: Any, **kw: Any) -> Any:
        if self.profile is not None:
            self.profile.enable()
        t = time.perf_counter()
        try:
            return fn(*args, **kw)
        finally:
            self.seconds[name] = self.seconds.get(name, 0.0) + time.perf_counter() - t
            if self.profile is not None:
                self.profile.disable()

    def take(self) -> dict[str, float]:
        out, self.seconds = self.seconds, {}
        return out


def make_request(rid: str, h: str, tokens: int, ec_params: Optional[dict[str, Any]]) -> Request:
    """A request of one image of ``tokens`` embeddings between two text tokens, with the params an
    orchestrator copied from the producer's answer (``None`` for the producer)."""
    extra = {"ec_transfer_params": ec_params} if ec_params else None
    feature = MultiModalFeatureSpec(data=None, modality="image", identifier=h, mm_hash=h,
                                    mm_position=PlaceholderRange(offset=1, length=tokens))
    return Request(rid, [0, *[IMAGE_TOKEN] * tokens, 0], SamplingParams(max_tokens=2, extra_args=extra), None,
                   mm_features=[feature])


def scheduler_output(request: Request, tokens: int, encoder_inputs: bool) -> SchedulerOutput:
    return SchedulerOutput(scheduled_new_reqs=[], scheduled_cached_reqs=CachedRequestData.make_empty(),
                           num_scheduled_tokens={request.request_id: tokens}, total_num_scheduled_tokens=tokens,
                           scheduled_spec_decode_tokens={},
                           scheduled_encoder_inputs={request.request_id: [0]} if encoder_inputs else {},
                           finished_req_ids=set(), free_encoder_mm_hashes=[])


class SchedulerRole:
    """An instance's scheduler half, in the EngineCore process. One request per item, one item per request;
    a producer's request ends in the step that encoded it (encode-only), a consumer's after one more step."""

    def __init__(self, connector: str, ec_role: str, extra: dict[str, Any], profile: bool) -> None:
        # The stand-in model config has no processor for vLLM's resolver to find; it says so once per
        # process, with a traceback, for both connectors alike.
        logging.getLogger("vllm.distributed.ec_transfer.ec_connector.utils").setLevel(logging.ERROR)
        self.name, self.extra = connector, extra
        self.config = vllm_config(connector, ec_role, extra)
        self.connector = ECConnectorFactory.create_connector(self.config, ECConnectorRole.SCHEDULER)
        self.profile = cProfile.Profile() if profile else None
        self.timer = Timer(None)
        self.requests: dict[str, Request] = {}

    def warm(self, warm: bool) -> None:
        """Profile the calls from now on (warm rounds) or not."""
        self.timer.profile = self.profile if warm else None

    def schedule(self, rid: str, h: str, tokens: int, ec_params: Optional[dict[str, Any]]) -> tuple[Any, bool, dict]:
        """The first step: the request is waiting, its item is not in the encoder cache."""
        c, timer = self.connector, self.timer
        request = self.requests[rid] = make_request(rid, h, tokens, ec_params)
        request.status = RequestStatus.RUNNING
        if not timer("ensure_cache_available", c.ensure_cache_available, request, 0):
            raise RuntimeError(f"{self.name}: ensure_cache_available deferred {h} on one node")
        found = timer("has_cache_item", c.has_cache_item, h)
        timer("update_state_after_alloc", c.update_state_after_alloc, request, 0)
        so = scheduler_output(request, tokens + 2, True)
        so.ec_connector_metadata = timer("build_connector_meta", c.build_connector_meta, so)
        return pickle.dumps(so), found, timer.take()

    def first_output(self, rid: str, output: bytes) -> tuple[Any, dict]:
        """update_from_output of the first step. An encode-only request ends here, before the workers'
        report is read; a consumer's item is in the KV cache now and its encoder input is freed."""
        c, timer, request = self.connector, self.timer, self.requests[rid]
        params = None
        if self.connector.is_producer and not self.connector.is_consumer:
            request.status = RequestStatus.FINISHED_STOPPED
            _, params = timer("request_finished", c.request_finished, request)
            del self.requests[rid]
        else:
            request.num_computed_tokens = request.num_prompt_tokens
            timer("update_state_after_free", c.update_state_after_free, request, 0)
        self._read_report(output)
        return params, timer.take()

    def later_step(self, rid: str) -> tuple[Any, dict]:
        """The consumer's next step: the request is running, its item already in the encoder cache."""
        c, timer, request = self.connector, self.timer, self.requests[rid]
        if not timer("later_ensure_cache_available", c.ensure_cache_available, request, request.num_computed_tokens):
            raise RuntimeError(f"{self.name}: ensure_cache_available deferred a running request")
        so = scheduler_output(request, 1, False)
        so.ec_connector_metadata = timer("later_build_connector_meta", c.build_connector_meta, so)
        return pickle.dumps(so), timer.take()

    def last_output(self, rid: str, output: bytes) -> tuple[Any, dict]:
        """update_from_output of the consumer's last step: the request stops at its token limit."""
        request = self.requests.pop(rid)
        request.status = RequestStatus.FINISHED_LENGTH_CAPPED
        _, params = self.timer("request_finished", self.connector.request_finished, request)
        self._read_report(output, "later_")
        return params, self.timer.take()

    def _read_report(self, blob: bytes, prefix: str = "") -> None:
        output: Optional[ECConnectorOutput] = pickle.loads(blob)
        unavailable = self.timer(prefix + "take_unavailable_requests", self.connector.take_unavailable_requests)
        if unavailable:
            raise RuntimeError(f"{self.name}: requests {sorted(unavailable)} could not get their items")
        # vLLM's aggregator drops an empty output, and the scheduler reads none then.
        if output is not None and not output.is_empty():
            self.timer(prefix + "update_connector_output", self.connector.update_connector_output, output)

    def clean(self, h: str) -> None:
        """Removes the item after its consumer is done, outside the clock, so that neither the pool nor
        the example's folder fills over the rounds."""
        if self.name == "example":
            shutil.rmtree(os.path.join(self.extra["shared_storage_path"], h), ignore_errors=True)
            return
        from mmfeat.client import Client
        from mmfeat.integrations.vllm import ConnectorSettings
        from mmfeat.integrations.vllm.connector import namespace_of

        settings = ConnectorSettings.from_extra_config(self.extra)
        with Client(settings.runtime_dir, map_pools=False) as client:
            client.evict(namespace_of(self.config, settings).key(h))

    def stop(self, profile_path: Optional[str]) -> None:
        if self.profile is not None and profile_path:
            self.profile.dump_stats(profile_path)
        self.connector.shutdown()


class WorkerRole:
    """An instance's only worker (TP 1), in a process of its own, with vLLM's parallel state set up as a
    CPU worker sets it and the connector made by vLLM's ensure_ec_transfer_initialized."""

    def __init__(self, connector: str, ec_role: str, extra: dict[str, Any], port: int, max_size: int,
                 profile: bool) -> None:
        torch.set_num_threads(1)  # torch's thread pool does not survive a fork; and four processes share two cores
        with set_current_vllm_config(VllmConfig()):
            init_distributed_environment(1, 0, f"tcp://127.0.0.1:{port}", 0, "gloo")
            ensure_model_parallel_initialized(1, 1)
        self.name = connector
        ec_transfer_state.ensure_ec_transfer_initialized(vllm_config(connector, ec_role, extra))
        self.encoder_cache: dict[str, torch.Tensor] = {}
        # The model's input-embedding buffer that the first use copies each loaded item into, faulted in once.
        self.embeds = torch.zeros(max_size // 2, dtype=torch.bfloat16)
        self.profile = cProfile.Profile() if profile else None
        self.timer = Timer(None)

    def warm(self, warm: bool) -> None:
        self.timer.profile = self.profile if warm else None

    def _step(self, blob: bytes) -> Any:
        so: SchedulerOutput = pickle.loads(blob)
        return ECConnectorModelRunnerMixin.maybe_get_ec_connector_output(so, encoder_cache=self.encoder_cache)

    def encode(self, so: bytes, h: str, size: int, seed: int) -> tuple[bytes, str, dict]:
        """A producer's step: the encoder's output (a fresh tensor, made and digested outside the clock)
        goes into the encoder cache, and the runner saves it through the connector at once."""
        step = self._step(so)
        output = self.timer("worker_step_begin", step.__enter__)
        tensor = torch.randn(item_shape(size), generator=torch.Generator().manual_seed(seed), dtype=torch.bfloat16)
        seen = digest(tensor)
        self.encoder_cache[h] = tensor
        self.timer("save_caches", ECConnectorModelRunnerMixin.maybe_save_ec_to_connector, self.encoder_cache, h)
        self.timer("worker_step_end", step.__exit__, None, None, None)
        return pickle.dumps(output), seen, self.timer.take()

    def load(self, so: bytes, h: str) -> tuple[bytes, Optional[str], dict]:
        """A consumer's step: the connector loads the item into the encoder cache, and the model's gather
        copies it into the input embeddings, touching every page of it. Timed together ("load + first
        use"): a load that maps lazily would otherwise look free."""
        timer, step = self.timer, self._step(so)
        output = timer("load_and_first_use", self._load_and_use, step, h)
        tensor = self.encoder_cache.get(h)
        timer("worker_step_end", step.__exit__, None, None, None)
        return pickle.dumps(output), None if tensor is None else digest(tensor), timer.take()

    def _load_and_use(self, step: Any, h: str) -> Any:
        output = step.__enter__()
        tensor = self.encoder_cache.get(h)
        if tensor is not None:
            self.embeds[:tensor.numel()].copy_(tensor.reshape(-1))
        return output

    def later_step(self, so: bytes) -> tuple[bytes, dict]:
        step = self._step(so)
        output = self.timer("later_worker_step_begin", step.__enter__)
        self.timer("later_worker_step_end", step.__exit__, None, None, None)
        return pickle.dumps(output), self.timer.take()

    def free(self, h: str) -> None:
        """The scheduler freed the item (free_encoder_mm_hashes): the runner drops its entry."""
        self.encoder_cache.pop(h, None)

    def stop(self, profile_path: Optional[str]) -> None:
        if self.profile is not None and profile_path:
            self.profile.dump_stats(profile_path)
        ec_transfer_state.ensure_ec_transfer_shutdown()


def serve(conn: Any, kind: str, args: tuple) -> None:
    """A role process: build the role, then answer ("ok", result) or ("error", traceback) per call until
    "stop"."""
    t = time.perf_counter()
    try:
        role = (SchedulerRole if kind == "scheduler" else WorkerRole)(*args)
        conn.send(("ok", time.perf_counter() - t))
    except BaseException:
        conn.send(("error", traceback.format_exc()))
        return
    while True:
        op, call_args = conn.recv()
        try:
            result = getattr(role, op)(*call_args)
            conn.send(("ok", result))
        except BaseException:
            conn.send(("error", traceback.format_exc()))
        if op == "stop":
            return
