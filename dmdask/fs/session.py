"""Transparent mode's state in one process: its own connection to the cluster, what it
knows of files (infos, listings) and blocks (holders), and reads of byte ranges.

Guarantees:
- fork- and spawn-safe: a process never uses a connection made by another one. A
  forked child (a `DataLoader` worker) keeps what its parent knew and makes its own
  `distributed.Client` when it first reads; a spawned one with no default client of
  its own finds the scheduler through the environment (`DMDASK_FS_SCHEDULER`, set when
  the parent looked up its default client's scheduler).
- metadata is asked of the store once per run (`DMDASK_FS_RUN`, inherited by child
  processes; see `dmdask.scheduler.files`); within a process, once.
- a read returns the bytes of the file's dataset as identified when the file was
  opened (size and version), taken from same-host shared memory or SSD files, or from
  their holder over Dask's comms. A block is read from the store once while the
  cluster holds it: by the first process that wants it, which claims it from the
  scheduler (`open_blocks`; for a file new to the run, its info with `dmdask_fs_claim`,
  the block then claimed in the background before the run learns the info), reads it
  with one ranged request (several blocks concurrently on an async store) and returns
  at once, then hands the bytes to the block's planned worker in the background;
  processes that want it meanwhile wait for that worker. Should the hand-over fail,
  the worker reads the block itself.
"""
from __future__ import annotations

import asyncio
import atexit
import logging
import multiprocessing.util
import os
import secrets
import threading
import time
from typing import Dict, List, Optional

import dask.config
import distributed
import fsspec
import fsspec.asyn
import numpy as np
from distributed.comm.core import CommClosedError
from distributed.core import clean_exception

from distributed.protocol.serialize import to_serialize

from ..client.datasets import ensure_plugin, get_or_register, submit_blocks
from ..client.gather import Gatherer, LocalArenas, Moved, plan_rows
from ..client.iterator import _my_host
from ..errors import (BlockReadError, DmdaskError, NoWorkersError, SchedulerLostError, no_workers,
                      waiting_for_workers)
from ..source.files import ROW_BYTES, FileSource, read_blocks
from . import probe
from .run import RUN_ENV, new_run  # noqa: F401  (RUN_ENV: re-exported)
from .run import start as start_run

logger = logging.getLogger(__name__)

SCHEDULER_ENV = "DMDASK_FS_SCHEDULER"  # set for child processes: the scheduler their parent read through
LOCATE_SECONDS = 2.0  # one wait on the scheduler for blocks still loading
HITS_SECONDS = 1.0  # how often workers hear of the rows taken from their files
EXIT_SECONDS = 2.0  # the most a process's exit waits to report its last hits
HANDOVER_EXIT_SECONDS = 10.0  # the most a process's exit waits for its hand-overs to reach the workers
# Blocks read from the store within HANDOVER_DELAY are handed over together (one graph of
# loads, one locate), and those read with their infos within OPEN_DELAY are opened
# together (one request), up to HANDOVER_BYTES queued: on 2 cores, batches of 5 ms / 50 ms
# made a DataLoader's first epoch 1.4-1.8x the direct read, of 0.05 s / 0.3 s 1.1-1.2x,
# of 0.2 s / 1 s 1.0-1.1x (the scheduler's and workers' work per batch shares the CPUs
# with the readers). Longer delays keep more blocks in the process (`handing`) longer.
HANDOVER_DELAY = 0.25
OPEN_DELAY = 0.05
HANDOVER_BYTES = 64 << 20
ELSEWHERE = object()  # `_claim_info`: another run read the info
CLAIM_POLL_SECONDS = 0.02  # how often a process waiting for a file's info another one reads asks again
FOLDER_FILES = 10_000  # other files of a folder located along with the first one a process reads
# what identifies a version of a file, among the keys of fsspec infos (local, S3, GCS, HTTP, ...)
VERSION_KEYS = ("mtime", "LastModified", "last_modified", "Last-Modified", "ETag", "etag", "updated",
                "generation", "VersionId", "version_id")


class NoClusterError(DmdaskError, RuntimeError):
    """Transparent mode found no cluster to read through."""


def version_of(info: dict) -> list:
    """The fields of an info that change when the file is rewritten."""
    return [[k, str(info[k])] for k in VERSION_KEYS if info.get(k) is not None]


