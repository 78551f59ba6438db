"""A progress bar per epoch for `dmdask.batches(..., progress=...)` (docs/dashboard.md, "Progress
bars"); its hit rate costs one scheduler request at most every `STATS_INTERVAL` s, in the
background, which the training loop never waits for."""
from __future__ import annotations

import asyncio
import io
import os
import sys
import time

import dask.config

from ..protocol.metric import read_metric

STATS_INTERVAL = 1.0  # seconds between two hit-rate requests (scaled up on large clusters)
WORKERS_PER_SECOND = 50  # above this many workers, ask less often


def wanted(progress, rank: int = 0, stream=None) -> bool:
    """Whether to show a bar for `progress` (True, False, None or a dict of tqdm options)."""
    if isinstance(progress, dict):
        return True
    if progress is not None:
        return bool(progress)
    configured = dask.config.get("dmdask.progress", None)
    if configured is not None:
        return str(configured).lower() not in ("0", "false", "no", "off", "")
    stream = sys.stderr if stream is None else stream
    try:
        interactive = bool(stream.isatty())
    except (AttributeError, ValueError):
        interactive = False
    return interactive and rank == 0


def served(workers_metrics) -> dict:
    """Samples served by tier, summed over the workers' dmdask metrics."""
    metrics = [m for m in map(read_metric, workers_metrics) if m is not None]
    return {tier: sum(m[tier]["hits"] for m in metrics) for tier in ("ram", "ssd", "stream")}


def hit_text(before: dict, after: dict) -> str | None:
    """"hit 97% (RAM 81%, SSD 16%, streamed 3%)" for the samples served between two
    `served()` counts; None when none were."""
    delta = {k: max(0, after[k] - before[k]) for k in after}
    n = sum(delta.values())
    if not n:
        return None
    return (f"hit {(delta['ram'] + delta['ssd']) / n:.0%} (RAM {delta['ram'] / n:.0%}, "
            f"SSD {delta['ssd'] / n:.0%}, streamed {delta['stream'] / n:.0%})")


def _terminal_size(stream) -> bool:
    """False only for a terminal that reports no size (tqdm would then draw nothing)."""
    try:
        size = os.get_terminal_size(stream.fileno())
    except (AttributeError, OSError, ValueError, io.UnsupportedOperation):
        return True  # not a terminal: tqdm's own defaults apply
    return bool(size.columns and size.lines)


async def served_now(client) -> dict:
    """`served` by all workers, and `_workers`: their number."""
    info = await client.scheduler.identity(n_workers=-1)
    workers = info.get("workers", {})
    counts = served((w.get("metrics") or {}).get("dmdask") for w in workers.values())
    counts["_workers"] = len(workers)
    return counts


class EpochProgress:
    """The bar of one `BatchIterator`: `update()` per batch handed out, `close()` at the end."""

    def __init__(self, iterator, options: dict | None = None):
        from tqdm.auto import tqdm

        spec = iterator.spec
        desc = f"epoch {iterator.epoch}" + (f" rank {spec.rank}" if spec.world_size > 1 else "")
        kwargs = dict(total=len(iterator), initial=iterator.position, desc=desc, unit="batch",
                      dynamic_ncols=True, file=sys.stderr, leave=True, smoothing=0.1)
        kwargs.update(options or {})
        if "ncols" not in kwargs and "nrows" not in kwargs and not _terminal_size(kwargs["file"]):
            kwargs.update(dynamic_ncols=False, ncols=100, nrows=50)  # a terminal reporting 0x0 (bare pty)
        self.bar = tqdm(**kwargs)
        self.client = iterator.client
        self._loop = iterator.client.loop.asyncio_loop
        self._baseline: dict | None = None
        self._pending = None  # concurrent future of the request in flight
        self._next_ask = 0.0
        self._interval = STATS_INTERVAL
        self.hit: str | None = None
        self._ask()

    def _ask(self) -> None:
        try:
            self._pending = asyncio.run_coroutine_threadsafe(served_now(self.client), self._loop)
        except RuntimeError:  # the client's loop is gone
            self._pending = None
        self._next_ask = time.monotonic() + self._interval

    def _collect(self) -> None:
        fut = self._pending
        if fut is None or not fut.done():
            return
        self._pending = None
        try:
            counts = fut.result()
        except Exception:  # a missed reading only delays the hit rate
            return
        self._interval = max(STATS_INTERVAL, counts.pop("_workers", 0) / WORKERS_PER_SECOND)
        if self._baseline is None:
            self._baseline = counts
            return
        text = hit_text(self._baseline, counts)
        if text is not None and text != self.hit:
            self.hit = text
            self.bar.set_postfix_str(text, refresh=False)

    def update(self, n: int = 1) -> None:
        self._collect()
        if self._pending is None and time.monotonic() >= self._next_ask:
            self._ask()
        self.bar.update(n)

    def close(self) -> None:
        self._collect()
        self._pending = None  # a request still in flight finishes unread
        self.bar.close()


def make(iterator, progress) -> EpochProgress | None:
    """The bar for `iterator`, or None when none is wanted."""
    if not wanted(progress, iterator.spec.rank):
        return None
    return EpochProgress(iterator, progress if isinstance(progress, dict) else None)
