"""`dmdask.batches(client, spec)`: one epoch of one rank's batches.

The data path of a batch:
1. the rank computes the epoch order and its share (`order.py`), so it knows every
   sample id of every batch ahead of time;
2. each block of the dataset is one Dask future with a stable key (`load_block`), shared
   by all ranks and jobs through a published dataset; the rank waits for the futures its
   next batch touches and asks the scheduler who holds them;
3. it sends the batch's plan (holder -> block -> rows) to a worker on its own node, which
   takes its own rows in place, fetches the others from their holders over Dask's
   comms, orders them, runs the transform and returns the batch.
Up to `spec.prefetch` batches are in flight at once.
"""
from __future__ import annotations

import asyncio
import logging
import time
import warnings
from collections import deque
from typing import Deque, Dict, List, Optional

import numpy as np
from distributed import Client, Lock
from distributed.comm.core import CommClosedError
from distributed.protocol.serialize import to_serialize

from .errors import BlockReadError, NotADmdaskWorker, SpecError
from .order import epoch_order, rank_batches
from .progress import make as _make_progress
from .sources import Source, forget_listing, open_source
from .spec import Spec, dumps_transform
from .worker import load_block

logger = logging.getLogger(__name__)

STATE_FIELDS = ("identity", "epoch", "seed", "shuffle", "shuffle_window", "rank",
                "world_size", "batch_size", "drop_last")
REQUEST_BYTES = 8 << 20  # small batches are fetched several per request, up to about this size
RECOVERY_SECONDS = 60  # how long a batch keeps retrying while the cluster recovers from a lost worker


def batches(client: Client, spec: Spec, epoch: int = 0, resume: Optional[dict] = None,
            progress=None) -> "BatchIterator":
    """An iterator over this rank's batches of one epoch.

    Each batch is a dict of numpy arrays, one per field of the source, plus "index": the
    global sample ids (int64) of its rows. Across `spec.world_size` ranks every sample of
    the epoch is delivered exactly once. `resume` takes a `state_dict()` of an earlier
    iterator of the same spec and epoch and continues right after its last batch.
    `progress`: a tqdm bar for the epoch with batches/s and the cluster's hit rate; True,
    False, or None (default: when stderr is an interactive terminal, on rank 0); see
    `dmdask.progress`.
    """
    return BatchIterator(client, spec, epoch, resume, progress=progress)


def _published_name(source: Source) -> str:
    return f"dmdask-{source.identity}"


def block_futures(client: Client, source: Source, first_needed: np.ndarray) -> list:
    """The futures of every block of `source`, created once per cluster and published.

    A future that failed before (a corrupt block) is retried, so a repaired file is
    read again.
    """
    name = _published_name(source)
    with Lock(name, scheduler_rpc=client.scheduler, loop=client.loop):  # one rank creates, others find them
        try:
            futures = client.get_dataset(name)
        except KeyError:
            futures = None
        if futures is not None:
            erred = [f for f in futures if f.status == "error"]
            if erred:
                client.retry(erred)
            return futures
        if client.run_on_scheduler(_work_stealing_on):
            warnings.warn(
                "the scheduler steals work: block loads may leave their planned workers, and with "
                "a cache smaller than the dataset some blocks then stay uncached; start `dask "
                "scheduler` with DASK_DISTRIBUTED__SCHEDULER__WORK_STEALING=False",
                RuntimeWarning, stacklevel=3)
        futures = _submit_blocks(client, source, first_needed)
        client.publish_dataset(**{name: futures})
        return futures


def _work_stealing_on(dask_scheduler) -> bool:
    return "stealing" in dask_scheduler.extensions


def _submit_blocks(client: Client, source: Source, first_needed: np.ndarray) -> list:
    """One `load_block` task per block under its stable key, spread over the workers
    round-robin in the order the blocks are first needed (each worker loads its share
    in that order)."""
    workers = sorted(client.scheduler_info(n_workers=-1)["workers"])
    if not workers:
        raise NotADmdaskWorker("the cluster has no workers; start `dask worker ... --worker-class dmdask.Worker`")
    futures = [None] * source.num_blocks
    need_order = np.argsort(first_needed, kind="stable")
    for rank_in_need, k in enumerate(need_order.tolist()):
        reader = source.readers[k]
        futures[k] = client.submit(
            load_block, reader, key=reader.key, workers=[workers[rank_in_need % len(workers)]],
            allow_other_workers=True, pure=False, priority=source.num_blocks - rank_in_need,
        )
    return futures


def release(client: Client, spec: Spec) -> None:
    """Drop the cluster's cache of `spec.source` (its blocks leave RAM and SSD once no
    iterator holds them) and this process's listing of a folder source."""
    source = open_source(spec)
    forget_listing(source.url, spec.storage_options)
    try:
        client.unpublish_dataset(_published_name(source))
    except KeyError:
        pass


def _first_needed(source: Source, order: np.ndarray) -> np.ndarray:
    """Position in the epoch order at which each block is first needed."""
    first = np.full(source.num_blocks, len(order), dtype=np.int64)
    blocks = source.block_of(order)
    np.minimum.at(first, blocks, np.arange(len(order)))
    return first


