"""Transparent mode's file metadata in one process: the listings and infos of the store,
shared with the other processes of the run through the scheduler (`dmdask.scheduler.files`).

Guarantees: a listing or an info is asked of the store once per run (`dmdask.fs.run`);
what a process reads from the store is told to the scheduler in the background, a batch
at a time. `claim_info` waits while another process of the run reads a file's info.
"""
from __future__ import annotations

import asyncio
import datetime
import email.utils
import logging
import time

import dask.config
import fsspec
import fsspec.asyn

from ..protocol.scheduler import FileEntry, FsClaim, FsMetadata, SchedulerAPI
from ..recovery import Tries
from . import probe
from .run import new_run
from .run import start as start_run

logger = logging.getLogger(__name__)

TELL_DELAY = 0.25  # infos read from the store within this delay are told to the scheduler together
ELSEWHERE = object()  # `claim_info`: another run read the info
CLAIM_POLL_SECONDS = 0.02  # how often a process waiting for a file's info another one reads asks again
# the keys of fsspec infos (local, S3, GCS, HTTP, ...) that change when a file is rewritten
VERSION_KEYS = ("mtime", "LastModified", "last_modified", "Last-Modified", "ETag", "etag", "updated",
                "generation", "VersionId", "version_id")


TIMESTAMP_TICK = 1.0  # the coarsest modification times of a local file system (ext4 with small inodes: 1 s)


def settled(fs, path: str, info: dict) -> dict:
    """A local file's info whose modification time vouches for its content from now on. A
    file system with coarse timestamps gives a file rewritten within the tick of its last
    write the same time: the info of a file modified less than `TIMESTAMP_TICK` ago is read
    again once that tick has passed (a rewrite after it has another time), at most one
    tick's wait, for such files only."""
    mtime = info.get("mtime")
    while isinstance(mtime, (int, float)):
        wait = mtime + TIMESTAMP_TICK - time.time()
        if wait <= 0:
            return info
        time.sleep(wait)
        info = plain(fs.info(path))
        mtime = None if info.get("mtime") == mtime else info.get("mtime")  # rewritten meanwhile: settle that one
    return info


def version_of(info: dict) -> list:
    return [[k, str(info[k])] for k in VERSION_KEYS if info.get(k) is not None]


def modified_of(info: dict) -> datetime.datetime | None:
    """The modification time an fsspec info gives (a local file's `mtime`, S3's
    `LastModified`, HTTP's `Last-Modified`, GCS's `updated`, as values or as the strings
    `plain` makes of them), timezone-aware; None where it gives none."""
    for key in ("mtime", "LastModified", "last_modified", "Last-Modified", "updated"):
        value = info.get(key)
        if value is None:
            continue
        if isinstance(value, datetime.datetime):
            found = value
        elif isinstance(value, (int, float)):
            found = datetime.datetime.fromtimestamp(value, tz=datetime.timezone.utc)
        else:
            try:
                found = datetime.datetime.fromisoformat(str(value))
            except ValueError:
                try:
                    found = email.utils.parsedate_to_datetime(str(value))
                except (TypeError, ValueError):
                    continue
        return found if found.tzinfo else found.replace(tzinfo=datetime.timezone.utc)
    return None


def plain(info: dict) -> dict:
    """An info with only values that travel as they are (others as strings)."""
    return {k: v if v is None or isinstance(v, (str, int, float, bool)) else str(v) for k, v in info.items()}


def folder_of(path: str) -> str:
    return path.rstrip("/").rsplit("/", 1)[0]


