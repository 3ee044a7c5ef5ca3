"""``MmfeatECConnector``: vLLM's ``ECConnectorBase`` over the two halves. Imported only by vLLM itself
(through ``ec_connector_module_path``), so this is the one module here that imports vLLM at the top."""

from __future__ import annotations

import logging
from typing import TYPE_CHECKING, Any, Optional

import torch
from vllm.distributed.ec_transfer.ec_connector.base import (
    ECConnectorBase, ECConnectorMetadata, ECConnectorRole, ECConnectorWorkerMetadata,
)
from vllm.distributed.ec_transfer.ec_connector.utils import PlaceholderMetadataResolver, collect_ec_item_metadata

from mmfeat.client import Client, MmfeatError, Namespace

from .metadata import StepLoads, StepReport
from .scheduler_side import SchedulerSide
from .settings import ConnectorSettings

if TYPE_CHECKING:
    from vllm.config import VllmConfig
    from vllm.v1.core.sched.output import SchedulerOutput
    from vllm.v1.outputs import ECConnectorOutput
    from vllm.v1.request import Request

log = logging.getLogger("mmfeat.integrations.vllm")


class MmfeatECMetadata(StepLoads, ECConnectorMetadata):
    """The scheduler's StepLoads, typed as vLLM's metadata."""


class MmfeatECWorkerMetadata(StepReport, ECConnectorWorkerMetadata):
    """The workers' StepReport, typed as vLLM's worker metadata."""

    def aggregate(self, other: "StepReport") -> "MmfeatECWorkerMetadata":
        return MmfeatECWorkerMetadata(**vars(StepReport.aggregate(self, other)))


def namespace_of(vllm_config: "VllmConfig", settings: ConnectorSettings) -> Namespace:
    """The same on every instance that serves the same model the same way, so a consumer finds what a
    producer saved, and different for another model, dtype or vLLM version, so they never alias."""
    import vllm

    model = vllm_config.model_config
    return Namespace(framework="vllm", version=vllm.__version__, model=str(model.model),
                     dtype=str(model.dtype).removeprefix("torch."), prefix=settings.namespace)


