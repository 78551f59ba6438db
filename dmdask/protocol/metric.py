"""The `dmdask` metric a dmdask worker sends with each heartbeat (`Worker.metrics["dmdask"]`:
plain values, as msgpack carries them), declared here as types, and `read_metric`, how the
scheduler's side (placement, the dashboard, the `KilledWorker` error) and a rank's progress
bar read one: checked by its types as a request is (`dmdask.protocol.message`), so a
worker of another version, or a plain one, is told apart from a dmdask worker's numbers.
"""
from __future__ import annotations

import dataclasses
from typing import Optional

from ..errors import HandlerArgumentError
from .message import Message, type_hints, from_dict

METRIC = "dmdask"  # its name in a worker's metrics
message = dataclasses.dataclass(frozen=True)


@message
class TierMetric(Message):
    """One tier (`dmdask.worker.tier_space.TierStats`, without its reservations)."""
    capacity: int
    bytes: int
    blocks: int
    samples: int
    hits: int
    hit_bytes: int
    full: bool
    error: Optional[str]
    read_errors: int
    warning: Optional[str]
    source: Optional[str]
    dir: Optional[str]


@message
class StreamMetric(Message):
    hits: int  # samples served from blocks streamed from the store
    buffer_bytes: int
    buffer_capacity: int


@message
class StoreMetric(Message):
    requests: int
    bytes: int
    retries: int
    read_ahead: int
    from_ranks: int


@message
class PeerMetric(Message):
    bytes_out: int
    bytes_in: int
    requests: int


@message
class WorkerMetric(Message):
    """A worker's tiers and its cache's counters (`BlockCache.stats`); `oom_kills`: the
    out-of-memory kills its memory cgroup counted (absent until the worker plugin starts)."""
    ram: TierMetric
    ssd: TierMetric
    streamed_blocks: int
    stream: StreamMetric
    shared_store: StoreMetric
    peer: PeerMetric
    oom_kills: int = 0


def empty_metric() -> dict:
    """A metric with every counter at zero and no tier (capacity 0)."""
    def zeros(kind: type) -> dict:
        hints = type_hints(kind)
        return {f.name: zeros(hints[f.name]) if isinstance(hints[f.name], type) and issubclass(hints[f.name], Message)
                else (False if hints[f.name] is bool else None if f.name in ("error", "warning", "source", "dir") else 0)
                for f in dataclasses.fields(kind)}
    return zeros(WorkerMetric)


def read_metric(value) -> dict | None:
    """`value`, a worker's `dmdask` metric, if it is one (every field of its type); None
    otherwise (no metric: a plain Dask worker or no heartbeat yet; another shape)."""
    if not isinstance(value, dict):
        return None
    try:
        from_dict(WorkerMetric, value, f"the {METRIC} metric").check(f"the {METRIC} metric")
    except HandlerArgumentError:
        return None
    return value


_last: dict = {}  # address -> (the metric last checked, the result): one check per heartbeat
LAST_KEPT = 4096


def metric_of(ws) -> dict | None:
    """The checked `dmdask` metric of a `WorkerState` (`read_metric`; checked once per heartbeat)."""
    value = (getattr(ws, "metrics", None) or {}).get(METRIC)
    seen = _last.get(ws.address)
    if seen is not None and seen[0] is value:
        return seen[1]
    if len(_last) >= LAST_KEPT:
        _last.pop(next(iter(_last)))
    result = _last[ws.address] = (value, read_metric(value))
    return result[1]
