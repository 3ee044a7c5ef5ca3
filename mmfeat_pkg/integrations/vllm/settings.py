"""What ``ec_connector_extra_config`` may say to the mmfeat connector, checked once at start.

vLLM passes the extra config through untyped (a JSON string on the command line gives strings and
numbers as JSON has them), so every field is checked here and a wrong one stops the engine at start
with the field's name and what it takes, not in the middle of a request.
"""

from __future__ import annotations

import dataclasses
import math
from typing import Any, Mapping, Optional

LIFETIMES = ("retained", "counted")


@dataclasses.dataclass(frozen=True)
class ConnectorSettings:
    """The connector's knobs. ``retained`` features stay after any number of loads until ``retain_ttl_s``
    passed and no load holds them (or the pool needs the space); ``counted`` features are freed after
    ``consumers`` loads, as a plain ``put`` is. ``view_ttl_s``: how long a CPU rank may keep a retained
    item as a view of the pool before it copies it out (at most, and by default, half the daemon's
    ack_ttl, which ends the hold that protects the view); ``view_max_bytes``: the pool bytes a worker's
    views may keep at most, past which its loads copy (None: a quarter of the pool; 0: no views);
    ``view_min_bytes``: items smaller than this are copied, not viewed (torch gives a small copy memory
    already faulted in, so the copy costs less than a view's bookkeeping)."""

    namespace: str = ""
    lifetime: str = "retained"
    retain_ttl_s: float = 300.0
    consumers: int = 1
    # A consumer's request whose item another node holds waits for its pull at most load_wait_s, from its
    # first wait, then fails; a scheduling step waits for pulls at most pull_wait_s, its requests together.
    load_wait_s: float = 60.0
    pull_wait_s: float = 0.05
    # An item its producer says it saved on this node, which the key feed has not brought yet (its bind is
    # on the way through the daemon), is waited for on the feed this long before the daemon is asked.
    feed_wait_s: float = 0.005
    runtime_dir: Optional[str] = None
    timeout_s: Optional[float] = None
    report_file: Optional[str] = None
    view_ttl_s: Optional[float] = None
    view_max_bytes: Optional[int] = None
    view_min_bytes: int = 512 << 10

    @classmethod
    def from_extra_config(cls, extra: Optional[Mapping[str, Any]]) -> "ConnectorSettings":
        extra = dict(extra or {})
        unknown = sorted(set(extra) - {f.name for f in dataclasses.fields(cls)})
        if unknown:
            raise ValueError(f"mmfeat connector: unknown ec_connector_extra_config keys {unknown}; "
                             f"it takes {sorted(f.name for f in dataclasses.fields(cls))}")
        out = cls(
            namespace=_text(extra, "namespace", ""),
            lifetime=_text(extra, "lifetime", "retained"),
            retain_ttl_s=_seconds(extra, "retain_ttl_s", 300.0),
            consumers=_count(extra, "consumers", 1),
            load_wait_s=_seconds(extra, "load_wait_s", 60.0),
            pull_wait_s=_seconds(extra, "pull_wait_s", 0.05),
            feed_wait_s=_seconds(extra, "feed_wait_s", 0.005),
            runtime_dir=_text(extra, "runtime_dir", None),
            timeout_s=_seconds(extra, "timeout_s", None),
            report_file=_text(extra, "report_file", None),
            view_ttl_s=_seconds(extra, "view_ttl_s", None),
            view_max_bytes=_bytes(extra, "view_max_bytes", None),
            view_min_bytes=_bytes(extra, "view_min_bytes", 512 << 10),
        )
        if out.lifetime not in LIFETIMES:
            raise ValueError(f"mmfeat connector: lifetime is {out.lifetime!r}; use one of {list(LIFETIMES)}")
        return out


def _text(extra: Mapping[str, Any], name: str, default: Optional[str]) -> Optional[str]:
    value = extra.get(name, default)
    if value is not None and not isinstance(value, str):
        raise ValueError(f"mmfeat connector: {name} must be a string, not {type(value).__name__}")
    return value


def _seconds(extra: Mapping[str, Any], name: str, default: Optional[float]) -> Optional[float]:
    value = extra.get(name, default)
    if value is None:
        return None
    if isinstance(value, str):
        try:
            value = float(value)
        except ValueError:
            raise ValueError(f"mmfeat connector: {name} must be a number of seconds, not {value!r}") from None
    if isinstance(value, bool) or not isinstance(value, (int, float)) or not math.isfinite(value) or value <= 0:
        raise ValueError(f"mmfeat connector: {name} must be a finite number of seconds above 0, not {value!r}")
    return float(value)


def _count(extra: Mapping[str, Any], name: str, default: int) -> int:
    value = extra.get(name, default)
    if isinstance(value, str) and value.isdigit():
        value = int(value)
    if isinstance(value, bool) or not isinstance(value, int) or not 1 <= value <= 4096:
        raise ValueError(f"mmfeat connector: {name} must be an int from 1 to 4096, not {value!r}")
    return value


def _bytes(extra: Mapping[str, Any], name: str, default: Any) -> Any:
    value = extra.get(name, default)
    if isinstance(value, str) and value.isdigit():
        value = int(value)
    if value is not None and (isinstance(value, bool) or not isinstance(value, int) or not 0 <= value < 1 << 63):
        raise ValueError(f"mmfeat connector: {name} must be a number of bytes from 0 up, not {value!r}")
    return value