def _host(address: str) -> str:
    return address.split("://", 1)[-1].rsplit(":", 1)[0].strip("[]")


class BatchIterator:
    """One epoch of one rank's batches, with bounded prefetch and `state_dict()`.

    `len()` is the number of batches this rank gets in the epoch. The position in
    `state_dict()` counts batches handed out, not batches prefetched.
    """

    def __init__(self, client: Client, spec: Spec, epoch: int = 0, resume: Optional[dict] = None,
                 progress=None):
        if isinstance(epoch, bool) or not isinstance(epoch, int) or epoch < 0:
            raise SpecError("epoch", "an integer >= 0", epoch)
        self.client = client
        self.spec = spec
        self.epoch = epoch
        self.source = open_source(spec)
        if self.source.num_samples < spec.world_size:
            raise SpecError("world_size", f"at most the {self.source.num_samples} samples of {spec.source}",
                            spec.world_size)
        order = epoch_order(self.source.bounds, epoch, spec.shuffle, spec.seed, spec.shuffle_window)
        self._batches = rank_batches(order, spec.rank, spec.world_size, spec.batch_size, spec.drop_last)
        if spec.drop_last and not self._batches:
            raise SpecError("batch_size", f"at most {self.source.num_samples // spec.world_size} with "
                            f"drop_last=True and world_size={spec.world_size}", spec.batch_size)
        self._futures = block_futures(client, self.source, _first_needed(self.source, order))
        self._position = 0
        if resume is not None:
            self._position = self._check_resume(resume)
        self._next_request = self._position
        self._in_flight: Deque = deque()  # concurrent futures, each of a list of batches
        self._ready_batches: Deque = deque()
        self._holders: Dict[int, str] = {}
        self._worker: Optional[str] = None
        self._transform = dumps_transform(spec.transform)
        self._loop = client.loop.asyncio_loop
        self.wait_seconds = 0.0  # time the consumer spent waiting for batches
        self.requests = 0  # requests sent to the local worker
        batch_bytes = spec.batch_size * self.source.nbytes / max(1, self.source.num_samples)
        # several batches a request, up to REQUEST_BYTES, keeping two requests in flight
        self.group = int(max(1, min(spec.prefetch // 2, REQUEST_BYTES // max(1, batch_bytes))))
        self._progress = _make_progress(self, progress)  # None unless a bar is shown

    # -- the iterator ------------------------------------------------------------------
    def __len__(self) -> int:
        return len(self._batches)

    def __iter__(self):
        return self

    def __next__(self) -> Dict[str, np.ndarray]:
        if not self._ready_batches:
            self._fill()
            if not self._in_flight:
                self._end_progress()
                raise StopIteration
            started = time.perf_counter()
            try:
                self._ready_batches.extend(self._in_flight.popleft().result())
            except BaseException:
                self.close()
                raise
            self.wait_seconds += time.perf_counter() - started
        batch = self._ready_batches.popleft()
        if isinstance(batch, BaseException):  # the batches before it were handed out
            self.close()
            raise batch
        self._position += 1
        if self._progress is not None:
            self._progress.update()
        self._fill()
        return batch

    def _fill(self) -> None:
        """Keep up to `spec.prefetch` batches requested or ready, in groups of `self.group`
        batches (one request per group amortises its fixed cost)."""
        group = self.group
        while self._next_request < len(self._batches):
            pending = self._next_request - self._position
            if pending + group > max(self.spec.prefetch, group):
                break
            stop = min(len(self._batches), self._next_request + group)
            coro = self._fetch(self._next_request, stop)
            self._in_flight.append(asyncio.run_coroutine_threadsafe(coro, self._loop))
            self._next_request = stop
            self.requests += 1

    def close(self) -> None:
        """Cancel batches in flight; the iterator is exhausted afterwards."""
        self._end_progress()
        for fut in self._in_flight:
            fut.cancel()
        self._in_flight.clear()
        self._ready_batches.clear()
        self._next_request = len(self._batches)

    def _end_progress(self) -> None:
        if self._progress is not None:
            self._progress.close()
            self._progress = None

    # -- resume ------------------------------------------------------------------------
    def state_dict(self) -> dict:
        """The whole position: pass it as `resume=` to continue after the last batch handed out."""
        spec = self.spec
        return {"identity": self.source.identity, "epoch": self.epoch, "seed": spec.seed,
                "shuffle": spec.shuffle, "shuffle_window": spec.shuffle_window, "rank": spec.rank,
                "world_size": spec.world_size, "batch_size": spec.batch_size,
                "drop_last": spec.drop_last, "position": self._position}

    def _check_resume(self, state: dict) -> int:
        if not isinstance(state, dict) or "position" not in state:
            raise SpecError("resume", "a dict from BatchIterator.state_dict()", state)
        current = self.state_dict()
        for name in STATE_FIELDS:
            if state.get(name) != current[name]:
                raise SpecError("resume", f"a state of the same dataset and spec ({name} is "
                                f"{current[name]!r} here but {state.get(name)!r} in the state)", state.get(name))
        position = state["position"]
        if not isinstance(position, int) or not 0 <= position <= len(self._batches):
            raise SpecError("resume", f"a position in 0..{len(self._batches)}", position)
        return position

    # -- fetching one batch (runs on the client's event loop) --------------------------
    async def _fetch(self, first: int, stop: int) -> list:
        """Batches first..stop-1; after a corrupt block, the ones before it and the error."""
        try:
            return await self._fetch_group(first, stop)
        except BlockReadError:
            if stop - first == 1:
                raise
            return await self._fetch_one_by_one(first, stop)

    async def _fetch_group(self, first: int, stop: int) -> List[Dict[str, np.ndarray]]:
        """Batches first..stop-1, fetched through one request to the local worker."""
        group = self._batches[first:stop]
        ids = np.concatenate(group)
        blocks = self.source.block_of(ids)
        offsets = ids - self.source.bounds[blocks]
        needed = np.unique(blocks).tolist()
        last_error: Optional[BaseException] = None
        deadline = time.monotonic() + RECOVERY_SECONDS
        attempt = 0
        while time.monotonic() < deadline:
            attempt += 1
            await self._ready(needed)
            holders = await self._holders_of(needed)
            if any(k not in holders for k in needed):  # finished but not yet registered
                await asyncio.sleep(min(1.0, 0.05 * attempt))
                continue
            plan, positions = self._plan(blocks, offsets, holders)
            msg = {"requests": plan, "positions": positions, "index": ids, "sizes": [len(b) for b in group],
                   "fields": list(self.source.fields), "transform": self._transform}
            worker = await self._local_worker()
            try:
                reply = await self.client.rpc(worker).dmdask_batch(msg=to_serialize(msg))
            except BlockReadError:
                raise
            except (OSError, CommClosedError) as exc:  # a worker left: ask again
                last_error = exc
                self._worker = None
                self._holders.clear()
                await asyncio.sleep(min(1.0, 0.1 * attempt))
                continue
            if reply["status"] == "OK":
                return reply["batches"]
            last_error = KeyError(f"blocks moved: {reply['keys'][:3]}")
            self._holders.clear()
            await asyncio.sleep(min(1.0, 0.05 * attempt))
        raise RuntimeError(f"batches {first}..{stop - 1} of rank {self.spec.rank} still failing after {RECOVERY_SECONDS} s "
                           f"({attempt} tries); is the cluster losing workers?") from last_error

    async def _fetch_one_by_one(self, first: int, stop: int) -> list:
        """After a failed group: its batches one at a time, up to the failing one, then
        the error itself, so every batch before a corrupt block is still delivered."""
        out: list = []
        for i in range(first, stop):
            try:
                out.extend(await self._fetch_group(i, i + 1))
            except BlockReadError as exc:
                out.append(exc)
                return out
        return out  # the group's error did not come back one batch at a time

    async def _ready(self, blocks: List[int]) -> None:
        for k in blocks:
            fut = self._futures[k]
            if fut.status != "finished":
                await fut._state.wait()
                if fut.status == "error":
                    raise fut._state.exception

    async def _holders_of(self, blocks: List[int]) -> Dict[int, str]:
        unknown = [k for k in blocks if k not in self._holders]
        if unknown:
            who_has = await self.client.scheduler.who_has(keys=[self._futures[k].key for k in unknown])
            mine = _host(await self._local_worker())
            for k in unknown:
                addresses = who_has.get(self._futures[k].key) or []
                if not addresses:
                    continue
                local = [a for a in addresses if _host(a) == mine]
                self._holders[k] = (local or addresses)[0]
        return self._holders

    def _plan(self, blocks: np.ndarray, offsets: np.ndarray, holders: Dict[int, str]):
        """holder -> block key -> rows to take, and holder -> the positions in the group
        where those rows go (in the same order)."""
        by_block = np.argsort(blocks, kind="stable")
        uniq, starts = np.unique(blocks[by_block], return_index=True)
        groups = np.split(by_block, starts[1:])
        plan: Dict[str, Dict[str, np.ndarray]] = {}
        positions: Dict[str, List[np.ndarray]] = {}
        for k, members in zip(uniq.tolist(), groups):
            holder = holders[k]
            plan.setdefault(holder, {})[self._futures[k].key] = offsets[members]
            positions.setdefault(holder, []).append(members)
        return plan, {h: np.concatenate(p) for h, p in positions.items()}

    async def _local_worker(self) -> str:
        """A worker on this rank's own node: rank r takes local worker r mod n."""
        if self._worker is None:
            info = await self.client.scheduler.identity()
            workers = sorted(info["workers"])
            if not workers:
                raise NotADmdaskWorker("the cluster has no workers left")
            comm = self.client.scheduler_comm.comm
            my_host = _host(comm.local_address) if comm is not None else None
            local = [w for w in workers if _host(w) == my_host]
            if not local:
                warnings.warn(f"no dmdask worker on this node ({my_host}); batches will cross the network",
                              RuntimeWarning, stacklevel=2)
                local = workers
            self._worker = local[self.spec.rank % len(local)]
        return self._worker
