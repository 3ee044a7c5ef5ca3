"""mmfeat as vLLM's encoder-cache (EC) connector, chosen by configuration alone:

    --ec-transfer-config '{"ec_connector": "MmfeatECConnector",
                           "ec_connector_module_path": "mmfeat.integrations.vllm", "ec_role": "ec_producer"}'

The encode-only producer saves each encoder output into the node's pool under a key made of its
mm_hash and a namespace (vLLM's version, the model, its dtype and an optional prefix); consumers find
it by key, hold it for their ranks, and copy it into their encoder cache. ``MmfeatECConnector`` is
imported from vLLM on first use, so importing this package needs no vLLM (docs/integration.md).
"""

from typing import Any

from .metadata import StepLoads, StepReport
from .settings import ConnectorSettings

__all__ = ["ConnectorSettings", "MmfeatECConnector", "StepLoads", "StepReport"]


def __getattr__(name: str) -> Any:
    if name in ("MmfeatECConnector", "MmfeatECMetadata", "MmfeatECWorkerMetadata"):
        from . import connector

        return getattr(connector, name)
    raise AttributeError(f"module 'mmfeat.integrations.vllm' has no attribute {name!r}")
