"""Transformed batches handed to a training process on the same host through one file of
the worker's shared-memory folder (`write_batches`), which the process maps copy-on-write
and unlinks at once (`map_batches`). A file a trainer died before mapping is removed once
older than `STALE_SECONDS` (as the worker writes new ones), or with the worker's folder.
"""
from __future__ import annotations

import contextlib
import math
import mmap
import os
import tempfile
import time

import numpy as np

from ..protocol.pieces import byte_view
from .modes import file_mode, group_of

ALIGN = 64  # every array starts on a cache line
STALE_SECONDS = 120.0


def shareable(batches: list[dict]) -> bool:
    """Whether every field of every batch is a plain fixed-size array."""
    return all(isinstance(a, np.ndarray) and a.dtype != object and a.dtype.kind != "T"
               for b in batches for a in b.values())


def write_batches(folder: str, batches: list[dict]) -> dict:
    """Write `batches` into a new file of `folder`: its description for `map_batches`.
    Nothing is left behind on error."""
    _remove_stale(folder)
    layout, offset = [], 0
    for batch in batches:
        fields = []
        for name, arr in batch.items():
            offset = -(-offset // ALIGN) * ALIGN
            fields.append((name, arr.dtype.str, arr.shape, offset))
            offset += arr.nbytes
        layout.append(fields)
    fd, path = tempfile.mkstemp(dir=folder, prefix="result-")  # 0600
    try:
        if group_of(folder) is not None:
            os.fchmod(fd, file_mode(group_of(folder)))
        with os.fdopen(fd, "wb") as f:
            for batch, fields in zip(batches, layout):
                for (name, _, _, at), arr in zip(fields, batch.values()):
                    f.seek(at)
                    f.write(byte_view(np.ascontiguousarray(arr)))
            f.truncate(max(offset, 1))
    except BaseException:
        os.unlink(path)
        raise
    return {"path": path, "layout": layout, "nbytes": offset}


def map_batches(description: dict) -> list[dict]:
    """The batches of a `write_batches` file as writable arrays over its pages, the file unlinked."""
    path = description["path"]
    try:
        with open(path, "rb") as f:
            pages = mmap.mmap(f.fileno(), 0, access=mmap.ACCESS_COPY)
    finally:
        with contextlib.suppress(OSError):  # another user's worker folder: the worker removes it when stale
            os.unlink(path)
    return [{name: np.frombuffer(pages, dtype=dtype, count=math.prod(shape), offset=at).reshape(shape)
             for name, dtype, shape, at in fields}
            for fields in description["layout"]]


_last_sweep: dict = {}


def _remove_stale(folder: str) -> None:
    """Remove result files older than STALE_SECONDS (checked at most every few seconds)."""
    now = time.time()
    if now - _last_sweep.get(folder, 0.0) < STALE_SECONDS / 10:
        return
    _last_sweep[folder] = now
    for entry in os.scandir(folder):
        if entry.name.startswith("result-"):
            with contextlib.suppress(OSError):
                if now - entry.stat().st_mtime > STALE_SECONDS:
                    os.unlink(entry.path)
