"""Where each block loads: its planned worker, chosen when its dataset is registered and
kept among the live workers as workers come and go. Functions of the scheduler and the
registry's `DatasetState`s, used by the `DatasetsPlugin` on the scheduler's event loop."""
from __future__ import annotations

import logging
from collections.abc import Iterable

from ..protocol.metric import metric_of
from ..source.base import block_key

logger = logging.getLogger(__name__)
STREAMED_TOPIC = "dmdask-streamed"  # the event a worker logs with the key of each block it holds as `Streamed`
RUN_NEXT = "dmdask-run-next"  # the scheduler's stream message to a worker: these queued load groups run next


def plan(ds, workers: list[str], order: list[int] | None, first: int, size: int = 1) -> None:
    """The i-th block of `order` (None: index order) goes to worker first + i // size mod W
    (`size`: the blocks of a load group, `dmdask.plan.groups`, which load together), and
    loads with priority -i."""
    n = ds.info.num_blocks
    ds.planned, ds.priority = [None] * n, [0] * n
    for i, k in enumerate(range(n) if order is None else order):
        ds.planned[k] = workers[(first + i // size) % len(workers)]
        ds.priority[k] = n - i


def live_planned(scheduler, ds, k: int, blocks: list[int] | None = None) -> str:
    """Block k's planned worker, planned again over the live workers if it left (with
    `blocks`, those of its load group, which go with it)."""
    worker = ds.planned[k]
    if worker not in scheduler.workers:
        live = sorted(scheduler.workers)
        if live:
            worker = live[k % len(live)]
            for b in blocks or [k]:
                ds.planned[b] = worker
    return worker


def win_back(scheduler, datasets: Iterable, streamed: set[str], worker: str, stimulus_id: str) -> None:
    """Capacity lost with a worker comes back when one joins: blocks held as `Streamed`
    markers (`streamed`, as their holders reported them under `STREAMED_TOPIC`; read from
    the store every epoch) are loaded again on the new worker, as many as its free room
    (from its dmdask metrics) takes. Each costs one read now, in place of the next
    epoch's stream read."""
    ws = scheduler.workers.get(worker)
    tiers = (metric_of(ws) if ws is not None else None) or {}
    room = sum(max(0, t["capacity"] - t["bytes"]) for name, t in tiers.items()
               if name in ("ram", "ssd") and not t["error"])
    moved = []
    for ds in datasets:
        if ds.info is None or not ds.info.nbytes or ds.groups is not None:  # load groups: not won back
            continue
        per_block = ds.info.nbytes / max(1, len(ds.planned))
        for k in range(len(ds.planned)):
            key = block_key(ds.identity, k)
            ts = scheduler.tasks.get(key)
            if key not in streamed or ts is None or ts.state != "memory":
                continue
            if room < per_block:
                break
            room -= per_block
            ds.planned[k] = worker
            moved.append(key)
    if moved:
        logger.info("moving %d streamed blocks to the new worker %s", len(moved), worker)
        scheduler.set_restrictions({key: {worker} for key in moved})
        scheduler.transitions({key: "released" for key in moved}, stimulus_id)


def replan(scheduler, datasets: Iterable, orphaned, stimulus_id: str) -> None:
    """Blocks whose planned worker is `orphaned(address)` go to the live workers."""
    live = sorted(scheduler.workers)
    if not live:
        return
    restrictions, recommendations = {}, {}
    i = 0
    for ds in datasets:
        groups = ds.groups
        for t in range(len(ds.planned) if groups is None else groups.count):  # a block, or a load group
            k = t if groups is None else groups.first(t)
            worker = ds.planned[k]
            if worker is None or not orphaned(worker):
                continue
            worker = live[i % len(live)]
            for b in [k] if groups is None else groups.members(t):
                ds.planned[b] = worker
            i += 1
            key = ds.task_key(k)
            ts = scheduler.tasks.get(key)
            if ts is None or ts.state == "memory":
                continue
            restrictions[key] = {worker}
            if ts.state == "no-worker":
                recommendations[key] = "processing"
    if restrictions:
        scheduler.set_restrictions(restrictions)
    if recommendations:
        scheduler.transitions(recommendations, stimulus_id)
