"""`dmdask.batches(client, spec)`: one epoch of one rank's batches; the data path of a
batch is docs/architecture.md section 3."""
from __future__ import annotations

import asyncio
import functools
import time
from collections import deque

import dask.config
import numpy as np
from distributed import Client

from ..errors import SpecError
from ..plan.elastic import remaining
from ..plan.order import ORDER_VERSION, EpochOrder, RankShare, WindowShare
from ..source import dataset_name
from ..spec import Mix, Spec, as_int
from ..transform import dumps_transform
from .arenas import LocalArenas, split_batches
from .contact import Contact
from .datasets import open_dataset, open_datasets
from .fetch import HITS_SECONDS, GroupFetcher
from .first_batch import FirstBatch
from .gather import Gatherer, Moved, copier, fetchers
from .locate import my_host
from .mixture import SOURCE_FIELD, MixedInfo, check_fields_match, take_mixed, take_mixed_windows
from .progress import make as _make_progress
from .resume import resume_point

REQUEST_BYTES = 8 << 20  # small batches are fetched several per request, up to about this size
# ... and up to this many bytes of rows a request from other hosts' workers (the per-row index
# still within REQUEST_BYTES): at 3 KB rows, 24 MiB requests cost 22% less CPU per GB than 8 MiB
# ones (reader and holder, side by side); this host's rows keep REQUEST_BYTES (pooled memory)
REMOTE_REQUEST_BYTES = 32 << 20
PREFETCH = 8  # batches ahead when `Spec.prefetch` is None, or two groups where that is more
MAX_GROUP = 32  # ... and then up to this many small batches a request
MAX_WINDOW_GROUP = 128  # ... or a group of whole windows taken from the arenas here (no request: a copy each)
# ... of about this many bytes: a copy whose output stays in a core's cache until the consumer reaches it
# (warm tokens/s of 1,025-token windows, interleaved epochs, one process: at batch 8, groups of 1 MiB 1.05-1.3x
# numpy slicing against 0.86-0.95x at 2 MiB; at batch 64, 1-2 MiB 1.13-1.29x against 0.6-0.9x at 8 MiB)
WINDOW_GROUP_BYTES = 1 << 20
# what a request keeps per row besides the row (ids, blocks, offsets, orders: int64 arrays), counted in
# REQUEST_BYTES: 63 MiB for two requests of 32 batches of 8 windows of 1,025 uint16 tokens (126 B a row)
ROW_INDEX_BYTES = 128


def batches(client: Client, spec: Spec, epoch: int = 0, resume: dict | None = None, progress=None) -> BatchIterator:
    """An iterator over this rank's batches of one epoch.

    Each batch is a dict of numpy arrays, one per field of the source, plus "index": the
    global sample ids (int64) of its rows; a mixture (`dmdask.Mix`) adds "source" (int64,
    each row's source in the mixture) and "index" holds ids within those sources. Across
    `spec.world_size` ranks every sample of the epoch is delivered exactly once.
    `resume`: a `state_dict()` of an earlier iterator of the same spec and epoch (continues
    right after its last batch), or the list of every rank's from a run of another world
    or batch size (docs/failures.md, "Resuming"). `progress`: a tqdm bar (True, False, a
    dict of tqdm options, or None: on rank 0 when stderr is a terminal; docs/dashboard.md).
    """
    return BatchIterator(client, spec, epoch, resume, progress=progress)