class Metadata:
    """What one process knows of files (keys `fsid|path`, `fsid|folder`). Thread-safe
    (`session.lock`); a forked child starts with its parent's knowledge of the same run."""

    def __init__(self, session, parent: Metadata | None = None):
        self.session = session
        self._lock = session.lock
        self.run = start_run()
        known = parent if parent is not None and parent.run == self.run else None
        self.infos: dict[str, dict] = dict(known.infos) if known else {}  # fsid|path -> info
        self.listings: dict[str, list] = dict(known.listings) if known else {}  # fsid|folder -> entries
        self.asked: set = set(known.asked) if known else set()  # folders asked of the cluster
        self.asked_infos: set = set(known.asked_infos) if known else set()  # ... for their files' infos
        self.files: dict[str, set] = {k: set(v) for k, v in known.files.items()} if known else {}  # folder -> paths
        self.to_tell: list[FileEntry] = []  # metadata queued for the scheduler

    def _ask(self, fsid: str, folder: str) -> None:
        """Everything this run knows of `folder` now (one request)."""
        key = f"{fsid}|{folder}"
        found = self.session.call(FsMetadata(self.run, get=[key])).found.get(key)
        with self._lock:
            if found is not None and found.listing is not None:
                self.listings[key] = found.listing
            for path, info in (found.infos.items() if found is not None else ()):
                self.know(fsid, path, info)
            self.asked.add(key)
            self.asked_infos.add(key)

    def know(self, fsid: str, path: str, info: dict) -> None:
        self.infos[f"{fsid}|{path}"] = info
        self.files.setdefault(f"{fsid}|{folder_of(path)}", set()).add(path)

    def learn(self, fsid: str, puts: list[FileEntry]) -> None:
        """Know what this process read from the store (`puts`) and share it with the run, in the
        background, a batch at a time."""
        client = self.session.client
        with self._lock:
            for put in puts:
                if put.kind == "listing":
                    self.listings[f"{fsid}|{put.path}"] = put.value
                else:
                    self.know(fsid, put.path, put.value)
            first = not self.to_tell
            self.to_tell.extend(e._replace(folder=f"{fsid}|{e.folder}") for e in puts)
        if first:  # the timer set on the loop's own thread (call_later is not thread-safe)
            client.loop.add_callback(client.loop.call_later, TELL_DELAY, self.tell_queued)

    async def tell_queued(self) -> None:
        with self._lock:
            msg, self.to_tell = self.to_tell, []
        if msg:
            try:
                await SchedulerAPI(self.session.client).send(FsMetadata(self.run, put=msg))
            except Exception:  # noqa: BLE001 - shared metadata is an optimisation
                logger.debug("could not share file metadata with the scheduler", exc_info=True)

    def known_info(self, fsid: str, path: str) -> dict | None:
        """The info of `path` this run read, or None (no store request)."""
        key = f"{fsid}|{path}"
        found = self.infos.get(key)
        if found is None and f"{fsid}|{folder_of(path)}" not in self.asked_infos:
            # once per process and folder (not when the folder was asked for its listing
            # only: the run may have read its files' infos since)
            self._ask(fsid, folder_of(path))
            found = self.infos.get(key)
        return found

    def listed(self, fsid: str, path: str) -> dict | None:
        """The entry of `path` in its folder's listing, if this process holds that listing."""
        path = path.rstrip("/")
        for entry in self.listings.get(f"{fsid}|{folder_of(path)}") or ():
            if entry["name"].rstrip("/") == path:
                return entry
        return None

    def claim_info(self, fsid: str, path: str):
        """The run's info of `path` once known, waiting while another process of the run
        reads it from the store; None: this process is to read it (claimed); ELSEWHERE:
        another run read it (its blocks may be cached: check its version with `info`).
        While the cluster has no workers, waits for one (`Session.call_with_workers`)."""
        folder = f"{fsid}|{folder_of(path)}"
        for _ in Tries(float(dask.config.get("dmdask.client.recovery-seconds")), pause=CLAIM_POLL_SECONDS):
            found = self.infos.get(f"{fsid}|{path}")  # read by another thread of this process meanwhile
            if found is not None:
                return found
            reply = self.session.call_with_workers(FsClaim(self.run, [(folder, path)]))
            found = reply.known.get((folder, path))
            if found is not None:
                with self._lock:
                    self.know(fsid, path, found)
                return found
            if reply.elsewhere:
                return ELSEWHERE
            if not reply.probing:
                return None
        return None

    def claim_infos(self, fsid: str, paths: list[str]) -> tuple[dict, set, set]:
        """One claim request for the infos of `paths` (`claim_info` without its wait): (the
        run's infos of those it knows, path -> info; those another run read; those another
        process of the run is reading). The rest are claimed for this process to read."""
        pairs = [(f"{fsid}|{folder_of(p)}", p) for p in paths]
        reply = self.session.call_with_workers(FsClaim(self.run, pairs))
        known = {path: reply.known[(folder, path)] for folder, path in pairs if (folder, path) in reply.known}
        with self._lock:
            for path, info in known.items():
                self.know(fsid, path, info)
        return known, {p for _, p in reply.elsewhere}, {p for _, p in reply.probing}

    async def release_soon(self, fsid: str, paths: list[str]) -> None:
        """`release`, from the client's event loop (best effort: the claims lapse otherwise)."""
        try:
            await SchedulerAPI(self.session.client).send(
                FsMetadata(self.run, release=[(f"{fsid}|{folder_of(p)}", p) for p in paths]))
        except Exception:  # noqa: BLE001 - the claims then lapse after PROBE_SECONDS
            logger.debug("could not release the claims of %s", paths, exc_info=True)

    def release(self, fsid: str, path: str) -> None:
        """End this process's claim of `path`'s info unanswered (its read failed), before
        the error is raised: the run's next read of it, here or elsewhere, asks the store
        at once rather than waiting out the claim."""
        try:
            self.session.call(FsMetadata(self.run, release=[(f"{fsid}|{folder_of(path)}", path)]))
        except Exception:  # noqa: BLE001 - the read's own error matters more; the claim then lapses
            logger.debug("could not release the claim of %s", path, exc_info=True)

    def info(self, fsid: str, target, path: str) -> dict:
        """The target's info of `path`, read from the store once per run."""
        found = self.known_info(fsid, path)
        if found is None:
            found = plain(target.info(path))
            self.learn(fsid, [FileEntry(folder_of(path), "info", path, found)])
        return found

    def learn_infos(self, fs, paths: list[str]) -> None:
        """Read the infos of `paths` this run does not know yet, concurrently on an async
        store, ahead of reading many files. A path whose info cannot be read is left to `info`.
        Where a first read claims infos (HTTP: `dmdask.fs.probe`) these are claimed too, in one
        request: those another process of the run is reading are left to the read (which waits
        for them), so that process's first blocks are not read twice."""
        fsid = fs.target_id
        for folder in {folder_of(p) for p in paths}:
            if f"{fsid}|{folder}" not in self.asked_infos:
                self._ask(fsid, folder)
        unknown = list(dict.fromkeys(p for p in paths if f"{fsid}|{p}" not in self.infos))
        if len(unknown) < 2:
            return
        target = fsspec.filesystem(fs.target_protocol, **fs.target_options)  # this process's own
        if not target.async_impl:
            return
        claimed = []
        if probe.applies(target):
            known, elsewhere, probing = self.claim_infos(fsid, unknown)
            unknown = [p for p in unknown if p not in known and p not in probing]
            claimed = [p for p in unknown if p not in elsewhere]

        async def all_infos():  # `_info`: the documented coroutine API of an fsspec AsyncFileSystem (2026.9.0)
            return await asyncio.gather(*(target._info(p) for p in unknown), return_exceptions=True)

        found = fsspec.asyn.sync(target.loop, all_infos) if unknown else []
        puts = [FileEntry(folder_of(p), "info", p, plain(info)) for p, info in zip(unknown, found)
                if isinstance(info, dict)]
        failed = [p for p, info in zip(unknown, found) if not isinstance(info, dict) and p in claimed]
        if failed:  # their reads ask the store again, here or elsewhere
            try:
                self.session.call(FsMetadata(self.run, release=[(f"{fsid}|{folder_of(p)}", p) for p in failed]))
            except Exception:  # noqa: BLE001 - the claims then lapse
                logger.debug("could not release the claims of %s", failed, exc_info=True)
        if puts:
            self.learn(fsid, puts)

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
            self.learn(fsid, [FileEntry(path, "listing", path, found)]
                       + [FileEntry(folder_of(e["name"]), "info", e["name"], e) for e in files])
        return found

    def forget(self) -> None:
        self.run = new_run()
        with self._lock:
            for known in (self.infos, self.listings, self.asked, self.asked_infos, self.files):
                known.clear()
