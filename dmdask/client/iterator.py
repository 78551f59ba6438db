"""`dmdask.batches(client, spec)`: one epoch of one rank's batches.

The data path of a batch:
1. the rank computes the sample ids of its next batches from (seed, epoch, rank,
   world_size, batch index) alone (`dmdask.plan.order`): no array over the epoch;
2. each block of the dataset is one Dask task with a stable key, created once per
   cluster and kept by the scheduler plugin (`dmdask.client.datasets`,
   `dmdask.scheduler`); the rank asks the plugin who holds the blocks its next batches
   touch (waiting while they load);
3. it sends the batches' plan (holder -> block -> rows) to a worker on its own node,
   which takes its own rows in place, fetches the others from their holders over Dask's
   comms, orders them, runs the transform and returns the batches.
Up to `spec.prefetch` batches are in flight at once.
"""
from __future__ import annotations

import asyncio
import logging
import time
from collections import deque
from typing import Deque, Dict, List, Optional, Set, Tuple

import dask.config
import numpy as np
from distributed import Client
from distributed.comm import get_address_host
from distributed.comm.core import CommClosedError

from ..errors import BlockReadError, NotADmdaskWorker, SpecError, no_workers
from ..plan.elastic import remaining
from ..plan.order import ORDER_VERSION, EpochOrder, RankShare
from ..protocol.scheduler import SchedulerAPI
from ..recovery import Tries
from ..protocol.worker import BatchRequest, RowsRequest
from ..spec import Mix, Spec, TransformContext, as_int, dumps_transform
from ..shm.results import map_batches
from .datasets import open_dataset
from .arenas import LocalArenas, split_batches
from .contact import Contact
from .gather import LOAD_WAIT, Gatherer, Moved, copier, plan_rows
from .locate import my_host
from .mixture import MixedInfo, check_fields_match, take_mixed
from .progress import make as _make_progress
from .resume import resume_point

logger = logging.getLogger(__name__)
_matching_mixtures: set = set()  # (identity, fields) of mixtures whose sources' rows were found to match

REQUEST_BYTES = 8 << 20  # small batches are fetched several per request, up to about this size
LEARN_BLOCKS = 1 << 16  # datasets up to this many blocks: where every block is, learnt before the first batch
HITS_SECONDS = 1.0  # how often workers hear of the rows taken from their files (progress bar, dashboard)


def batches(client: Client, spec: Spec, epoch: int = 0, resume: Optional[dict] = None,
            progress=None) -> "BatchIterator":
    """An iterator over this rank's batches of one epoch.

    Each batch is a dict of numpy arrays, one per field of the source, plus "index": the
    global sample ids (int64) of its rows. For a mixture (`Spec(source=dmdask.Mix(...))`)
    also "source" (int64, the index of each row's source in the mixture), and "index"
    holds the ids within those sources; what the ranks share is then the epoch's
    positions (`dmdask.Mix`). Across `spec.world_size` ranks every sample of
    the epoch is delivered exactly once. `resume` takes a `state_dict()` of an earlier
    iterator of the same spec and epoch and continues right after its last batch; or
    the list of every rank's `state_dict()` from a run of another world size (or batch
    size): the samples none of those ranks handed out are dealt to this run's ranks,
    and over both runs every sample of the epoch is delivered exactly once.
    `progress`: a tqdm bar for the epoch with batches/s and the cluster's hit rate; True,
    False, or None (default: when stderr is an interactive terminal, on rank 0); see
    `dmdask.client.progress`.
    """
    return BatchIterator(client, spec, epoch, resume, progress=progress)