def plain(info: dict) -> dict:
    """An info with only values that travel as they are (others as strings)."""
    return {k: v if v is None or isinstance(v, (str, int, float, bool)) else str(v) for k, v in info.items()}


def recovery_seconds() -> float:
    """The most any wait of transparent mode lasts (`dmdask.client.recovery-seconds`)."""
    return float(dask.config.get("dmdask.client.recovery-seconds"))


def folder_of(path: str) -> str:
    return path.rstrip("/").rsplit("/", 1)[0]


class Session:
    """One process's connection to one cluster (see the module docstring). Thread-safe."""

    def __init__(self, address: str, parent: Optional["Session"] = None):
        self.address = address
        self._lock = threading.Lock()
        self._claim = secrets.token_hex(16)  # what this process hands blocks over with (`Handovers`)
        self._client: Optional[distributed.Client] = None
        self.my_host: Optional[str] = None
        self.gatherer: Optional[Gatherer] = None
        self.run = start_run()
        known = parent if parent is not None and parent.run == self.run else None
        self.infos: Dict[str, dict] = dict(known.infos) if known else {}  # fsid|path -> info
        self.listings: Dict[str, list] = dict(known.listings) if known else {}  # fsid|folder -> entries
        self.asked: set = set(known.asked) if known else set()  # folders asked of the cluster
        self.asked_infos: set = set(known.asked_infos) if known else set()  # ... for their files' infos
        self.files: Dict[str, set] = {k: set(v) for k, v in known.files.items()} if known else {}  # folder -> paths
        self.located: set = set()  # folders whose files' first blocks this process located
        self.handing: Dict[str, dict] = {}  # block key -> its rows, read here, being handed to its worker
        self._handed = threading.Condition(self._lock)  # notified as hand-overs finish
        self._to_hand: List[tuple] = []  # (worker, reader, bytes) queued for the next hand-over
        self._queued_bytes = 0  # bytes in _to_hand and _to_open
        self._to_open: List[tuple] = []  # (info put, [name, dataset info] or None, reader or None, bytes): `first_info`
        self._to_tell: List[list] = []  # metadata queued for the scheduler
        self.submitted: set = set()  # block keys whose loads this process submitted
        self.registered: set = set()  # datasets this process found or put in the registry
        self.holders: Dict[str, str] = dict(parent.holders) if parent else {}  # block key -> a holder
        self.retried: set = set()  # datasets whose erred blocks this process had retried
        self._exit_hook = False
        self._said_waiting = False

    # -- the connection -----------------------------------------------------------------
    @property
    def client(self) -> distributed.Client:
        if self._client is None:
            with self._lock:
                if self._client is None:
                    connect = dask.config.get("distributed.comm.timeouts.connect")
                    try:
                        client = distributed.Client(self.address, set_as_default=False, timeout=connect)
                    except OSError as exc:
                        raise SchedulerLostError(
                            f"dmdask:: cannot reach the scheduler at {self.address} (waited {connect}, "
                            "distributed.comm.timeouts.connect): is the cluster running? Name it with the storage "
                            "option scheduler=ADDRESS or the dask config dmdask.fs.scheduler") from exc
                    ensure_plugin(client)
                    self.my_host = _my_host(client)
                    self.gatherer = Gatherer(client, self.my_host, LocalArenas(0, 1))
                    self._client = client
                    if not self._exit_hook:
                        self._exit_hook = True
                        # forked and spawned processes of multiprocessing run finalizers, not atexit
                        multiprocessing.util.Finalize(self, self.at_exit, exitpriority=100)
                        atexit.register(self.at_exit)
        return self._client

    def at_exit(self) -> None:
        """Hand over the blocks read here, share the infos read here with the run (so the
        run's next processes ask the store for none of them) and report the last hits;
        each bounded in time."""
        if self._client is not None and (self._to_hand or self._to_open):
            self._client.loop.add_callback(self._hand_over)
        self.wait_handed_over(HANDOVER_EXIT_SECONDS)
        if self._client is not None and self._to_tell and self._client.status == "running":
            try:
                self._client.sync(self._tell_queued, callback_timeout=EXIT_SECONDS)
            except Exception:  # noqa: BLE001 - shared metadata is an optimisation
                pass
        self.flush_hits()

    def wait_handed_over(self, timeout: float) -> bool:
        """Wait until the blocks this process read from the store are with their workers."""
        deadline = time.monotonic() + timeout
        with self._handed:
            while self.handing:
                left = deadline - time.monotonic()
                if left <= 0 or self._client is None:
                    return False
                self._handed.wait(left)
        return True

    def close(self) -> None:
        """Hand over, report the last hits and close the connection."""
        self.at_exit()
        with self._lock:
            client, self._client = self._client, None
        if client is not None:
            client.close(timeout=EXIT_SECONDS)

    def _call(self, op: str, **msg):
        """Scheduler handler `op`'s reply, waiting at most `dmdask.client.recovery-seconds`;
        `SchedulerLostError` when the scheduler does not answer by then or is gone."""
        client = self.client
        limit = recovery_seconds()

        async def call():
            if client.scheduler is None or client.status != "running":
                raise CommClosedError(f"client status {client.status!r}")
            return await getattr(client.scheduler, op)(**msg)

        try:
            return client.sync(call, callback_timeout=limit)
        except DmdaskError:
            raise
        except (OSError, AttributeError) as exc:  # comms closed, a timeout; AttributeError: scheduler gone meanwhile
            raise SchedulerLostError(
                f"dmdask:: lost the scheduler at {self.address}: {op} got no answer within {limit:.0f} s "
                f"(dmdask.client.recovery-seconds; {type(exc).__name__}: {exc}). Is the scheduler still "
                "running? dmdask.fs.close() drops this process's connection; the next read makes a new one") from exc

    def flush_hits(self) -> None:
        """Report the rows this process took from workers' files (best effort, bounded)."""
        client, gatherer = self._client, self.gatherer
        if client is None or gatherer is None or not gatherer.has_hits() or client.status != "running":
            return
        try:
            client.sync(gatherer.flush_hits, callback_timeout=EXIT_SECONDS)
        except Exception:  # noqa: BLE001 - counters only
            pass

    # -- metadata -----------------------------------------------------------------------
    def _ask(self, fsid: str, folder: str) -> None:
        """Everything this run knows of `folder` now (one request)."""
        key = f"{fsid}|{folder}"
        reply = self._call("dmdask_fs_metadata", run=self.run, get=[key])
        with self._lock:
            found = reply.get(key, {"listing": None, "infos": {}})
            if found["listing"] is not None:
                self.listings[key] = found["listing"]
            for path, info in found["infos"].items():
                self._know(fsid, path, info)
            self.asked.add(key)
            self.asked_infos.add(key)

    def _know(self, fsid: str, path: str, info: dict) -> None:
        self.infos[f"{fsid}|{path}"] = info
        self.files.setdefault(f"{fsid}|{folder_of(path)}", set()).add(path)

    def _tell(self, fsid: str, puts: List[list]) -> None:
        """Share infos read from the store with the run, in the background and a batch at
        a time (a process that exits first only costs the next one a store request)."""
        client = self.client
        with self._lock:
            first = not self._to_tell
            self._to_tell.extend([f"{fsid}|{f}", kind, p, v] for f, kind, p, v in puts)
        if first:
            client.loop.call_later(HANDOVER_DELAY, self._tell_queued)

    async def _tell_queued(self) -> None:
        with self._lock:
            msg, self._to_tell = self._to_tell, []
        if msg:
            await _quietly(self.client.scheduler.dmdask_fs_metadata, run=self.run, put=msg)

    def known_info(self, fsid: str, path: str) -> Optional[dict]:
        """The info of `path` this run read, or None (no store request)."""
        key = f"{fsid}|{path}"
        found = self.infos.get(key)
        if found is None and f"{fsid}|{folder_of(path)}" not in self.asked_infos:
            # once per process and folder (not when the folder was asked for its listing
            # only: the run may have read its files' infos since)
            self._ask(fsid, folder_of(path))
            found = self.infos.get(key)
        return found

    def first_info(self, fs, path: str, start: Optional[int] = 0) -> dict:
        """The info of file `path` of `fs` (a `DmdaskFileSystem`) for reading it from byte
        `start` on (None: from its end): where the store's infos each cost a request
        (HTTP), a file new to the run is claimed (one scheduler request, `dmdask_fs_claim`:
        no other process of the run reads it meanwhile) and asked with the ranged GET of
        the block holding `start` (`dmdask.fs.probe`), whose bytes the read that follows
        takes (`handing`). The info's sharing with the run, the block's registration and
        claim (one `dmdask_fs_open_blocks` request) and its hand-over to its worker run in
        the background: a first read is one scheduler and one store round trip."""
        fsid = fs._fsid
        found = self.known_info(fsid, path)
        if found is not None:
            return found
        target = fsspec.filesystem(fs.target_protocol, **fs.target_options)  # this process's own
        if start is None or start < 0 or not probe.applies(target):
            return self.info(fsid, fs.fs, path)
        found = self._claim_info(fsid, path)
        if found is ELSEWHERE:  # a HEAD, not a GET: the bytes may be cached already
            return self.info(fsid, fs.fs, path)
        if found is not None:
            return found
        block_bytes = FileSource.block_bytes_of(fs.block_bytes)
        index = start // block_bytes
        got = probe.first_block(target, path, index * block_bytes, block_bytes)
        if got is None:
            return self.info(fsid, fs.fs, path)
        info, content = plain(got[0]), got[1]
        source = reader = None
        if info["size"] and index * block_bytes < info["size"]:
            source = fs.source(path, info)
            reader = source.reader(index)
            if len(content) != reader.last - reader.first:
                reader = None
        put = [f"{fsid}|{folder_of(path)}", "info", path, info]
        with self._lock:
            self._know(fsid, path, info)
            if reader is not None:  # the read that follows takes it from here
                self.handing[reader.key] = reader.decode(content)
            first = not self._to_open
            self._to_open.append((put, [source.info.name, source.info.as_dict()] if reader else None, reader,
                                  content))
        self._schedule_hand_over(first, OPEN_DELAY, len(content))
        return info

    def _claim_info(self, fsid: str, path: str):
        """The run's info of `path` once known, waiting while another process of the run
        reads it from the store; None: this process is to read it (claimed); ELSEWHERE:
        another run read it (its blocks may be cached: check its version with `info`).
        While the cluster has no workers, waits for one (`_call_with_workers`)."""
        folder = f"{fsid}|{folder_of(path)}"
        deadline = time.monotonic() + recovery_seconds()
        while True:
            reply = self._call_with_workers("dmdask_fs_claim", run=self.run, claim=[[folder, path]])
            found = reply.get(folder, {"infos": {}})["infos"].get(path)
            if found is not None:
                with self._lock:
                    self._know(fsid, path, found)
                return found
            if reply.get("elsewhere"):
                return ELSEWHERE
            if not reply.get("probing") or time.monotonic() > deadline:
                return None
            time.sleep(CLAIM_POLL_SECONDS)

    def info(self, fsid: str, target, path: str) -> dict:
        """The target's info of `path`, read from the store once per run."""
        found = self.known_info(fsid, path)
        if found is None:
            found = plain(target.info(path))
            self._tell(fsid, [[folder_of(path), "info", path, found]])
            with self._lock:
                self._know(fsid, path, found)
        return found

    def learn_infos(self, fs, paths: List[str]) -> None:
        """Read the infos of `paths` this run does not know yet, concurrently on an async
        store (one HEAD each, at once), ahead of reading many files (`fs`: a
        `DmdaskFileSystem`). A path whose info cannot be read is left to `info`."""
        fsid = fs._fsid
        for folder in {folder_of(p) for p in paths}:
            if f"{fsid}|{folder}" not in self.asked_infos:
                self._ask(fsid, folder)
        unknown = list(dict.fromkeys(p for p in paths if f"{fsid}|{p}" not in self.infos))
        if len(unknown) < 2:
            return
        target = fsspec.filesystem(fs.target_protocol, **fs.target_options)  # this process's own
        if not target.async_impl:
            return

        async def all_infos():
            return await asyncio.gather(*(target._info(p) for p in unknown), return_exceptions=True)

        found = fsspec.asyn.sync(target.loop, all_infos)
        puts = [[folder_of(p), "info", p, plain(info)] for p, info in zip(unknown, found) if isinstance(info, dict)]
        with self._lock:
            for _, _, path, info in puts:
                self._know(fsid, path, info)
        if puts:
            self._tell(fsid, puts)

    def ls(self, fsid: str, target, path: str) -> list:
        """The target's detailed listing of folder `path`, read from the store once per run.
        Entries that carry a size and a version stand as those files' infos too."""
        path = path.rstrip("/") or path
        key = f"{fsid}|{path}"
        if key not in self.listings and key not in self.asked:
            self._ask(fsid, path)
            self.asked_infos.discard(key)  # infos of files read later may come: ask again for them
        found = self.listings.get(key)
        if found is None:
            found = [plain(e) for e in target.ls(path, detail=True)]
            files = [e for e in found if e.get("type") == "file" and e.get("size") is not None and version_of(e)]
            self._tell(fsid, [[path, "listing", path, found]] + [[folder_of(e["name"]), "info", e["name"], e]
                                                                  for e in files])
            with self._lock:
                self.listings[key] = found
                for e in files:
                    self._know(fsid, e["name"], e)
        return found

    def forget(self) -> None:
        """Drop what this process knows of files; the next looks ask the store (a new run)."""
        self.run = new_run()
        with self._lock:
            self.infos.clear()
            self.listings.clear()
            self.asked.clear()
            self.asked_infos.clear()
            self.files.clear()
            self.located.clear()

    # -- reading ------------------------------------------------------------------------
    def read(self, fs, source: FileSource, start: int, stop: int) -> bytes:
        """Bytes start..stop-1 of the file of `source` (0 <= start <= stop <= size), read
        through `fs` (a `DmdaskFileSystem`)."""
        return self.read_ranges(fs, [(source, start, stop)])[0]

    def read_ranges(self, fs, ranges: List[tuple]) -> List[bytes]:
        """The bytes of each (source, start, stop), with one scheduler request for the
        blocks new to this process and concurrent store reads for those it claims."""
        deadline = time.monotonic() + recovery_seconds()
        cuts, wanted = [], {}
        for source, start, stop in ranges:
            if stop <= start:
                cuts.append(None)
                continue
            rows = np.arange(start // ROW_BYTES, -(-stop // ROW_BYTES), dtype=np.int64)
            blocks = rows // source.info.block_len
            keys = {k: source.info.block_key(k) for k in np.unique(blocks).tolist()}
            wanted.update({key: (source, k) for k, key in keys.items()})
            cuts.append((source, start, stop, rows, blocks, rows - blocks * source.info.block_len, keys))
        have = self._first_reads(fs, wanted)
        # the rows of every range from blocks held by workers: one gather (keys numbered across files)
        number = {key: i for i, key in enumerate(k for k in wanted if k not in have)}
        held_blocks, held_offsets = [], []
        for cut in cuts:
            if cut is not None:
                blocks, offsets, keys = cut[4:]
                for b, offset in zip(blocks.tolist(), offsets.tolist()):
                    if keys[b] in number:
                        held_blocks.append(number[keys[b]])
                        held_offsets.append(offset)
        gathered = iter(self._gather(wanted, np.array(held_blocks, dtype=np.int64),
                                     np.array(held_offsets, dtype=np.int64), {i: k for k, i in number.items()},
                                     deadline) if held_blocks else ())
        out = []
        for cut in cuts:
            if cut is None:
                out.append(b"")
                continue
            source, start, stop, rows, blocks, offsets, keys = cut
            data = np.empty(len(rows), dtype=object)
            for i, (b, offset) in enumerate(zip(blocks.tolist(), offsets.tolist())):
                found = have.get(keys[b])
                data[i] = found["data"][offset] if found is not None else next(gathered)
            joined = data[0] if len(data) == 1 else np.concatenate(list(data))
            first = start - int(rows[0]) * ROW_BYTES
            out.append(joined[first:first + stop - start].tobytes())
        if self.gatherer.due(HITS_SECONDS):
            self.client.loop.add_callback(self.gatherer.flush_hits_every, HITS_SECONDS)
        return out

    def _first_reads(self, fs, wanted: Dict[str, tuple]) -> Dict[str, dict]:
        """Blocks of `wanted` (key -> (source, index)) this process has no holder for:
        one `open_blocks` request registers their files, claims the blocks nobody holds
        or reads, and names the holders of the others. The claimed ones are read from the
        store here (and handed over); their rows are returned (key -> arrays), with those
        of blocks this process read lately and is handing over (`first_info` among them).
        The rest are left to `_gather` (held, loading, or read by another process)."""
        client = self.client
        with self._lock:
            have = {key: self.handing[key] for key in wanted if key in self.handing}
        new = [key for key in wanted if key not in have and key not in self.holders]
        for folder in {f"{fs._fsid}|{folder_of(wanted[key][0].path)}" for key in new} - self.located:
            self.located.add(folder)
            self._locate_folder(fs, folder)
        new = [key for key in new if key not in self.holders]
        if not new:
            return have
        sources = {wanted[key][0].info.name: wanted[key][0] for key in new}
        reply = self._open_blocks([[n, s.info.as_dict()] for n, s in sources.items()], new)
        self.registered.update(sources)
        self.holders.update(reply["holders"])
        mine = [(key, worker, wanted[key][0].reader(wanted[key][1])) for key, worker in reply["mine"].items()]
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
            del submit_blocks(client, failed)[:]
            self.submitted.update(r.key for r in failed)
        if handed:
            with self._lock:
                self.handing.update({r.key: have[r.key] for _, r, _ in handed})
                first = not self._to_hand
                self._to_hand.extend(handed)
            self._schedule_hand_over(first, HANDOVER_DELAY, sum(len(c) for _, _, c in handed))
        return have

    def _open_blocks(self, datasets: List[list], keys: List[str]) -> dict:
        """`dmdask_open_blocks`' reply (see `_call_with_workers`)."""
        return self._call_with_workers("dmdask_open_blocks", datasets=datasets, keys=keys, client=self.client.id,
                                       host=self.my_host)

    def _call_with_workers(self, op: str, **msg) -> dict:
        """Scheduler handler `op`'s reply; while it answers that the cluster has no workers,
        waits for one to join (said once in a warning per process), as `dmdask.batches`
        does; `NoWorkersError` after `dmdask.client.recovery-seconds` without any."""
        limit = recovery_seconds()
        deadline = time.monotonic() + limit
        while True:
            reply = self._call(op, **msg)
            if reply["status"] != "no-workers":
                return reply
            if time.monotonic() > deadline:
                raise no_workers(limit, f"the cluster at {self.address}")
            if not self._said_waiting:
                self._said_waiting = True
                logger.warning("dmdask:: %s", waiting_for_workers(limit, f"the cluster at {self.address}"))
            time.sleep(0.5)

    def _schedule_hand_over(self, first: bool, delay: float, nbytes: int) -> None:
        """Hand over what is queued after `delay` (`first`: the first of a batch), or at
        once when more than `HANDOVER_BYTES` are queued."""
        with self._lock:
            self._queued_bytes += nbytes
            full = self._queued_bytes > HANDOVER_BYTES
        if full:
            self.client.loop.add_callback(self._hand_over)
        elif first:
            self.client.loop.call_later(delay, self._hand_over)

    async def _hand_over(self) -> None:
        """Give the planned workers the bytes of the blocks read here lately (one request
        per worker), then submit those blocks' loads (one graph), which take the bytes in
        place of a store read; done once the blocks are held (or `HANDOVER_EXIT_SECONDS`)."""
        client = self.client
        with self._lock:
            queued, self._to_hand = self._to_hand, []
            opening, self._to_open = self._to_open, []
            self._queued_bytes = 0
        if not queued and not opening:
            return
        try:
            if opening:
                queued = queued + await self._open_read(opening)
            await self._hand_queued(queued)
        finally:
            with self._handed:
                for _, reader, _ in queued:
                    self.handing.pop(reader.key, None)
                for _, _, reader, _ in opening:
                    if reader is not None:
                        self.handing.pop(reader.key, None)
                self._handed.notify_all()

    async def _open_read(self, opening: List[tuple]) -> List[tuple]:
        """For blocks read with their files' infos (`first_info`): one `dmdask_fs_open_blocks`
        request shares the infos with the run, registers the files and claims the
        blocks nobody holds or reads; returns those as (worker, reader, bytes) to hand
        over. The others (held or read meanwhile by another run, or no worker now) are
        not handed over: their holders serve them, or their workers read them when
        wanted."""
        client = self.client
        datasets = {d[0]: d for _, d, _, _ in opening if d is not None}
        readers = [(reader, content) for _, _, reader, content in opening if reader is not None]
        try:
            reply = await client.scheduler.dmdask_fs_open_blocks(
                run=self.run, put=[put for put, _, _, _ in opening], datasets=list(datasets.values()),
                keys=[reader.key for reader, _ in readers], client=client.id, host=self.my_host)
        except Exception:  # noqa: BLE001 - the read has its bytes; a later one finds the scheduler gone
            logger.debug("could not open blocks read with their infos", exc_info=True)
            return []
        if reply["status"] != "OK":
            return []
        self.registered.update(datasets)
        self.holders.update(reply["holders"])
        return [(reply["mine"][reader.key], reader, content) for reader, content in readers
                if reader.key in reply["mine"]]

    async def _hand_queued(self, queued: List[tuple]) -> None:
        client = self.client
        if not queued:
            return
        by_worker: Dict[str, dict] = {}
        for worker, reader, content in queued:
            by_worker.setdefault(worker, {})[reader.key] = content
            reader.claim = self._claim  # its load task takes only the bytes handed over with it
        replies = await asyncio.gather(*(client.rpc(w).dmdask_hand_over(blocks=to_serialize(blocks),
                                                                        claim=self._claim)
                                         for w, blocks in by_worker.items()), return_exceptions=True)
        for worker, reply in zip(by_worker, replies):
            if isinstance(reply, BaseException):  # that worker reads those blocks itself
                logger.debug("could not hand blocks over to %s: %r", worker, reply)
        del submit_blocks(client, [reader for _, reader, _ in queued])[:]
        # until the scheduler has them: an exit before the graph left would drop the claims
        # with the loads unsent, and the next reader would read these blocks again
        keys = [reader.key for _, reader, _ in queued]
        deadline = time.monotonic() + HANDOVER_EXIT_SECONDS
        while keys and time.monotonic() < deadline:
            reply = await client.scheduler.dmdask_locate(keys=keys, host=self.my_host, timeout=LOCATE_SECONDS,
                                                         expect=keys)
            self.holders.update(reply["holders"])
            keys = [k for k in keys if k not in reply["holders"] and k not in reply["erred"]]

    def _gather(self, wanted: Dict[str, tuple], blocks: np.ndarray, offsets: np.ndarray, keys: Dict[int, str],
                deadline: float) -> np.ndarray:
        """Rows (block number, offset; `keys`: number -> block key; `wanted`: key ->
        (source, index)) from the blocks' holders, as an object array."""
        attempt = 0
        while True:
            attempt += 1
            holders = self._holders(wanted, list(keys.values()), deadline)
            plan, positions = plan_rows(blocks, offsets, keys, holders)
            try:
                arrays = self.gatherer.take_local(plan, positions, len(blocks))
                if arrays is None:  # a block held elsewhere, or not described yet
                    arrays, _ = self.client.sync(self.gatherer.gather, plan, positions, len(blocks),
                                                 callback_timeout=max(1.0, deadline - time.monotonic()))
                return arrays["data"]
            except BlockReadError:
                raise
            except (Moved, OSError, CommClosedError) as exc:  # released, moved, or a worker left: locate again
                for key in keys.values():
                    self.holders.pop(key, None)
                if time.monotonic() > deadline:
                    urls = sorted({wanted[k][0].info.url for k in keys.values()})
                    raise RuntimeError(f"{', '.join(urls[:3])} still failing after "
                                       "dmdask.client.recovery-seconds") from exc
                time.sleep(min(1.0, 0.05 * attempt))

    def _holders(self, wanted: Dict[str, tuple], keys: List[str], deadline: float) -> Dict[str, str]:
        """A holder of each block (`wanted`: key -> (source, index)), waiting for blocks
        being loaded or read by another process, and submitting the loads of blocks the
        cluster does not have (after the scheduler forgot them, or their reader left)."""
        while True:
            unknown = [k for k in keys if k not in self.holders]
            if not unknown:
                return {k: self.holders[k] for k in keys}
            sources = {wanted[k][0].info.name: wanted[k][0] for k in unknown}
            checked = set(sources) - self.registered
            for name in checked:
                self.registered.add(name)
                get_or_register(self.client, sources[name])
            expect = [k for k in unknown if k in self.submitted]
            reply = self._call("dmdask_locate", keys=unknown, host=self.my_host, timeout=LOCATE_SECONDS,
                               expect=expect)
            self.submitted.difference_update(expect)  # waited for once: from now on, as any other key
            self.holders.update(reply["holders"])
            for key, exc in reply["erred"].items():
                source = wanted[key][0]
                if source.info.name in self.retried:
                    raise clean_exception(exc)[1]
                self.retried.add(source.info.name)
                get_or_register(self.client, source)  # retries its erred blocks
            if reply["unknown"]:
                for name in {wanted[k][0].info.name for k in reply["unknown"]} - checked:
                    get_or_register(self.client, sources[name])  # registered again, should it have been released
                del submit_blocks(self.client, [wanted[k][0].reader(wanted[k][1]) for k in reply["unknown"]])[:]
                self.submitted.update(reply["unknown"])  # the next locate waits for them
            if time.monotonic() > deadline:
                url = wanted[unknown[0]][0].info.url
                if not self.client.scheduler_info().get("workers"):
                    raise NoWorkersError(f"the cluster has no workers to read {url} through")
                raise RuntimeError(f"blocks of {url} still not loaded after "
                                   "dmdask.client.recovery-seconds; is the cluster losing workers?")

    def _locate_folder(self, fs, folder: str) -> None:
        """Holders of the first block of up to `FOLDER_FILES` files of the folder this
        process knows (not waiting for any), and the layout of those held in files on this
        host: later reads of the folder's files need no request."""
        wanted = []
        for path in sorted(self.files.get(folder, ()))[:FOLDER_FILES]:
            info = self.infos.get(f"{fs._fsid}|{path}")
            if info and info.get("type", "file") == "file" and info.get("size"):
                wanted.append(fs.source(path, info).info.block_key(0))
        if not wanted:
            return
        reply = self._call("dmdask_locate", keys=wanted, host=self.my_host, timeout=0)
        self.holders.update(reply["holders"])
        by_holder: Dict[str, List[str]] = {}
        for key, holder in reply["holders"].items():
            by_holder.setdefault(holder, []).append(key)
        client = self.client
        client.sync(self.gatherer.describe, by_holder, callback_timeout=recovery_seconds())


async def _quietly(call, **msg) -> None:
    try:
        await call(**msg)
    except Exception:  # noqa: BLE001 - shared metadata is an optimisation
        logger.debug("could not share file metadata with the scheduler", exc_info=True)


_sessions: Dict[str, Session] = {}
_pid = os.getpid()
_lock = threading.Lock()


def _after_fork() -> None:
    """In a forked child: new locks, and sessions that keep what the parent knew but
    make their own connections."""
    global _lock, _pid
    _lock = threading.Lock()
    _pid = os.getpid()
    for address, parent in list(_sessions.items()):
        _sessions[address] = Session(address, parent)


os.register_at_fork(after_in_child=_after_fork)


def get_session(address: Optional[str] = None) -> Session:
    """This process's session with the cluster at `address` (None: `dmdask.fs.scheduler`
    from dask config, else the scheduler of the default Dask client)."""
    if os.getpid() != _pid:  # a fork that did not run the hook (os.fork from C code)
        _after_fork()
    address = address or default_address()
    with _lock:
        found = _sessions.get(address)
        if found is None:
            found = _sessions[address] = Session(address)
        return found


def close_sessions() -> None:
    """Close this process's connections (the next read makes new ones): for a process
    whose cluster went away, so that its client stops trying to reconnect in the
    background (a process that forks meanwhile may inherit a held lock)."""
    with _lock:
        sessions = list(_sessions.values())
        _sessions.clear()
    for found in sessions:
        found.close()


def default_address() -> str:
    """`dmdask.fs.scheduler` from dask config, else the default client's scheduler (then
    also put into the environment, so spawned processes find it), else the scheduler the
    parent process read through."""
    configured = dask.config.get("dmdask.fs.scheduler", None)
    if configured:
        return str(configured)
    try:
        address = distributed.default_client().scheduler.address
    except ValueError:
        address = os.environ.get(SCHEDULER_ENV)
        if not address:
            raise NoClusterError(
                "dmdask:: reads through a dmdask cluster: make a distributed.Client first, set the dask config "
                "dmdask.fs.scheduler (or DASK_DMDASK__FS__SCHEDULER), or pass storage option scheduler=ADDRESS"
            ) from None
        return address
    os.environ[SCHEDULER_ENV] = address
    return address
