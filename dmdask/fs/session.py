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
  their holder over Dask's comms; a block is read from the store once, by the worker
  planned for it, when some process first wants it.
"""
from __future__ import annotations

import atexit
import logging
import multiprocessing.util
import os
import threading
import time
import uuid
from typing import Dict, List, Optional

import dask.config
import distributed
import numpy as np
from distributed.comm.core import CommClosedError
from distributed.core import clean_exception

from ..client.datasets import ensure_plugin, get_or_register, submit_blocks
from ..client.gather import Gatherer, LocalArenas, Moved, plan_rows
from ..client.iterator import _my_host
from ..errors import BlockReadError, DmdaskError, NoWorkersError
from ..source.base import parse_block_key
from ..source.files import ROW_BYTES, FileSource

logger = logging.getLogger(__name__)

RUN_ENV = "DMDASK_FS_RUN"
SCHEDULER_ENV = "DMDASK_FS_SCHEDULER"  # set for child processes: the scheduler their parent read through
LOCATE_SECONDS = 2.0  # one wait on the scheduler for blocks still loading
HITS_SECONDS = 1.0  # how often workers hear of the rows taken from their files
EXIT_SECONDS = 2.0  # the most a process's exit waits to report its last hits
FOLDER_FILES = 10_000  # other files of a folder located along with the first one a process reads
# what identifies a version of a file, among the keys of fsspec infos (local, S3, GCS, HTTP, ...)
VERSION_KEYS = ("mtime", "LastModified", "last_modified", "Last-Modified", "ETag", "etag", "updated",
                "generation", "VersionId", "version_id")


class NoClusterError(DmdaskError, RuntimeError):
    """Transparent mode found no cluster to read through."""


def run_token() -> str:
    """This run's token: this process's, or the one it inherited from its parent."""
    return os.environ.setdefault(RUN_ENV, uuid.uuid4().hex)


def new_run() -> str:
    """Start a new run in this process (and the processes it starts from now on)."""
    os.environ[RUN_ENV] = uuid.uuid4().hex
    return os.environ[RUN_ENV]


def version_of(info: dict) -> list:
    """The fields of an info that change when the file is rewritten."""
    return [[k, str(info[k])] for k in VERSION_KEYS if info.get(k) is not None]


def plain(info: dict) -> dict:
    """An info with only values that travel as they are (others as strings)."""
    return {k: v if v is None or isinstance(v, (str, int, float, bool)) else str(v) for k, v in info.items()}


def folder_of(path: str) -> str:
    return path.rstrip("/").rsplit("/", 1)[0]


class Session:
    """One process's connection to one cluster (see the module docstring). Thread-safe."""

    def __init__(self, address: str, parent: Optional["Session"] = None):
        self.address = address
        self._lock = threading.Lock()
        self._client: Optional[distributed.Client] = None
        self.my_host: Optional[str] = None
        self.gatherer: Optional[Gatherer] = None
        self.run = run_token()
        known = parent if parent is not None and parent.run == self.run else None
        self.infos: Dict[str, dict] = dict(known.infos) if known else {}  # fsid|path -> info
        self.listings: Dict[str, list] = dict(known.listings) if known else {}  # fsid|folder -> entries
        self.asked: set = set(known.asked) if known else set()  # folders asked of the cluster
        self.asked_infos: set = set(known.asked_infos) if known else set()  # ... for their files' infos
        self.files: Dict[str, set] = {k: set(v) for k, v in known.files.items()} if known else {}  # folder -> paths
        self.located: set = set()  # folders whose files' first blocks this process located
        self.absent: set = set()  # block keys that folder locates found the cluster had never loaded
        self.submitted: set = set()  # block keys whose loads this process submitted
        self.registered: set = set()  # datasets this process found or put in the registry
        self.holders: Dict[str, str] = dict(parent.holders) if parent else {}  # block key -> a holder
        self.retried: set = set()  # datasets whose erred blocks this process had retried
        self._exit_hook = False

    # -- the connection -----------------------------------------------------------------
    @property
    def client(self) -> distributed.Client:
        if self._client is None:
            with self._lock:
                if self._client is None:
                    client = distributed.Client(self.address, set_as_default=False,
                                                timeout=dask.config.get("distributed.comm.timeouts.connect"))
                    ensure_plugin(client)
                    self.my_host = _my_host(client)
                    self.gatherer = Gatherer(client, self.my_host, LocalArenas(0, 1))
                    self._client = client
                    if not self._exit_hook:
                        self._exit_hook = True
                        # forked and spawned processes of multiprocessing run finalizers, not atexit
                        multiprocessing.util.Finalize(self, self.flush_hits, exitpriority=100)
                        atexit.register(self.flush_hits)
        return self._client

    def close(self) -> None:
        """Report the last hits and close the connection."""
        self.flush_hits()
        with self._lock:
            client, self._client = self._client, None
        if client is not None:
            client.close(timeout=EXIT_SECONDS)

    def _call(self, op: str, **msg):
        client = self.client
        return client.sync(getattr(client.scheduler, op), **msg)

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
        """Share infos read from the store with the run (in the background: a process
        that exits first only costs the next one a store request)."""
        client = self.client
        msg = [[f"{fsid}|{f}", kind, p, v] for f, kind, p, v in puts]
        client.loop.add_callback(_quietly, client.scheduler.dmdask_fs_metadata, run=self.run, put=msg)

    def info(self, fsid: str, target, path: str) -> dict:
        """The target's info of `path`, read from the store once per run."""
        key = f"{fsid}|{path}"
        found = self.infos.get(key)
        if found is None and f"{fsid}|{folder_of(path)}" not in self.asked_infos:
            # once per process and folder (not when the folder was asked for its listing
            # only: the run may have read its files' infos since)
            self._ask(fsid, folder_of(path))
            found = self.infos.get(key)
        if found is None:
            found = plain(target.info(path))
            self._tell(fsid, [[folder_of(path), "info", path, found]])
            with self._lock:
                self._know(fsid, path, found)
        return found

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
        if stop <= start:
            return b""
        info = source.info
        rows = np.arange(start // ROW_BYTES, -(-stop // ROW_BYTES), dtype=np.int64)
        blocks = rows // info.block_len
        offsets = rows - blocks * info.block_len
        keys = {k: info.block_key(k) for k in np.unique(blocks).tolist()}
        recovery = float(dask.config.get("dmdask.client.recovery-seconds"))
        deadline = time.monotonic() + recovery
        attempt = 0
        while True:
            attempt += 1
            holders = self._holders(fs, source, list(keys.values()), deadline)
            plan, positions = plan_rows(blocks, offsets, keys, holders)
            client = self.client
            try:
                arrays = self.gatherer.take_local(plan, positions, len(rows))
                if arrays is None:  # a block held elsewhere, or not described yet
                    arrays = client.sync(self.gatherer.gather, plan, positions, len(rows))
                break
            except BlockReadError:
                raise
            except (Moved, OSError, CommClosedError) as exc:  # released, moved, or a worker left: locate again
                for key in keys.values():
                    self.holders.pop(key, None)
                if time.monotonic() > deadline:
                    raise RuntimeError(f"bytes {start}..{stop - 1} of {info.url} still failing after "
                                       f"{recovery:.0f} s (dmdask.client.recovery-seconds)") from exc
                time.sleep(min(1.0, 0.05 * attempt))
        if self.gatherer.due(HITS_SECONDS):
            client.loop.add_callback(self.gatherer.flush_hits_every, HITS_SECONDS)
        data = arrays["data"]
        joined = data[0] if len(data) == 1 else np.concatenate(list(data))
        first = start - int(rows[0]) * ROW_BYTES
        return joined[first:first + stop - start].tobytes()

    def _holders(self, fs, source: FileSource, keys: List[str], deadline: float) -> Dict[str, str]:
        """A holder of each block, submitting the loads of blocks the cluster does not
        have (its first reader, or after the scheduler forgot them) and waiting for them.
        The first time in a process, the first blocks of the folder's other files are
        located (and described) too, with the same request."""
        folder = f"{fs._fsid}|{folder_of(source.path)}"
        if folder not in self.located:
            self.located.add(folder)
            self._locate_folder(fs, folder, keys)
        while True:
            unknown = [k for k in keys if k not in self.holders]
            if not unknown:
                return {k: self.holders[k] for k in keys}
            name = source.info.name
            checked = name not in self.registered
            if checked:  # one request registers it if it is new; then nothing is loaded
                self.registered.add(name)
                if get_or_register(self.client, source):
                    self.absent.update(unknown)
            if all(k in self.absent for k in unknown):  # known not to be loaded: no need to ask
                reply = {"holders": {}, "erred": {}, "unknown": unknown}
                self.absent.difference_update(unknown)
            else:
                expect = [k for k in unknown if k in self.submitted]
                reply = self._call("dmdask_locate", keys=unknown, host=self.my_host, timeout=LOCATE_SECONDS,
                                   expect=expect)
                self.submitted.difference_update(expect)  # waited for once: from now on, as any other key
            self.holders.update(reply["holders"])
            if reply["erred"]:
                if name in self.retried:
                    raise clean_exception(next(iter(reply["erred"].values())))[1]
                self.retried.add(name)
                get_or_register(self.client, source)  # retries its erred blocks
            if reply["unknown"]:
                if not checked:
                    get_or_register(self.client, source)  # registered again, should it have been released
                del submit_blocks(self.client, [source.reader(parse_block_key(k)[1]) for k in reply["unknown"]])[:]
                self.submitted.update(reply["unknown"])  # the next locate waits for them
            if time.monotonic() > deadline:
                if not self.client.scheduler_info().get("workers"):
                    raise NoWorkersError(f"the cluster has no workers to read {source.info.url} through")
                raise RuntimeError(f"blocks of {source.info.url} still not loaded after "
                                   "dmdask.client.recovery-seconds; is the cluster losing workers?")

    def _locate_folder(self, fs, folder: str, keys: List[str]) -> None:
        """Holders of `keys` and of the first block of up to `FOLDER_FILES` other files of
        the folder this process knows (not waiting for any), and the layout of those held
        in files on this host: later reads of the folder's files need no request."""
        wanted = list(keys)
        for path in sorted(self.files.get(folder, ()))[:FOLDER_FILES]:
            info = self.infos.get(f"{fs._fsid}|{path}")
            if info and info.get("type", "file") == "file" and info.get("size"):
                wanted.append(fs.source(path, info).info.block_key(0))
        reply = self._call("dmdask_locate", keys=list(dict.fromkeys(wanted)), host=self.my_host, timeout=0)
        self.holders.update(reply["holders"])
        self.absent.update(reply["unknown"])
        by_holder: Dict[str, List[str]] = {}
        for key, holder in reply["holders"].items():
            by_holder.setdefault(holder, []).append(key)
        client = self.client
        client.sync(self.gatherer.describe, by_holder)


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
