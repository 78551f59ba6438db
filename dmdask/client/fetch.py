"""Fetching a group of one iterator's batches on the client's event loop (docs/architecture.md
section 3, steps 5-6), retried after a lost worker or a moved block until
`dmdask.client.recovery-seconds`; after a corrupt block, one batch at a time.
"""
from __future__ import annotations

import asyncio
import logging

import dask.config
import numpy as np
from distributed.comm import get_address_host
from distributed.comm.core import CommClosedError

from ..errors import BlockReadError, NotADmdaskWorker
from ..plan.order import RankShare
from ..protocol.rows import asked_of
from ..protocol.scheduler import LeftOnPurpose, Ready, SchedulerAPI
from ..protocol.worker import BatchRequest
from ..recovery import Tries
from ..shm.results import map_batches
from ..transform import TransformContext
from .arenas import split_batches
from .coalesce import Coalesced
from .contact import Contact
from .engine import Exhausted, StillLoading, fetch_rows
from .gather import LOAD_WAIT, Gatherer, Moved, channels_of, peer_threads
from .locate import my_host
from .mixture import MixedInfo

logger = logging.getLogger(__name__)
LEFT_ON_PURPOSE_WAITS = (0.25, 0.5, 1.0)  # asked again after these: the scheduler may learn of a closing late
HITS_SECONDS = 1.0  # how often workers hear of the rows taken from their files (progress bar, dashboard)


