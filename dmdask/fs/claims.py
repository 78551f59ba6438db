"""First reads in transparent mode: blocks nobody holds are claimed from the scheduler
(`OpenBlocks`; a file new to the run also its info, `FsClaim`, from the same ranged GET:
`dmdask.fs.probe`), read from the store by the claimant and handed over in the background to
their planned workers, whose loads take those bytes (docs/transparent.md, "Blocks"). Should
the hand-over fail, the worker reads the block itself. A process's exit waits at most
`HANDOVER_EXIT_SECONDS` for its hand-overs.
"""
from __future__ import annotations

import asyncio
import logging
import secrets
import threading
import time
import itertools
from collections import OrderedDict
from collections.abc import Iterable

import dask.config
import fsspec
from distributed.protocol.pickle import dumps

from ..client.datasets import submit_blocks
from ..errors import NotADmdaskWorker
from ..protocol.scheduler import FileEntry, FsHeld, FsOpenBlocks, NoWorkers, OpenBlocks, SchedulerAPI
from ..protocol.worker import WorkerAPI
from ..recovery import Tries
from ..source.files import FileSource, read_blocks
from . import probe
from .inside import serving
from .metadata import ELSEWHERE, folder_of, plain

logger = logging.getLogger(__name__)

HANDOVER_EXIT_SECONDS = 10.0  # the most a process's exit waits for its hand-overs to reach the workers
# Blocks read from the store within HANDOVER_DELAY are handed over together (one graph of
# loads), those read with their infos within OPEN_DELAY opened together (one request), up
# to HANDOVER_BYTES queued. Each batch costs the scheduler and the workers a graph, a request
# per worker and a task per block's messages: on a 2-core machine, 2,000 first reads by 4
# loader processes cost 12.0 CPU-s over all processes at 0.25 s / 0.05 s, 8.1 at 1 s / 0.25 s
# (the direct read: 6.1), and epoch 1 went from 1.4x to 1.0x the direct read's.
HANDOVER_DELAY = 1.0
OPEN_DELAY = 0.25
# In a Dask worker's process (a task's read: xarray, dask.dataframe) the blocks' loads may be
# queued behind the tasks that wait for them, on one-thread workers: handed over sooner there
# (tests/test_inside_cluster.py stalled at 0.25 s for the opens).
WORKER_HANDOVER_DELAY = 0.25
WORKER_OPEN_DELAY = 0.05
HANDOVER_BYTES = 64 << 20
AHEAD_BYTES = 64 << 20  # the most bytes read ahead kept until read (`Claims.ahead`)


