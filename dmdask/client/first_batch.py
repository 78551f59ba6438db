"""A cold dataset's first batch, read from the store by the rank that creates its blocks.

The rank that opens a dataset no process holds yet (the claimant, `get_or_create`) reads its
own first batch of the epoch straight from the store while the scheduler and the workers
create the blocks, so the store is busy from the moment the dataset is opened (as a plain
DataLoader's is), not only once the first load task reaches a worker. Only for sources read
sample by sample (`row_granular`), with no transform, at an epoch's start, and unless
`dmdask.client.read-first-batch` is off.

Guarantees: the readers of the blocks it reads from name those rows and a secret claim
(`rank_rows`, `claim`); no worker reads them ahead, and a block read whole waits for
them (`dmdask.worker.given`); the rank gives them to the blocks' workers once read
(`dmdask_give_rows`), so every sample leaves the store once. Batch 0 is handed out once the
giving is answered, and holds the same samples, in the same order, as when fetched; if a
read or the giving failed (a load that failed, such as a source the workers may not read),
batch 0 is fetched instead, and reports the failure. Rows never given are read when a rank
next asks for them (a block read whole waits for them 5 s at most).
"""
from __future__ import annotations

import asyncio
import concurrent.futures
import logging
import threading
import uuid
from collections import defaultdict

import numpy as np

from ..plan.order import EpochOrder, RankShare
from ..protocol.scheduler import SchedulerAPI
from ..protocol.worker import MAX_WAIT, GiveRows, WorkerAPI
from ..recovery import reply_seconds
from .locate import my_host

logger = logging.getLogger(__name__)
READ_THREADS = 16  # blocks read at once


class FirstBatch:
    """One rank's first batch of `epoch`, named in its blocks' readers by `plan`, read once
    the function `plan` returns is called, and given to the workers as soon as read;
    `batch`: its future ({field: array, "index": ids}), None until `plan` named rows;
    `given`: the future of the giving (on `client`'s loop), None until then."""

    def __init__(self, client, spec, epoch: int):
        self.client, self.spec, self.epoch = client, spec, epoch
        self.claim = uuid.uuid4().hex  # a secret the blocks' readers carry: only these rows are taken
        self.given: concurrent.futures.Future | None = None
        self.batch: concurrent.futures.Future | None = None
        self._reads: dict[int, tuple[np.ndarray, concurrent.futures.Future]] = {}  # block -> rows, their arrays
        self._retries: dict[int, int] = defaultdict(int)  # block -> transient errors its read retried

    def ids(self, info) -> np.ndarray:
        """The sample ids of this rank's first batch (as `BatchIterator` computes them)."""
        spec = self.spec
        share = RankShare(EpochOrder.of(info, spec, self.epoch), spec.rank, spec.world_size, spec.batch_size,
                          spec.drop_last, None)
        return share.batches(0, 1)[0] if len(share) else np.zeros(0, dtype=np.int64)

    def plan(self, info, readers: list):
        """Name this rank's first-batch rows in the readers of their blocks (`rank_rows`,
        `claim`), before the readers are submitted; the function that starts reading
        them (no I/O before it is called; call it once the loads are submitted, so the
        workers start as early as they can), or None: nothing to read (readers of whole blocks)."""
        if not readers or not readers[0].row_granular:
            return None
        ids = self.ids(info)
        if not len(ids):
            return None
        blocks, offsets = info.locate(ids)
        wanted = {int(k): np.unique(offsets[blocks == k]) for k in np.unique(blocks)}
        for k, rows in wanted.items():
            readers[k].rank_rows, readers[k].claim = tuple(rows.tolist()), self.claim
        self.batch = concurrent.futures.Future()
        return lambda: self._start(info, readers, ids, blocks, offsets, wanted)

    def _start(self, info, readers: list, ids, blocks, offsets, wanted: dict) -> None:
        """Read the named rows, up to `READ_THREADS` blocks at once; once every read ended,
        give the rows and set `batch`. Never raises (the loads are submitted by then):
        `batch` fails instead, and the iterator fetches batch 0."""
        left, lock = [len(wanted)], threading.Lock()

        def read(_) -> None:  # in a read thread: once every read ended, the batch assembled and the rows given
            with lock:
                left[0] -= 1
                if left[0]:
                    return
            try:
                self.given = asyncio.run_coroutine_threadsafe(self._give(info), self.client.loop.asyncio_loop)
            except RuntimeError as exc:  # the client's loop is closed: batch 0 is still set, never waited for
                self.given = concurrent.futures.Future()
                self.given.set_exception(exc)
            try:
                self.batch.set_result(self._assemble(ids, blocks, offsets))
            except Exception as exc:  # noqa: BLE001 - a read failed: the iterator fetches the batch
                self.batch.set_exception(exc)

        try:
            pool = concurrent.futures.ThreadPoolExecutor(min(READ_THREADS, len(wanted)), "dmdask-first-batch")
            self._reads = {k: (rows, pool.submit(readers[k].read_rows, rows, self._counter(k)))
                           for k, rows in wanted.items()}
        except Exception as exc:  # noqa: BLE001 - no thread to read with: the iterator fetches the batch
            self.batch.set_exception(exc)
            return
        for _, future in self._reads.values():
            future.add_done_callback(read)
        pool.shutdown(wait=False)  # its threads end with the reads

    def _counter(self, k: int):
        def retried(_exc) -> None:
            self._retries[k] += 1
        return retried

    def _assemble(self, ids: np.ndarray, blocks: np.ndarray, offsets: np.ndarray) -> dict[str, np.ndarray]:
        out: dict[str, np.ndarray] = {}
        for k, (rows, future) in self._reads.items():
            arrays = future.result()
            mine = np.flatnonzero(blocks == k)
            where = np.searchsorted(rows, offsets[mine])
            for name, values in arrays.items():
                if name not in out:
                    out[name] = np.empty((len(ids),) + values.shape[1:], dtype=values.dtype)
                out[name][mine] = values[where]
        out["index"] = ids
        return out

    async def _give(self, info) -> None:
        """Give the rows read to the workers holding (or loading) their blocks, once those
        hold them. Raises if a block was not held then (its load failed, or is slow), or a
        read failed: the iterator fetches batch 0 instead (which reports a failed load);
        the rows not given are read when a rank next asks for them."""
        try:
            keys = {info.block_key(k): k for k in self._reads}
            # the keys are being submitted (perhaps not yet): waited for, like loading blocks
            found = await SchedulerAPI(self.client).locate(list(keys), my_host(self.client), expect=list(keys),
                                                           planned=True)
            requests: dict[str, GiveRows] = defaultdict(lambda: GiveRows({}, {}, self.claim, wait=MAX_WAIT))
            for key, holder in {**found.loading, **found.holders}.items():
                rows, future = self._reads[keys[key]]
                if future.exception() is None:  # else its worker reads those rows
                    requests[holder].rows[key] = rows
                    requests[holder].arrays[key] = future.result()
                    requests[holder].retries += self._retries[keys[key]]
            workers = WorkerAPI(self.client.rpc, reply_seconds=reply_seconds())  # a paused worker: fetched instead
            await asyncio.gather(*(workers.give_rows(holder, request) for holder, request in requests.items()))
            missing = sorted(set(keys).difference(*(r.rows for r in requests.values())))
            if missing:
                raise RuntimeError(f"blocks not given (a read failed, or not held): {missing[:3]}")
        except Exception as exc:
            logger.debug("rank %d's first batch was not all given to its workers: %r", self.spec.rank, exc)
            raise