class BatchIterator:
    """One epoch of one rank's batches, with bounded prefetch and `state_dict()`.

    `len()` is the number of batches this rank gets in the epoch. The position in
    `state_dict()` counts batches handed out, not batches prefetched.
    """

    def __init__(self, client: Client, spec: Spec, epoch: int = 0, resume: Optional[dict] = None,
                 progress=None):
        epoch = as_int("epoch", epoch, low=0)
        self.client = client
        self.spec = spec
        self.epoch = epoch
        self._mixed: Optional[MixedInfo] = None  # the sources of a mixture, as one dataset of global ids
        self._loop = client.loop.asyncio_loop
        self._contact = Contact(client, spec.rank)
        self._contact.reach_ahead(self._loop)  # while the dataset opens
        if isinstance(spec.source, Mix):
            opened = [open_dataset(client, s, epoch) for s in spec.source.specs(spec)]
            self.info = info = self._mixed = MixedInfo(spec.source, [o.info for o in opened])
            self._order = info.order(shuffle=spec.shuffle, seed=spec.seed, epoch=epoch,
                                     shuffle_window=spec.shuffle_window)
        else:
            opened = [open_dataset(client, spec, epoch)]
            self.info = info = opened[0].info
            self._order = EpochOrder(info.num_samples, info.block_len, shuffle=spec.shuffle, seed=spec.seed,
                                     epoch=epoch, shuffle_window=spec.shuffle_window)
        positions = self._order.num_samples  # of the epoch (a mixture's differ from its samples)
        if positions < spec.world_size:
            raise SpecError("world_size", f"at most the {positions} samples of an epoch of {spec.source}",
                            spec.world_size)
        self._history: List[dict] = []  # generations of ranks before this one in the epoch (elastic resume)
        self._position = 0
        if resume is not None:
            self._history, self._position = resume_point(resume, spec, self.state_dict(), self._share)
        self._batches = self._share(spec.rank, spec.world_size, spec.batch_size, self._history)
        if spec.drop_last and not len(self._batches) and not self._history:
            raise SpecError("batch_size", f"at most {positions // spec.world_size} with "
                            f"drop_last=True and world_size={spec.world_size}", spec.batch_size)
        self._next_request = self._position
        self._in_flight: Deque = deque()  # concurrent futures, each of a list of batches
        self._ready_batches: Deque = deque()
        self._holders: Dict[str, str] = {}  # block key -> a worker holding it
        datasets = info.sources if self._mixed is not None else [info]
        self._locals = [LocalArenas.of(d.identity, d.num_samples, d.block_len) for d in datasets]
        self._local = self._locals[0]
        for local in self._locals:
            local.forget_if_gone()
        self._gatherer = Gatherer(client, my_host(client), {d.identity: a for d, a in zip(datasets, self._locals)})
        self._transform = dumps_transform(spec.transform)
        if self._transform is None and any(o.loaded for o in opened) and not self._all_known():
            asyncio.run_coroutine_threadsafe(self._learn_where_blocks_are(datasets), self._loop).result()
        self._cold = not self._all_known()  # until a fetched batch needed no read from the store
        if self._mixed is not None:
            self._check_mixed_rows()
        self.wait_seconds = 0.0  # time the consumer spent waiting for batches
        self.requests = 0  # requests sent to workers (batches taken from arenas on this host need none)
        # several batches a request, up to REQUEST_BYTES, keeping two requests in flight
        self.group = max(1, spec.prefetch // 2)
        if info.nbytes is not None:
            batch_bytes = spec.batch_size * info.nbytes / max(1, info.num_samples)
            self.group = int(max(1, min(self.group, REQUEST_BYTES // max(1, batch_bytes))))
        self._progress = _make_progress(self, progress)  # None unless a bar is shown

    # -- the iterator ------------------------------------------------------------------
    @property
    def position(self) -> int:
        """Batches handed out so far in this epoch."""
        return self._position

    @property
    def requested(self) -> int:
        """Batches of this epoch requested so far: handed out, ready or in flight (at most
        `position + spec.prefetch`)."""
        return self._next_request

    @property
    def progress(self):
        """The epoch's progress bar (`dmdask.client.progress.EpochProgress`, its tqdm bar
        as `.bar`); None when none is shown or once the epoch ended."""
        return self._progress

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
        """Keep up to `spec.prefetch` batches requested or ready, all requested at once,
        earliest first: workers serve each request at the priority of its first batch's
        position, so batch k's reads go before batch k+1's, across every rank they serve,
        and the store is busy from the first batch to the last. While cold (the last batch
        fetched needed rows read from the store), each batch is a request of its own and
        is handed out as soon as its own rows are in; warm, `self.group` batches share a
        request (one request amortises its fixed cost)."""
        while self._next_request < len(self._batches):
            group = 1 if self._cold else self.group
            pending = self._next_request - self._position
            if pending + group > max(self.spec.prefetch, group):
                break
            stop = min(len(self._batches), self._next_request + group)
            self._in_flight.append(self._request(self._next_request, stop))
            self._next_request = stop

    def _request(self, first: int, stop: int):
        """A future of batches first..stop-1. Warm (no transform, every block of the group
        known in an arena on this host): copied by this process's copier thread, no
        request at all; otherwise fetched on the client's event loop (`_fetch`)."""
        group = self._batches.batches(first, stop)
        if self._transform is None and self._known(group):
            return copier.submit(self._copy_known, first, stop, group)
        self.requests += 1
        return asyncio.run_coroutine_threadsafe(self._fetch(first, stop), self._loop)

    def _all_known(self) -> bool:
        """Whether every block of every dataset read is in a known arena on this host."""
        datasets = self.info.sources if self._mixed is not None else [self.info]
        return all(a.knows(np.arange(d.num_blocks)) for d, a in zip(datasets, self._locals))

    def _known(self, group: List[np.ndarray]) -> bool:
        """Whether the arenas on this host hold every block of the group (a mixture: of
        every source) as far as this process knows (`LocalArenas.take` applies)."""
        if self._mixed is not None:
            return self._all_known()
        return self._local.knows(np.concatenate(group) // self.info.block_len)

    async def _learn_where_blocks_are(self, datasets) -> None:
        """Ahead of the first batch: the holders of every block loaded already, and the
        layout of those held in arenas on this host, so that a new process on a warm cache
        takes its rows straight from the arenas from its first batch on. One request to
        the scheduler (it does not wait for blocks still loading) and one per local worker
        holding some; skipped for datasets of more than LEARN_BLOCKS blocks."""
        keys = [d.block_key(k) for d in datasets if d.num_blocks <= LEARN_BLOCKS for k in range(d.num_blocks)]
        if not keys:
            return
        await self._contact.check_scheduler()
        mine = get_address_host(await self._contact.local_worker())
        holders = (await SchedulerAPI(self.client).locate(keys, mine, wait=0)).holders
        self._holders.update(holders)
        await self._gatherer.learn(holders)

    def _copy_known(self, first: int, stop: int, group: List[np.ndarray]) -> list:
        """In the copier thread: the group's rows from the arenas."""
        try:
            if self._mixed is not None:
                out = take_mixed(self._mixed, self._locals, group, self._gatherer.count)
            else:
                out = self._local.take(group, self._gatherer.count)
        except Moved:  # released or moved since it was known: locate the blocks again
            self.requests += 1
            return asyncio.run_coroutine_threadsafe(self._fetch(first, stop), self._loop).result()
        if self._gatherer.due(HITS_SECONDS):  # wakes the event loop only when a report is due
            self._loop.call_soon_threadsafe(self._gatherer.flush_hits_every, HITS_SECONDS)
        return out

    def close(self) -> None:
        """Cancel batches in flight; the iterator is exhausted afterwards."""
        self._end_progress()
        for fut in self._in_flight:
            fut.cancel()
        self._in_flight.clear()
        self._ready_batches.clear()
        self._next_request = len(self._batches)

    def _end_progress(self) -> None:
        """At the end of the epoch or on close: the bar closes, and the workers learn how
        many rows this process took from their files (their hit counters)."""
        if self._progress is not None:
            self._progress.close()
            self._progress = None
        if self._gatherer.has_hits():
            report = asyncio.run_coroutine_threadsafe(self._gatherer.flush_hits(), self._loop)
            try:
                report.result(timeout=10)
            except Exception:  # noqa: BLE001 - counters only; never fails an epoch
                pass

    # -- resume ------------------------------------------------------------------------
    def state_dict(self) -> dict:
        """The whole position, plain values (JSON, pickle): pass it as `resume=` to continue
        after the last batch handed out; or, with another world size, pass every rank's."""
        spec = self.spec
        return {"order": ORDER_VERSION, "identity": self.info.identity, "epoch": self.epoch, "seed": spec.seed,
                "shuffle": spec.shuffle, "shuffle_window": spec.shuffle_window, "rank": spec.rank,
                "world_size": spec.world_size, "batch_size": spec.batch_size,
                "drop_last": spec.drop_last, "position": self._position,
                "history": [dict(g) for g in self._history]}

    def _share(self, rank: int, world_size: int, batch_size: int, history: List[dict]) -> RankShare:
        """A rank's share of what the generations in `history` left of the epoch."""
        left = remaining(self._order.num_samples, history) if history else None
        return RankShare(self._order, rank, world_size, batch_size, self.spec.drop_last, left)

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
        """Batches first..stop-1: without a transform, assembled here (same-host rows from
        the mapped files, others one request per holder); with one, by the local worker."""
        group = self._batches.batches(first, stop)
        ids = np.concatenate(group)
        blocks, offsets = self.info.locate(ids)
        keys = {int(k): self.info.block_key(int(k)) for k in np.unique(blocks)}
        last_error: Optional[BaseException] = None
        recovery = float(dask.config.get("dmdask.client.recovery-seconds"))
        isolate = False  # set once a worker was lost while this group's transform ran
        tries = Tries(recovery, pause=lambda attempt: min(1.0, 0.05 * attempt))
        async for _ in tries:
            await self._contact.check_scheduler()
            try:
                holders, loading = await self._holders_of(list(keys.values()))
                if len(holders) < len(keys):  # still loading, being recomputed after a loss, or no worker left
                    if not await self._contact.workers(wait=False):
                        self._contact.forget_worker()
                        await self._contact.workers()  # says once what it waits for; NoWorkersError after recovery-seconds
                        tries.deadline.renew()
                    tries.no_pause()  # the locate waited on the scheduler
                    continue
                plan, positions = plan_rows(blocks, offsets, keys, holders)
                if self._transform is None:  # assembled here: local rows straight from the files
                    arrays, from_store = await self._gatherer.gather(plan, positions, len(ids), priority=first,
                                                                     loading=loading)
                    self._cold = from_store > 0
                    self._gatherer.flush_hits_every(HITS_SECONDS)
                    index, extra = self._index(ids)
                    return split_batches({**arrays, **extra}, index, [len(b) for b in group])
                return await self._from_local_worker(plan, positions, ids, group, first, isolate)
            except BlockReadError:
                raise
            except (OSError, CommClosedError) as exc:  # a worker left: ask again
                last_error = exc
                if self._transform is not None and not isolate:
                    # the transform may have killed it: the next try runs it where it cannot kill a worker
                    logger.warning("a worker was lost while it ran the transform of batches %d..%d of rank %d; "
                                   "running them once more in a process of their own", first, stop - 1,
                                   self.spec.rank)
                    isolate = True
                self._contact.forget_worker()
                if not await self._contact.workers(wait=False):  # none left: wait as a new iterator does, saying so once
                    await self._contact.workers()  # NoWorkersError after recovery-seconds
                    tries.deadline.renew()  # one joined: the group gets its full time again
            except Moved as exc:
                last_error = exc
            except RuntimeError as exc:  # "ConnectionPool is closed": the client is losing its scheduler
                if self.client.status == "running":
                    raise
                last_error = exc
            self._holders.clear()
        if not await self._contact.workers(wait=False):
            raise no_workers(recovery) from last_error
        raise RuntimeError(f"batches {first}..{stop - 1} of rank {self.spec.rank} still failing after {recovery:.0f} s "
                           f"({tries.count} tries, dmdask.client.recovery-seconds); is the cluster losing workers?") \
            from last_error

    async def _from_local_worker(self, plan, positions, ids, group, first: int, isolate: bool = False) -> list:
        """Batches gathered and transformed by a worker on this node (`dmdask_batch`); when
        the transform failed on one, the batches before it and its `TransformError`.
        first: the position of the group's first batch (its reads' priority).
        isolate: the worker runs the transform in a process of its own (after a worker
        loss), so a transform that kills its process fails its batch, not another worker."""
        worker = await self._contact.local_worker()
        index, extra = self._index(ids)
        request = BatchRequest(plan, positions, index, [len(b) for b in group], list(self.info.fields),
                               self._transform, TransformContext(self.epoch, self.spec.seed), extra,
                               isolate=isolate, same_host=get_address_host(worker) == my_host(self.client),
                               priority=first, wait=LOAD_WAIT)
        reply = await self._gatherer.workers.call(worker, request)  # Moved when a holder lost a block
        self._cold = reply.from_store > 0
        # written into the worker's shared memory: mapped, not copied
        batches = map_batches(reply.shared) if reply.shared is not None else list(reply.batches)
        return batches + [reply.error] if reply.error is not None else batches

    def _index(self, ids: np.ndarray) -> tuple:
        """A group's "index" and its other fields not read from blocks: the ids as they
        are; for a mixture, the ids within their sources and "source"."""
        return (ids, {}) if self._mixed is None else self._mixed.batch_fields(ids)

    def _check_mixed_rows(self) -> None:
        """A mixture's batches mix the rows of its sources: `SpecError` now, before any
        batch, unless their fields have the same dtypes and sample shapes (one row of
        each source drawn is compared, once per process and mixture)."""
        key = (self.info.identity, self.info.fields)
        if key in _matching_mixtures:
            return
        rows = asyncio.run_coroutine_threadsafe(self._first_rows(), self._loop).result()
        check_fields_match(self._mixed, rows)
        _matching_mixtures.add(key)

    async def _first_rows(self) -> list:
        """The first row of every source drawn in an epoch (None for the others)."""
        out: list = []
        recovery = float(dask.config.get("dmdask.client.recovery-seconds"))
        for info, count in zip(self._mixed.sources, self._mixed.counts):
            if not count:
                out.append(None)
                continue
            key = info.block_key(0)
            async for _ in Tries(recovery, pause=0.1):
                await self._contact.check_scheduler()
                try:
                    holder = (await self._holders_of([key]))[0].get(key)
                    if holder is not None:
                        first_row = RowsRequest({key: np.zeros(1, dtype=np.int64)})
                        out.append((await self._gatherer.workers.call(holder, first_row)).arrays)
                        break
                except BlockReadError:
                    raise
                except (Moved, OSError, CommClosedError):  # its holder left or let the block go: ask again
                    pass
                self._holders.pop(key, None)
            else:  # no break: the deadline passed
                raise RuntimeError(f"the first block of {info.url} is still not available after {recovery:.0f} s "
                                   "(dmdask.client.recovery-seconds)")
        return out

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

    async def _holders_of(self, keys: List[str]) -> Tuple[Dict[str, str], Set[str]]:
        """(holders of the given blocks, the keys among them still loading), asking the
        scheduler plugin for those not known yet (`locate` waits up to LOCATE_SECONDS while they
        load, but names at once the worker loading a block right now: that one holds it in
        a moment, and waits for it when asked for its rows). Raises the load's error for a
        block that failed to load, `NotADmdaskWorker` if the dataset was released."""
        unknown = [k for k in keys if k not in self._holders]
        loading: Dict[str, str] = {}
        if unknown:
            found = await SchedulerAPI(self.client).locate(unknown, get_address_host(await self._contact.local_worker()),
                                                          planned=True)
            for error in found.erred.values():
                raise error
            if found.unknown:
                raise NotADmdaskWorker(f"the cluster no longer has the blocks of {self.spec.source} "
                                       f"(released by dmdask.release?): {found.unknown[:2]}")
            self._holders.update(found.holders)
            loading = found.loading  # not remembered: located again once loaded
        holders = {k: self._holders.get(k) or loading[k] for k in keys if k in self._holders or k in loading}
        return holders, {k for k in loading if k not in self._holders}