class MmfeatECConnector(ECConnectorBase):
    def __init__(self, vllm_config: "VllmConfig", role: ECConnectorRole) -> None:
        super().__init__(vllm_config=vllm_config, role=role)
        config = vllm_config.ec_transfer_config
        self._settings = ConnectorSettings.from_extra_config(config.ec_connector_extra_config)
        self._ns = namespace_of(vllm_config, self._settings)
        timeout = {"timeout": self._settings.timeout_s} if self._settings.timeout_s is not None else {}
        self._scheduler: Optional[SchedulerSide] = None
        self._worker: Any = None
        if role == ECConnectorRole.SCHEDULER:
            # A consumer follows the key feed of its namespace: the items it looks up are found, and pinned
            # for its ranks, in the lease table, without a round trip per request (SPEC.md, section 12).
            client = Client(self._settings.runtime_dir, map_pools=False, name="vllm-ec-scheduler",
                            key_feed=self._ns.id + "/" if self.is_consumer else None, **timeout)
            parallel = vllm_config.parallel_config
            ranks = parallel.tensor_parallel_size * getattr(parallel, "prefill_context_parallel_size", 1)
            self._scheduler = SchedulerSide(client, self._ns, self._settings, self.is_producer, self.is_consumer,
                                            ranks)
            self._resolver = PlaceholderMetadataResolver(vllm_config.model_config)
        else:
            from .worker_side import WorkerSide

            # Every saved item goes to the pool whatever its size: only a feature in the pool has a key
            # another instance can find. A worker that only loads maps the pool read-only: the views it
            # hands vLLM are the pool itself, and a write into one then kills this worker rather than
            # changing what other instances read.
            client = Client(self._settings.runtime_dir, inline_threshold=0, name="vllm-ec-worker",
                            readonly=not self.is_producer, **timeout)
            self._worker = WorkerSide(client, self._ns, self._settings, self.is_producer, self.is_consumer,
                                      _tp_rank, _device)
        self._client = client
        if role != ECConnectorRole.SCHEDULER:
            # Map the pool now, not in the first save or load: vLLM's CPU worker never calls
            # start_worker_services. A daemon that is away is no reason to stop the engine: saves and
            # loads then fail over (consumers encode the items themselves).
            try:
                client.connect()
            except MmfeatError as e:
                log.warning("mmfeat EC connector: no daemon yet (%s); saves and loads will retry", e)
        log.info("mmfeat EC connector: %s, %s, namespace %s, lifetime %s", role.name.lower(),
                 config.ec_role, self._ns.id, self._settings.lifetime)

    # --- worker ----------------------------------------------------------------------------------

    def start_worker_services(self) -> None:
        self._client.connect()  # maps the pool once, before the first step needs it

    def start_load_caches(self, encoder_cache: dict[str, torch.Tensor], **kwargs: Any) -> None:
        self._worker.start_load_caches(encoder_cache, self._connector_metadata)

    def save_caches(self, encoder_cache: dict[str, torch.Tensor], mm_hash: str, **kwargs: Any) -> None:
        self._worker.save_caches(encoder_cache, mm_hash)

    def start_save_caches(self, **kwargs: Any) -> None:
        encoder_cache = kwargs.get("encoder_cache")
        if encoder_cache is not None:
            self._worker.start_save_caches(encoder_cache, self._connector_metadata)

    def get_finished(self, finished_req_ids: set[str]) -> tuple[Optional[set[str]], Optional[set[str]]]:
        return None, None  # the pool owns the bytes: nothing is bound to a request's life

    def build_connector_worker_meta(self) -> Optional[ECConnectorWorkerMetadata]:
        report = self._worker.build_connector_worker_meta()
        return None if report is None else MmfeatECWorkerMetadata(**vars(report))

    # --- scheduler -------------------------------------------------------------------------------

    def ensure_cache_available(self, request: "Request", num_computed_tokens: int) -> bool:
        return self._scheduler.ensure_cache_available(request, num_computed_tokens)

    def has_cache_item(self, identifier: str) -> bool:
        return self._scheduler.has_cache_item(identifier)

    def update_state_after_alloc(self, request: "Request", index: int) -> None:
        self._scheduler.update_state_after_alloc(request, index)

    def build_connector_meta(self, scheduler_output: "SchedulerOutput") -> ECConnectorMetadata:
        return MmfeatECMetadata(**vars(self._scheduler.build_connector_meta(scheduler_output)))

    def update_connector_output(self, connector_output: "ECConnectorOutput") -> None:
        self._scheduler.update_connector_output(connector_output.ec_connector_worker_meta)

    def take_unavailable_requests(self) -> set[str]:
        return self._scheduler.take_unavailable_requests()

    def request_finished(self, request: "Request") -> tuple[bool, Optional[dict[str, Any]]]:
        delay, ours = self._scheduler.request_finished(request)
        if not self.is_producer:
            return delay, ours
        # vLLM's own item metadata (the grid a consumer needs to size its placeholders) beside ours.
        items = collect_ec_item_metadata(request.mm_features, self._resolver) or {}
        for h, entry in (ours or {}).items():
            items.setdefault(h, {}).update(entry)
        return delay, items or None

    def shutdown(self) -> None:
        if self._scheduler is not None:
            log.info("mmfeat EC connector scheduler: %s", dict(self._scheduler.counters))
        if self._worker is not None:
            log.info("mmfeat EC connector worker: %s", self._worker.counters)
            self._worker.close()
        self._client.close()


def _tp_rank() -> int:
    from vllm.distributed.parallel_state import get_tensor_model_parallel_rank

    return get_tensor_model_parallel_rank()


def _device() -> torch.device:
    from vllm.platforms import current_platform

    if current_platform.is_cuda_alike():
        return torch.device("cuda", current_platform.current_device())
    return torch.device("cpu")
