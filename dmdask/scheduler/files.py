"""`FileMetadata`: the folder listings and file infos (size, modification time or ETag)
transparent mode (`dmdask.fs`) read from the store, kept on the scheduler, by folder.

A process is answered only with entries its own run (`dmdask.fs.run`) read: within a run
a folder is listed and a file's info fetched once, whoever asks; a new run sees a file
changed since. A process about to read a file's info claims it first (`claim`): while the
claim stands (`PROBE_SECONDS`, or until the info is put, or released: the read failed,
as for a missing file) the run's other processes wait.
"""
from __future__ import annotations

import time
from collections.abc import Sequence

import zict

from ..protocol.scheduler import FileEntry, FolderEntries, InfoClaims

RUNS_KEPT = 16  # runs remembered per entry (older runs read it again)
FOLDERS_KEPT = 100_000  # folders kept (least recently asked for dropped first)
PROBE_SECONDS = 10.0  # how long a claim to read a file's info stands (its claimant may have died)


class _Entry:
    __slots__ = ("runs", "value")

    def __init__(self, value, run: str):
        self.value, self.runs = value, [run]


def _seen(entry: _Entry | None, value, run: str) -> _Entry:
    """`entry` once `run` read `value` from the store (a new one when the value is new)."""
    if entry is None or value != entry.value:
        return _Entry(value, run)
    if run not in entry.runs:
        entry.runs = entry.runs[-(RUNS_KEPT - 1):] + [run]
    return entry


class _Folder:
    __slots__ = ("infos", "listing", "probing")

    def __init__(self):
        self.listing: _Entry | None = None
        self.infos: dict[str, _Entry] = {}
        self.probing: dict[tuple, float] = {}  # (run, path) -> when its info was claimed


class FileMetadata:
    """See the module docstring (`folder` keys name the store and its options too). Used
    from the scheduler's event loop."""

    def __init__(self):
        self.folders = zict.LRU(FOLDERS_KEPT, {})  # folder -> _Folder (least recently asked for dropped first)

    def put(self, run: str, entries: Sequence[FileEntry]) -> None:
        """`run` read these listings and infos from the store (ending its claims of them)."""
        for folder, kind, path, value in entries:
            entry = self._folder(folder)
            entry.probing.pop((run, path), None)
            if kind == "listing":
                entry.listing = _seen(entry.listing, value, run)
            else:
                entry.infos[path] = _seen(entry.infos.get(path), value, run)

    def release(self, run: str, claims: Sequence[tuple[str, str]]) -> None:
        """`run`'s claims of these (folder, path) end unanswered (their reads failed): the
        next reader of each reads the store itself, at once."""
        for folder, path in claims:
            entry = self.folders.get(folder)
            if entry is not None:
                entry.probing.pop((run, path), None)

    def get(self, run: str, folders: Sequence[str]) -> dict[str, FolderEntries]:
        """What `run` read of these folders (those it read nothing of left out)."""
        out = {}
        for folder in folders:
            entry = self.folders.get(folder)
            if entry is None:
                continue
            listing = entry.listing.value if entry.listing is not None and run in entry.listing.runs else None
            out[folder] = FolderEntries(listing, {p: e.value for p, e in entry.infos.items() if run in e.runs})
        return out

    def claim(self, run: str, claim: Sequence[tuple[str, str]]) -> InfoClaims:
        """(folder, path) of infos the caller will read from the store unless known to
        `run` (answered in `known`), claimed by another process of the run (`probing`: ask
        again shortly), or read by another run only (`elsewhere`, not claimed: the caller
        checks its version with the store, and may find its blocks cached)."""
        now = time.monotonic()
        reply = InfoClaims({}, [], [])
        for folder, path in claim:
            entry = self._folder(folder)
            found = entry.infos.get(path)
            if found is not None and run in found.runs:
                reply.known[(folder, path)] = found.value
            elif found is not None:
                reply.elsewhere.append((folder, path))
            elif now - entry.probing.get((run, path), -PROBE_SECONDS) < PROBE_SECONDS:
                reply.probing.append((folder, path))
            else:
                entry.probing[(run, path)] = now
        return reply

    def _folder(self, folder: str) -> _Folder:
        return self.folders.setdefault(folder, _Folder())