class GroupFetcher:
    """Fetches groups of an iterator's batches (`share`); coroutines of the client's loop.
    `cold`: whether the last group fetched needed rows read from the store."""

    def __init__(self, client, spec, epoch: int, info, share: RankShare, contact: Contact, gatherer: Gatherer,
                 transform: bytes | None):
        self.client, self.spec, self.epoch, self.info = client, spec, epoch, info
        self.mixed = info if isinstance(info, MixedInfo) else None  # a mixture's sources, as one dataset
        self.share, self.contact, self.gatherer, self.transform = share, contact, gatherer, transform
        self.holders: dict[str, str] = {}  # block key -> a worker holding it
        self.cold = True
        self._locate = Coalesced(self._locate_now)  # the groups in flight locate their blocks together

    async def fetch(self, first: int, stop: int) -> list:
        """Batches first..stop-1; after a corrupt block, the ones before it and the error."""
        try:
            return await self._fetch_group(first, stop)
        except BlockReadError:
            if stop - first == 1:
                raise
        out: list = []
        for i in range(first, stop):
            try:
                out.extend(await self._fetch_group(i, i + 1))
            except BlockReadError as exc:
                out.append(exc)
                break
        return out  # without an error: the group's did not come back one batch at a time

    async def _fetch_group(self, first: int, stop: int) -> list[dict[str, np.ndarray]]:
        group = self.share.batches(first, stop)
        ids = np.concatenate(group)
        blocks, offsets = self.info.locate(ids)
        unique = np.unique(blocks)
        keys = dict(zip(unique.tolist(), self.info.block_keys(unique)))
        recovery = float(dask.config.get("dmdask.client.recovery-seconds"))
        isolate = False  # set once a worker was lost while this group's transform ran

        async def attempt(plan, positions, loading):
            if self.transform is None:  # assembled here: local rows straight from the files
                arrays, from_store = await self.gatherer.gather(plan, positions, len(ids), priority=first,
                                                                loading=loading)
                self.cold = from_store > 0
                self.gatherer.flush_hits_every(HITS_SECONDS)
                index, extra = self._index(ids)
                return split_batches({**arrays, **extra}, index, [len(b) for b in group])
            return await self._from_local_worker(plan, positions, ids, group, first, isolate)

        async def lost(exc: BaseException) -> None:
            nonlocal isolate
            if self.transform is not None and not isolate and await self._maybe_killed_by_transform():
                logger.warning("a worker was lost while it ran the transform of batches %d..%d of rank %d; "
                               "running them once more in a process of their own", first, stop - 1, self.spec.rank)
                isolate = True

        try:
            return await fetch_rows(self.contact, keys, blocks, offsets, self.holders_of,
                                    lambda _: self.holders.clear(), attempt, recovery, on_lost=lost)
        except StillLoading as exc:
            raise RuntimeError(f"batches {first}..{stop - 1} of rank {self.spec.rank}: {exc.explain()}") \
                from exc.__cause__
        except Exhausted as exc:
            cause = "is the cluster losing workers?"
            if isinstance(exc.__cause__, TimeoutError):  # a worker that heartbeats yet never answers is not lost
                cause = f"the last try: {exc.__cause__} (a worker is treated as lost after " \
                        "dmdask.worker.silent-seconds with no heartbeat)"
            raise RuntimeError(f"batches {first}..{stop - 1} of rank {self.spec.rank} still failing after "
                               f"{recovery:.0f} s ({exc.tries} tries: {exc.what_failed()}; "
                               f"dmdask.client.recovery-seconds); {cause}") from exc.__cause__

    async def _maybe_killed_by_transform(self) -> bool:
        """Whether the local worker, just lost, may have been killed by the transform it ran:
        not when it closed on purpose (a cluster closing, a scale-down; the scheduler is asked
        again for 1.75 s, as a worker's word of its closing may reach it after the rank's
        request failed), nor when the scheduler cannot say (it is going away too: the next
        try finds out)."""
        worker = self.contact.worker
        if worker is None:  # the request lost was not to a worker running the transform
            return False
        for wait in (*LEFT_ON_PURPOSE_WAITS, None):
            try:
                if await SchedulerAPI(self.client).send(LeftOnPurpose(worker)):
                    return False
            except (OSError, CommClosedError, RuntimeError):
                return False
            if wait is None:
                return True
            await asyncio.sleep(wait)  # a closing worker's word may reach the scheduler after our request failed

    def fetch_known(self, first: int, group: list[np.ndarray]) -> list | None:
        """In any thread: the batches `group` (sample ids), from batch `first` on, of a warm
        iterator with no transform whose blocks all have known holders, taken with no hop
        through the event loop (`Gatherer.gather_known`); None when that does not apply.
        Any error is raised, and the caller fetches the group with `fetch`, which recovers."""
        if self.transform is not None or self.cold:
            return None
        ids = np.concatenate(group)
        blocks, offsets = self.info.locate(ids)
        unique, index = np.unique(blocks, return_inverse=True)
        keys = self.info.block_keys(unique)
        holders = list(map(self.holders.get, keys))
        if None in holders:
            return None
        arrays = self.gatherer.gather_known(keys, holders, index, offsets, priority=first)
        if arrays is None:
            return None
        index, extra = self._index(ids)
        return split_batches({**arrays, **extra}, index, [len(b) for b in group])

    async def _from_local_worker(self, plan, positions, ids, group, first: int, isolate: bool) -> list:
        """Batches gathered and transformed by a worker on this node (`isolate`: in a process
        of its own); when the transform failed on one, the batches before it and its error."""
        worker = await self.contact.local_worker()
        index, extra = self._index(ids)
        request = BatchRequest(plan, positions, index, [len(b) for b in group], list(self.info.fields),
                               self.transform, TransformContext(self.epoch, self.spec.seed), extra,
                               isolate=isolate, same_host=get_address_host(worker) == my_host(self.client),
                               priority=first, wait=LOAD_WAIT)
        reply = await self.gatherer.workers.call(worker, request)  # Moved when a holder lost a block
        self.cold = reply.from_store > 0
        # written into the worker's shared memory: mapped, not copied
        batches = map_batches(reply.shared) if reply.shared is not None else list(reply.batches)
        return batches + [reply.error] if reply.error is not None else batches

    def _index(self, ids: np.ndarray) -> tuple:
        """A group's "index" and its fields not read from blocks (a mixture's "source")."""
        return (ids, {}) if self.mixed is None else self.mixed.batch_fields(ids)

    def learn(self, ready: Ready) -> bool:
        """Before the first fetch: where `ready`'s blocks were, and how to map those on this
        host (docs/architecture.md section 3, step 3). True when every block of its dataset
        was held then (a warm start: no row needs the store)."""
        info = ready.info
        self.holders.update({info.block_key(k): worker for worker, blocks in ready.holders.items() for k in blocks})
        self.gatherer.learn(info.identity, ready.layouts)
        held = set().union(*ready.holders.values()) if ready.holders else set()
        return ready.loaded >= info.num_blocks and len(held) >= info.num_blocks

    async def first_rows(self) -> list:
        """The first row of every source of the mixture drawn in an epoch (None for the others)."""
        out: list = []
        recovery = float(dask.config.get("dmdask.client.recovery-seconds"))
        for info, count in zip(self.mixed.sources, self.mixed.counts):
            if not count:
                out.append(None)
                continue
            key = info.block_key(0)
            async for _ in Tries(recovery, pause=0.1):
                await self.contact.check_scheduler()
                try:
                    holder = (await self.holders_of([key]))[0].get(key)
                    if holder is not None:
                        first_row = asked_of({key: np.zeros(1, dtype=np.int64)})
                        out.append((await channels_of(self.client).fetch(peer_threads, holder, first_row))[0])
                        break
                except BlockReadError:
                    raise
                except (Moved, OSError, CommClosedError):  # its holder left or let the block go: ask again
                    pass
                self.holders.pop(key, None)
            else:  # no break: the deadline passed
                raise RuntimeError(f"the first block of {info.url} is still not available after {recovery:.0f} s "
                                   "(dmdask.client.recovery-seconds)")
        return out

    async def _locate_now(self, keys: list[str]):
        return await SchedulerAPI(self.client).locate(keys, get_address_host(await self.contact.local_worker()),
                                                      planned=True)

    async def holders_of(self, keys: list[str]) -> tuple[dict[str, str], set[str]]:
        """(holders of the given blocks, the keys among them still loading), the unknown located
        (`planned`; together with those of the other groups in flight). Raises the load's
        error of a block that failed, `NotADmdaskWorker` if released."""
        unknown = [k for k in keys if k not in self.holders]
        loading: dict[str, str] = {}
        if unknown:
            found = await self._locate(unknown)
            for key in unknown:
                if key in found.erred:
                    raise found.erred[key]
            released = set(found.unknown)
            gone = [k for k in unknown if k in released]
            if gone:
                raise NotADmdaskWorker(f"the cluster no longer has the blocks of {self.spec.source} "
                                       f"(released by dmdask.release?): {gone[:2]}")
            self.holders.update(found.holders)
            loading = found.loading  # not remembered: located again once loaded
        holders = {k: self.holders.get(k) or loading[k] for k in keys if k in self.holders or k in loading}
        return holders, {k for k in keys if k in loading and k not in self.holders}