class BatchIterator:
    """One epoch of one rank's batches, with bounded prefetch; `len()`: the batches this
    rank gets; `state_dict()` counts batches handed out, not batches prefetched."""

    def __init__(self, client: Client, spec: Spec, epoch: int = 0, resume: dict | None = None, progress=None):
        epoch = as_int("epoch", epoch, low=0)
        self.client, self.spec, self.epoch = client, spec, epoch
        self._mixed: MixedInfo | None = None  # the sources of a mixture, as one dataset of global ids
        self._loop = client.loop.asyncio_loop
        contact = Contact(client, spec.rank)
        self._transform = dumps_transform(spec.transform)
        host = my_host(client)
        specs = spec.source.specs(spec) if isinstance(spec.source, Mix) else [spec]
        # where the blocks are, to take them from the arenas here: asked with the open (`Ready.layouts`)
        learn = self._transform is None and not all(LocalArenas.knows_dataset(dataset_name(s)) for s in specs)
        # a cold dataset's claimant reads its first batch from the store itself (`FirstBatch`)
        self._first = FirstBatch(client, spec, epoch) if self._transform is None and resume is None and \
            not isinstance(spec.source, Mix) and spec.window is None and \
            dask.config.get("dmdask.client.read-first-batch") else None
        if len(specs) == 1:
            opened = [open_dataset(client, specs[0], epoch, host if learn else None,
                                   None if self._first is None else self._first.plan)]
        else:  # a mixture's sources opened at once
            opened = open_datasets(client, specs, epoch, host if learn else None)
        if isinstance(spec.source, Mix):  # with a window: an order of the sources' windows
            self.info = info = self._mixed = MixedInfo(spec.source, [o.info for o in opened], spec.window)
            self._order = info.order(shuffle=spec.shuffle, seed=spec.seed, epoch=epoch,
                                     shuffle_window=spec.shuffle_window)
        else:
            self.info = info = opened[0].info
            self._order = EpochOrder.of(info, spec, epoch)
        if spec.window is not None and self._mixed is None:  # the order of the windows (`WindowShare` reads their rows)
            windows = spec.window.count(info.num_samples)
            if not windows:
                raise SpecError("window", f"a length of at most the {info.num_samples} rows of {spec.source}",
                                spec.window)
            self._order = EpochOrder(windows, max(1, info.block_len // spec.window.stride), shuffle=spec.shuffle,
                                     seed=spec.seed, epoch=epoch)
        positions = self._order.num_samples  # of the epoch (a mixture's differ from its samples)
        if positions < spec.world_size:
            raise SpecError("world_size", f"at most the {positions} samples of an epoch of {spec.source}",
                            spec.world_size)
        self._history: list[dict] = []  # generations of ranks before this one in the epoch (elastic resume)
        self._position = 0
        if resume is not None:
            self._history, self._position = resume_point(resume, spec, self.state_dict(), self._share)
        self._batches = self._share(spec.rank, spec.world_size, spec.batch_size, self._history)
        if spec.drop_last and not len(self._batches) and not self._history:
            raise SpecError("batch_size", f"at most {positions // spec.world_size} with "
                            f"drop_last=True and world_size={spec.world_size}", spec.batch_size)
        self._next_request = self._position
        # (a concurrent future of a list of batches, or the call that makes them; whether they are windows)
        self._in_flight: deque = deque()
        self._ready_batches: deque = deque()
        self._datasets = datasets = info.sources if self._mixed is not None else [info]
        self._locals = [LocalArenas.of(d) for d in datasets]
        self._local = self._locals[0]
        for local in self._locals:
            local.forget_if_gone()
        self._gatherer = Gatherer(client, host, {d.identity: a for d, a in zip(datasets, self._locals)})
        self._fetcher = GroupFetcher(client, spec, epoch, info, self._batches, contact, self._gatherer, self._transform)
        warm = self._all_known()  # a warm cache on this host serves the first batch from its arenas
        if not warm:  # a warm cache on other hosts: its holders asked from the first batch on
            warm = all([self._fetcher.learn(ready) for ready in opened])
        self._fetcher.cold = not warm  # until a fetched batch needed no read from the store
        if self._fetcher.cold:  # a warm cache's batches need no worker: connections are made when needed
            contact.reach_ahead(self._loop)
        if self._mixed is not None:
            check_fields_match(self._mixed, lambda: self._run(self._fetcher.first_rows()))
        self.wait_seconds = 0.0  # time the consumer spent waiting for batches
        self.requests = 0  # requests sent to workers (batches taken from arenas on this host need none)
        # batches ahead of the consumer, or two groups where that is more (warm)
        self._prefetch = PREFETCH if spec.prefetch is None else spec.prefetch
        # windows in known arenas taken whole (`_copy_windows`), each a slice of at most two blocks
        self._whole_windows = spec.window is not None and self._transform is None and \
            spec.window.length <= min(d.block_len for d in datasets)
        self.group = self._group_size(rows_indexed=True)  # batches a warm request: two requests in flight
        # ... and a request of whole windows in known arenas (no index kept per row)
        self._window_group = self._group_size(rows_indexed=False) if self._whole_windows else self.group
        self.remote_group = self._group_size(rows_indexed=True, remote=True)  # ... to other hosts' workers
        self._remote = False  # the last warm request went to other hosts' workers
        self._ahead = max(self._prefetch, self.group, self._window_group, self.remote_group)  # the most in flight
        self._num_batches = len(self._batches)
        self._progress = _make_progress(self, progress)  # None unless a bar is shown

    def _group_size(self, rows_indexed: bool, remote: bool = False) -> int:
        """Batches a warm request: half the prefetch; by default up to MAX_GROUP small batches,
        of up to about REQUEST_BYTES, counting ROW_INDEX_BYTES a row (`rows_indexed`); else
        whole windows copied from the arenas here, of about WINDOW_GROUP_BYTES, and up to
        MAX_WINDOW_GROUP batches. `remote`: a request to other hosts' workers, by default up
        to REMOTE_REQUEST_BYTES of rows with their index within REQUEST_BYTES (never fewer
        batches than this host's)."""
        spec, info = self.spec, self.info
        group = max(1, self._prefetch // 2)
        if info.nbytes is None:
            return group
        rows = spec.batch_size * (1 if spec.window is None else spec.window.length)  # a batch's rows
        data = rows * info.nbytes / max(1, info.num_samples)
        index = ROW_INDEX_BYTES * (rows if rows_indexed else spec.batch_size)
        if remote and spec.prefetch is None:
            by_bytes = min(REMOTE_REQUEST_BYTES // max(1.0, data), REQUEST_BYTES // index)
        elif not rows_indexed:
            by_bytes = WINDOW_GROUP_BYTES // max(1.0, data)
        else:
            by_bytes = REQUEST_BYTES // max(1.0, data + index)
        most = group if spec.prefetch is not None else MAX_GROUP if rows_indexed else MAX_WINDOW_GROUP
        return int(max(1, min(by_bytes, most)))

    @property
    def position(self) -> int:
        """Batches handed out so far in this epoch."""
        return self._position

    @property
    def requested(self) -> int:
        """Batches handed out, ready or in flight (at most `position + spec.prefetch`; by
        default, 8 or two groups of about 8 MiB, where that is more)."""
        return self._next_request

    @property
    def progress(self):
        """The epoch's `EpochProgress` (its tqdm bar as `.bar`); None when none is shown or after the epoch."""
        return self._progress

    def __len__(self) -> int:
        return len(self._batches)

    def __iter__(self):
        return self

    def __next__(self) -> dict[str, np.ndarray]:
        if not self._ready_batches:
            self._fill()
            if not self._in_flight:
                self._end_progress()
                raise StopIteration
            started = time.perf_counter()
            future, windowed = self._in_flight.popleft()
            try:
                batches = future() if callable(future) else future.result()
            except BaseException:
                self.close()
                raise
            self._ready_batches.extend(batches if windowed else self._as_windows(batches))
            self.wait_seconds += time.perf_counter() - started
        batch = self._ready_batches.popleft()
        if isinstance(batch, BaseException):  # the batches before it were handed out
            self.close()
            raise batch
        self._position += 1
        if self._progress is not None:
            self._progress.update()
        if self._next_request - self._position <= self._ahead:  # else far enough ahead (`_fill`'s first test)
            self._fill()
        return batch

    def _fill(self) -> None:
        """Keep up to `spec.prefetch` batches (by default, 8 or two groups) requested or
        ready, earliest first: one batch a request while cold (`GroupFetcher.cold`) and for
        batch 0, `self.group` batches while warm (whole windows in known arenas: `self._window_group`;
        `self.remote_group` once the last request went to other hosts' workers)."""
        while self._next_request < self._num_batches:
            pending = self._next_request - self._position
            if pending > self._ahead:  # ahead enough
                break
            group = 1 if self._fetcher.cold or not self._next_request else \
                self._window_group if self._whole_windows and self._all_known() else \
                self.remote_group if self._remote else self.group  # batch 0 alone
            if pending + group > max(self._prefetch, 2 * group):  # cold: `prefetch` requests of a batch
                break
            stop = min(len(self._batches), self._next_request + group)
            self._in_flight.append(self._request(self._next_request, stop))
            self._next_request = stop

    def _request(self, first: int, stop: int) -> tuple:
        """(A future of batches first..stop-1, copied from the arenas where it can be, else
        fetched; whether they are windows already, else rows of windows or plain rows).
        Windows in known arenas are taken whole, never expanded to rows (`_copy_windows`),
        by the consumer when it reaches them, as numpy slicing would be: the "future" is
        that call (a copy of one slice a window costs less than a hand-off to a thread)."""
        if self._whole_windows:
            windows = self._batches.windows(first, stop)
            ids = windows[0] if len(windows) == 1 else np.concatenate(windows)
            starts = self._batches.starts_of(ids)
            if self._windows_known(starts):
                return functools.partial(self._copy_windows, first, stop, windows, ids, starts), True
        group = self._batches.batches(first, stop)
        if first == 0 and stop == 1 and self._first is not None and self._first.batch is not None:
            return asyncio.run_coroutine_threadsafe(self._first_batch(group[0]), self._loop), False
        self._remote = False
        if self._transform is None and self._known(group):
            return copier.submit(self._copy_known, first, stop, group), False
        if self._transform is None and not self._fetcher.cold:
            self._remote = True
            self.requests += 1
            return fetchers.submit(self._fetch_known, first, stop, group), False
        return self._fetch(first, stop), False

    def _as_windows(self, batches: list) -> list:
        """Batches of rows of windows as batches of windows (`Window.as_windows`); others as they are."""
        if self.spec.window is None:
            return batches
        return [b if isinstance(b, BaseException) else self.spec.window.as_windows(b, per_window=(SOURCE_FIELD,))
                for b in batches]

    async def _first_batch(self, ids: np.ndarray) -> list:
        """Batch 0 as this rank read it from the store (`FirstBatch`), once its rows reached
        their workers; fetched if that read or that giving failed."""
        first, self._first = self._first, None  # its arrays not kept past the batch
        try:  # once its blocks are held: a load that failed (a source not allowed) fails the batch as fetched
            batch = await asyncio.wrap_future(first.batch)
            await asyncio.wrap_future(first.given)
        except Exception:  # noqa: BLE001 - the workers read the batch (and report any error)
            batch = None
        if batch is None or not np.array_equal(batch["index"], ids):
            return await self._fetcher.fetch(0, 1)
        return [batch]

    def _fetch(self, first: int, stop: int):
        self.requests += 1
        return asyncio.run_coroutine_threadsafe(self._fetcher.fetch(first, stop), self._loop)

    def _run(self, coroutine):
        """The result of a coroutine run on the client's event loop, from this thread."""
        return asyncio.run_coroutine_threadsafe(coroutine, self._loop).result()

    def _all_known(self) -> bool:
        return all(a.knows(np.arange(d.num_blocks)) for d, a in zip(self._datasets, self._locals))

    def _known(self, group: list[np.ndarray]) -> bool:
        """Whether every block of the group (a mixture: of every source) is in a known arena."""
        if self._mixed is not None:
            return self._all_known()
        return self._local.knows(np.concatenate(group) // self.info.block_len)

    def _windows_known(self, starts: np.ndarray) -> bool:
        """Whether every block of the windows whose first rows are `starts` is in a known arena."""
        if self._mixed is not None:
            return self._all_known()
        block_len = self.info.block_len
        return self._local.knows(starts // block_len) and \
            self._local.knows((starts + (self.spec.window.length - 1)) // block_len)

    def _copy_windows(self, first: int, stop: int, windows: list[np.ndarray], ids: np.ndarray,
                      starts: np.ndarray) -> list:
        """In the consumer's thread: the group's windows (ids `ids`, first rows `starts`) from
        the arenas, each copied whole (`LocalArenas.take_windows`), as batches of windows."""
        try:
            if self._mixed is not None:
                arrays, index, sources = take_mixed_windows(self._mixed, self._locals, ids, self._gatherer.count)
                arrays[SOURCE_FIELD] = sources
            else:
                arrays, index = self._local.take_windows(starts, self.spec.window.length, self._gatherer.count), ids
        except Moved:  # released or moved since it was known: locate the blocks again
            return self._as_windows(self._fetch(first, stop).result())
        if self._gatherer.due(HITS_SECONDS):  # wakes the event loop only when a report is due
            self._loop.call_soon_threadsafe(self._gatherer.flush_hits_every, HITS_SECONDS)
        return split_batches(arrays, index, [len(w) for w in windows])

    def _copy_known(self, first: int, stop: int, group: list[np.ndarray]) -> list:
        """In the copier thread: the group's rows from the arenas."""
        try:
            if self._mixed is not None:
                out = take_mixed(self._mixed, self._locals, group, self._gatherer.count)
            else:
                out = self._local.take(group, self._gatherer.count, 1 if self.spec.window is None else
                                       self.spec.window.length)
        except Moved:  # released or moved since it was known: locate the blocks again
            return self._fetch(first, stop).result()
        if self._gatherer.due(HITS_SECONDS):  # wakes the event loop only when a report is due
            self._loop.call_soon_threadsafe(self._gatherer.flush_hits_every, HITS_SECONDS)
        return out

    def _fetch_known(self, first: int, stop: int, group: list[np.ndarray]) -> list:
        """In a fetcher thread: the group asked of its holders on other hosts with no hop
        through the event loop (`GroupFetcher.fetch_known`), else fetched on the loop."""
        try:
            out = self._fetcher.fetch_known(first, group)
        except Exception:  # noqa: BLE001 - a lost or moved holder, a corrupt block: fetched again, which recovers
            out = None
        if out is None:
            return asyncio.run_coroutine_threadsafe(self._fetcher.fetch(first, stop), self._loop).result()
        return out

    def close(self) -> None:
        """Cancel batches in flight; the iterator is exhausted afterwards."""
        self._end_progress()
        for fut, _ in self._in_flight:
            if not callable(fut):
                fut.cancel()
        self._in_flight.clear()
        self._ready_batches.clear()
        self._next_request = len(self._batches)

    def _end_progress(self) -> None:
        """The bar closed and the hits sent to the workers (counters only: the epoch does not
        wait for them; `dmdask.stats` does)."""
        if self._progress is not None:
            self._progress.close()
            self._progress = None
        self._gatherer.report_hits()

    def state_dict(self) -> dict:
        """The whole position, plain values (JSON, pickle): pass it as `resume=` to continue
        after the last batch handed out; or, with another world size, pass every rank's."""
        spec = self.spec
        return {"order": ORDER_VERSION, "identity": self.info.identity, "epoch": self.epoch, "seed": spec.seed,
                "shuffle": spec.shuffle, "shuffle_window": spec.shuffle_window, "rank": spec.rank,
                "world_size": spec.world_size, "batch_size": spec.batch_size,
                "drop_last": spec.drop_last, "position": self._position,
                "window": None if spec.window is None else [spec.window.length, spec.window.stride],
                "history": [dict(g) for g in self._history]}

    def _share(self, rank: int, world_size: int, batch_size: int, history: list[dict]) -> RankShare | WindowShare:
        """A rank's share of what the generations in `history` left of the epoch (of its windows' rows)."""
        left = remaining(self._order.num_samples, history) if history else None
        share = RankShare(self._order, rank, world_size, batch_size, self.spec.drop_last, left)
        if self.spec.window is None:
            return share
        return WindowShare(share, self.spec.window, None if self._mixed is None else self._mixed.window_starts)