class Claims:
    """One process's first reads and hand-overs. Thread-safe."""

    def __init__(self, session):
        self.session = session
        self._lock = session.lock
        self._claim = secrets.token_hex(16)  # what this process hands blocks over with (`Handovers`)
        self.handing: dict[str, dict] = {}  # block key -> its rows, read here, being handed to its worker
        self._handed = threading.Condition(self._lock)  # notified as hand-overs finish
        self.to_hand: list[tuple] = []  # (worker, reader, bytes) queued for the next hand-over
        self._queued_bytes = 0  # bytes in to_hand and to_open
        self.to_open: list[tuple] = []  # (info put, reader or None, its DatasetInfo or None, bytes): `first_info`
        self.reading_ahead: dict[str, threading.Event] = {}  # fsid|path -> set once its read ahead ended
        self.ahead: OrderedDict[str, tuple] = OrderedDict()  # block key -> (rows read ahead, bytes), until read
        self._ahead_bytes = 0  # in `ahead`, at most AHEAD_BYTES (the oldest dropped)

    def first_info(self, fs, path: str, start: int | None = 0, ahead: Iterable[str] = (), most: int = 0) -> dict:
        """The info of `path` for reading it from byte `start` (None: from its end). On HTTP a
        file new to the run is claimed and asked with the ranged GET of the block holding
        `start`, whose bytes the read that follows takes: one scheduler and one store round trip.
        `ahead`: other files (target naming) to read ahead so: the first `most` of them new to
        the run are claimed in the same scheduler request, and their first blocks read
        concurrently, in the background (`read_ahead`)."""
        self.session.check_workers()
        fsid, metadata = fs.target_id, self.session.metadata
        found = metadata.known_info(fsid, path) or self._read_ahead_info(fsid, path)
        if found is not None:
            return found
        target = fsspec.filesystem(fs.target_protocol, **fs.target_options)  # this process's own
        if start is None or start < 0 or not probe.applies(target):
            return metadata.info(fsid, fs.fs, path)
        new = (p for p in ahead if p != path and metadata.infos.get(f"{fsid}|{p}") is None
               and f"{fsid}|{p}" not in self.reading_ahead)
        ahead = list(dict.fromkeys(itertools.islice(new, most)))
        if ahead:
            found = self._claim_with(fs, target, path, ahead)
        else:
            found = metadata.claim_info(fsid, path)
        if found is ELSEWHERE:  # a HEAD, not a GET: the bytes may be cached already
            return metadata.info(fsid, fs.fs, path)
        if found is not None:
            return found
        block_bytes = FileSource.block_bytes_of(fs.block_bytes)
        index = start // block_bytes
        try:
            got = probe.first_block(target, path, index * block_bytes, block_bytes)
            if got is None:
                return metadata.info(fsid, fs.fs, path)
        except Exception:  # a missing file (404), a store error: the claim ends with it
            metadata.release(fsid, path)
            raise
        return self._took(fs, path, index, got)

    def _claim_with(self, fs, target, path: str, ahead: list[str]):
        """`claim_info` of `path` with the claims of `ahead` in the same request; the first
        blocks of those of `ahead` claimed are read in the background (`read_ahead`)."""
        fsid, metadata = fs.target_id, self.session.metadata
        known, elsewhere, probing = metadata.claim_infos(fsid, [path] + ahead)
        mine = [p for p in ahead if p not in known and p not in elsewhere and p not in probing]
        if mine:
            self.read_ahead(fs, target, mine)
        if path in known:
            return known[path]
        if path in elsewhere:
            return ELSEWHERE
        if path in probing:  # another process of the run reads it: wait for its info
            return metadata.claim_info(fsid, path)
        return None  # claimed: this process reads it

    def read_ahead(self, fs, target, paths: list[str]) -> None:
        """Read the first blocks (and so the infos) of `paths`, which this process claimed,
        concurrently on `target`'s event loop, not waiting for them: each is then known to
        this process and handed over as a first read's block is (`_took`); a file that
        fails is released, and a later read of it asks the store again."""
        fsid = fs.target_id
        block_bytes = FileSource.block_bytes_of(fs.block_bytes)
        with self._lock:
            events = {p: self.reading_ahead.setdefault(f"{fsid}|{p}", threading.Event()) for p in paths}

        def done(path: str, future) -> None:
            try:
                if self.session.connected is None:  # closed meanwhile (`dmdask.fs.close`): its claims end with it
                    return
                got = None if future.cancelled() or future.exception() is not None else future.result()
                if got is not None:
                    self._took(fs, path, 0, got, keep=True)
                else:
                    self.session.client.loop.add_callback(self.session.metadata.release_soon, fsid, [path])
            except Exception:  # noqa: BLE001 - a read ahead only saves a later read its round trips
                logger.debug("could not read %s ahead", path, exc_info=True)
            finally:
                with self._lock:
                    self.reading_ahead.pop(f"{fsid}|{path}", None)
                events[path].set()

        for path in paths:
            probe.start_first_block(target, path, 0, block_bytes).add_done_callback(
                lambda future, path=path: done(path, future))

    def _keep_ahead(self, key: str, rows: dict, nbytes: int) -> None:
        """Keep a block read ahead until it is read (the caller holds the lock); the oldest
        are dropped past `AHEAD_BYTES` (their reads then come from their workers)."""
        self.ahead[key] = (rows, nbytes)
        self._ahead_bytes += nbytes
        while self._ahead_bytes > AHEAD_BYTES and self.ahead:
            _, (_, dropped) = self.ahead.popitem(last=False)
            self._ahead_bytes -= dropped

    def _read_ahead_info(self, fsid: str, path: str) -> dict | None:
        """The info of `path` once its read ahead ends, if one is under way here (None when
        none is, or it failed)."""
        with self._lock:
            event = self.reading_ahead.get(f"{fsid}|{path}")
        if event is None:
            return None
        event.wait(float(dask.config.get("dmdask.client.recovery-seconds")))
        return self.session.metadata.infos.get(f"{fsid}|{path}")

    def _took(self, fs, path: str, index: int, got: tuple[dict, bytes], keep: bool = False) -> dict:
        """Know the info of `path` and keep block `index`'s bytes `got` (from the GET that
        gave the info) for the read that follows, to be handed over; the info. `keep`: a
        block read ahead, kept here until first read (`ahead`), however long its hand-over takes."""
        fsid, metadata = fs.target_id, self.session.metadata
        block_bytes = FileSource.block_bytes_of(fs.block_bytes)
        info, content = plain(got[0]), got[1]
        source = reader = None
        if info["size"] and index * block_bytes < info["size"]:
            source = fs.source(path, info)
            reader = source.reader(index)
            if len(content) != reader.last - reader.first:
                reader = None
        put = FileEntry(f"{fsid}|{folder_of(path)}", "info", path, info)
        with self._lock:
            metadata.know(fsid, path, info)
            if reader is not None:  # the read that follows takes it from here
                self.handing[reader.key] = reader.decode(content)
                if keep:
                    self._keep_ahead(reader.key, self.handing[reader.key], len(content))
            first = not self.to_open
            self.to_open.append((put, reader, reader and source.info, content))
        self._schedule_hand_over(first, WORKER_OPEN_DELAY if serving() else OPEN_DELAY, len(content))
        return info

    def first_reads(self, fs, wanted: dict[str, tuple]) -> dict[str, dict]:
        """The rows (key -> arrays) of the blocks of `wanted` (key -> (source, index)) this
        process is handing over or has claimed (one `OpenBlocks` request for those it has no
        holder for), read here and handed over. The rest are left to `Blocks`."""
        session, blocks = self.session, self.session.blocks
        with self._lock:
            have = {key: self.handing[key] for key in wanted if key in self.handing}
            for key in wanted:  # read ahead: kept until read, as their hand-over may be done by then
                if key in self.ahead:
                    have[key], nbytes = self.ahead.pop(key)
                    self._ahead_bytes -= nbytes
        new = [key for key in wanted if key not in have and key not in blocks.holders]
        for folder in {f"{fs.target_id}|{folder_of(wanted[key][0].path)}" for key in new} - blocks.located:
            blocks.located.add(folder)
            blocks.locate_folder(fs, folder)
        new = [key for key in new if key not in blocks.holders]
        if not new:
            return have
        sources = {wanted[key][0].info.name: wanted[key][0] for key in new}
        reply = session.call_with_workers(OpenBlocks([s.info for s in sources.values()], new, session.client.id,
                                                     session.my_host))
        blocks.registered.update(sources)
        blocks.holders.update(reply.holders)
        mine = [(key, worker, wanted[key][0].reader(wanted[key][1])) for key, worker in reply.mine.items()]
        if not mine:
            return have
        contents = read_blocks([reader for _, _, reader in mine])
        handed, failed = [], []
        for (key, worker, reader), content in zip(mine, contents):
            if isinstance(content, bytes) and len(content) == reader.last - reader.first:
                have[key] = reader.decode(content)
                handed.append((worker, reader, content))
            else:  # the planned worker reads it, and names the error if it fails there too
                failed.append(reader)
        if failed:
            del submit_blocks(session.client, failed)[:]
            blocks.submitted.update(r.key for r in failed)
        if handed:
            with self._lock:
                self.handing.update({r.key: have[r.key] for _, r, _ in handed})
                first = not self.to_hand
                self.to_hand.extend(handed)
            self._schedule_hand_over(first, WORKER_HANDOVER_DELAY if serving() else HANDOVER_DELAY,
                                     sum(len(c) for _, _, c in handed))
        return have

    def _schedule_hand_over(self, first: bool, delay: float, nbytes: int) -> None:
        """Hand over after `delay` from the first of a batch, at once past `HANDOVER_BYTES`."""
        with self._lock:
            self._queued_bytes += nbytes
            full = self._queued_bytes > HANDOVER_BYTES
        loop = self.session.client.loop
        if full:
            loop.add_callback(self.hand_over)
        elif first:  # the timer set on the loop's own thread (call_later is not thread-safe)
            loop.add_callback(loop.call_later, delay, self.hand_over)

    async def hand_over(self) -> None:
        """Give the planned workers the bytes of the blocks read here lately (one request per
        worker), then submit their loads (one graph); done once the blocks are held (or
        `HANDOVER_EXIT_SECONDS`)."""
        with self._lock:
            queued, self.to_hand = self.to_hand, []
            opening, self.to_open = self.to_open, []
            self._queued_bytes = 0
        if not queued and not opening:
            return
        try:
            if opening:
                queued = queued + await self._open_read(opening)
            await self._hand_queued(queued)
        finally:
            done = [reader for _, reader, _ in queued] + [reader for _, reader, _, _ in opening if reader is not None]
            with self._handed:
                for reader in done:
                    self.handing.pop(reader.key, None)
                self._handed.notify_all()

    def wait_read_ahead(self, timeout: float) -> None:
        """Wait until the reads ahead under way here have ended (so that an exiting process
        hands their blocks over, and releases the claims of those that failed)."""
        with self._lock:
            events = list(self.reading_ahead.values())
        deadline = time.monotonic() + timeout
        for event in events:
            event.wait(max(0.0, deadline - time.monotonic()))

    def wait_handed_over(self, timeout: float) -> None:
        """Wait until the blocks this process read from the store are with their workers."""
        with self._handed:
            self._handed.wait_for(lambda: not self.handing or self.session.connected is None, timeout)

    async def _open_read(self, opening: list[tuple]) -> list[tuple]:
        """One `FsOpenBlocks` request for blocks read with their files' infos (`first_info`):
        those it claims, as (worker, reader, bytes) to hand over."""
        session, blocks = self.session, self.session.blocks
        readers = [(reader, content) for _, reader, _, content in opening if reader is not None]
        datasets = {info.name: info for _, _, info, _ in opening if info is not None}
        request = OpenBlocks(list(datasets.values()), [reader.key for reader, _ in readers], session.client.id,
                             session.my_host)
        try:
            reply = await SchedulerAPI(session.client).send(
                FsOpenBlocks(session.metadata.run, [put for put, _, _, _ in opening], request))
        except Exception:  # noqa: BLE001 - the read has its bytes; a later one finds the scheduler gone
            logger.debug("could not open blocks read with their infos", exc_info=True)
            return []
        if isinstance(reply, NoWorkers):
            return []
        blocks.registered.update(datasets)
        blocks.holders.update(reply.holders)
        return [(reply.mine[reader.key], reader, content) for reader, content in readers if reader.key in reply.mine]

    async def _hand_queued(self, queued: list[tuple]) -> None:
        """Have the planned workers keep the blocks `queued` ((worker, reader, bytes)) without a
        load task each: one `dmdask_place_blocks` request per worker, then one `FsHeld` request
        naming what each placed. A block a worker did not place (a worker of an older dmdask,
        no room, an error) is handed over and loaded by a task as before."""
        client = self.session.client
        if not queued:
            return
        by_worker: dict[str, list] = {}
        for worker, reader, content in queued:
            reader.claim = self._claim  # its load (placed or a task) takes only the bytes handed over with it
            by_worker.setdefault(worker, []).append((reader, content))
        workers = WorkerAPI(client.rpc)
        replies = await asyncio.gather(*(workers.place_blocks(w, {r.key: c for r, c in blocks}, self._claim,
                                                              dumps([r for r, _ in blocks]))
                                         for w, blocks in by_worker.items()), return_exceptions=True)
        placed = {w: reply for w, reply in zip(by_worker, replies) if isinstance(reply, dict) and reply}
        for worker, reply in zip(by_worker, replies):
            if isinstance(reply, NotADmdaskWorker):  # a plain Dask worker: this process's next read raises it
                self.session.refused = reply
                logger.warning("dmdask:: %s", reply)
            elif isinstance(reply, BaseException):  # handed over and loaded by a task below
                logger.debug("could not place blocks on %s: %r", worker, reply)
        held = {}
        if placed:
            try:
                held = (await SchedulerAPI(client).send(FsHeld(placed))).holders
            except Exception:  # noqa: BLE001 - their loads are submitted below; the workers' copies are
                logger.debug("could not tell the scheduler of placed blocks", exc_info=True)  # then replicas
        self.session.blocks.holders.update(held)
        rest = [(w, r, c) for w, r, c in queued if r.key not in held]
        if rest:
            await self._hand_to_tasks(rest)

    async def _hand_to_tasks(self, queued: list[tuple]) -> None:
        """Hand the blocks `queued` over to their planned workers and submit their load tasks,
        which take those bytes; done once the scheduler has them (or `HANDOVER_EXIT_SECONDS`)."""
        client = self.session.client
        by_worker: dict[str, dict] = {}
        for worker, reader, content in queued:
            by_worker.setdefault(worker, {})[reader.key] = content
        workers = WorkerAPI(client.rpc)
        replies = await asyncio.gather(*(workers.hand_over(w, blocks, self._claim) for w, blocks in by_worker.items()),
                                       return_exceptions=True)
        for worker, reply in zip(by_worker, replies):
            if isinstance(reply, NotADmdaskWorker):  # a plain Dask worker: this process's next read raises it
                self.session.refused = reply
                logger.warning("dmdask:: %s", reply)
            elif isinstance(reply, BaseException):  # that worker reads those blocks itself
                logger.debug("could not hand blocks over to %s: %r", worker, reply)
        del submit_blocks(client, [reader for _, reader, _ in queued])[:]
        # until the scheduler has them: an exit before the graph left would drop the claims
        # with the loads unsent, and the next reader would read these blocks again
        keys = [reader.key for _, reader, _ in queued]
        async for _ in Tries(HANDOVER_EXIT_SECONDS):
            found = await SchedulerAPI(client).locate(keys, self.session.my_host, expect=keys)
            self.session.blocks.holders.update(found.holders)
            keys = [k for k in keys if k not in found.holders and k not in found.erred]
            if not keys:
                break
