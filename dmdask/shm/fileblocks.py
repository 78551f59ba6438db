"""The file-block format: a block as one raw file per field in a folder of its own, written
once by its worker (`write`), mapped read-only by processes of its host (`map_arrays`);
variable-size fields (ragged, strings) as values plus offsets. The layout keeps every dtype
and shape, so reads parse no header (`np.load`'s is not thread-safe on CPython 3.11)."""
from __future__ import annotations

import errno
import mmap
import os
import shutil
import tempfile

import numpy as np

from ..protocol.pieces import byte_view
from .modes import create_file, group_of, protect_folder

Arrays = dict[str, np.ndarray]


def write(directory: str, arrays: Arrays, start: int) -> tuple[str, tuple]:
    """Write the fields of a block of samples from `start` under a new folder of
    `directory`: (the folder, its layout). On error nothing is left behind."""
    gid = group_of(directory)
    path = tempfile.mkdtemp(dir=directory, prefix=f"b{start}-")
    protect_folder(path, gid)  # mapped read-only by training processes of this user (or group)
    layout = []
    try:
        for name, arr in arrays.items():
            if arr.dtype == object or arr.dtype.kind == "T":
                kind = "ragged" if arr.dtype == object else "strings"
                values = [v.encode() for v in arr.tolist()] if kind == "strings" else list(arr)
                sizes = np.fromiter((len(v) for v in values), dtype=np.int64, count=len(values))
                offsets = np.concatenate([[0], np.cumsum(sizes)]).astype(np.int64)
                flat = (np.frombuffer(b"".join(values), dtype=np.uint8) if kind == "strings"
                        else np.concatenate(values) if values else np.zeros(0, np.uint8))
                _write(path, f"{name}.values", flat, gid)
                _write(path, f"{name}.offsets", offsets, gid)
                layout.append((name, kind, flat.dtype.str, flat.shape))
            else:
                _write(path, name, arr, gid)
                layout.append((name, "fixed", arr.dtype.str, arr.shape))
    except BaseException:
        shutil.rmtree(path, ignore_errors=True)
        raise
    return path, tuple(layout)


def files_exist(path: str, layout: tuple, samples: int) -> bool:
    """Whether every file of a block of `samples` samples is still there with the size its layout says."""
    sizes = {}
    for name, kind, dtype, shape in layout:
        nbytes = np.dtype(dtype).itemsize * int(np.prod(shape, dtype=np.int64))
        if kind == "fixed":
            sizes[name] = nbytes
        else:
            sizes[f"{name}.values"], sizes[f"{name}.offsets"] = nbytes, 8 * (samples + 1)
    try:
        return all(os.path.getsize(os.path.join(path, n)) == size for n, size in sizes.items())
    except OSError:
        return False


def readable(description: dict | None) -> bool:
    """Whether this process may map the files of a block's description (a file block's or
    an arena block's); a process of another user takes the block's rows through the worker."""
    if description is None:
        return False
    path = description["path"] if "path" in description else next(iter(description["arena"].values()))[0]
    return os.access(path, os.R_OK)


def map_arrays(description: dict) -> dict:
    """The fields of a file block (its description: path, layout) mapped read-only, as
    `take_rows` takes them; FileNotFoundError once the block was released."""
    path, out = description["path"], {}
    for name, kind, dtype, shape in description["layout"]:
        if kind == "fixed":
            out[name] = (kind, _map(os.path.join(path, name), dtype, shape))
        else:
            offsets = np.fromfile(os.path.join(path, f"{name}.offsets"), dtype=np.int64)
            out[name] = (kind, (_map(os.path.join(path, f"{name}.values"), dtype, shape), offsets))
    return out


def take_rows(mapped: dict, rows: np.ndarray) -> Arrays:
    """Rows of a mapped block (`map_arrays`), copied into new arrays."""
    out = {}
    for name, (kind, data) in mapped.items():
        if kind == "fixed":
            out[name] = data[rows]
            continue
        values, offsets = data
        if kind == "strings":
            out[name] = np.array([bytes(values[offsets[r]:offsets[r + 1]]).decode() for r in rows],
                                 dtype=np.dtypes.StringDType())
        else:
            col = np.empty(len(rows), dtype=object)
            for i, r in enumerate(rows.tolist()):
                col[i] = np.array(values[offsets[r]:offsets[r + 1]])
            out[name] = col
    return out


def assemble(parts, n: int) -> Arrays:
    """A group of `n` rows from `parts`, (positions, arrays) pairs, each part's rows at its positions."""
    out: Arrays = {}
    for where, arrays in parts:
        for name, values in arrays.items():
            if name not in out:
                out[name] = np.empty((n,) + values.shape[1:], dtype=values.dtype)
            out[name][where] = values
    return out


def _map(path: str, dtype: str, shape: tuple) -> np.ndarray:
    """A read-only array over the file's pages (a plain ndarray: no `np.memmap` overhead per call)."""
    if 0 in shape:
        return np.zeros(shape, dtype=dtype)
    expected = np.dtype(dtype).itemsize * int(np.prod(shape, dtype=np.int64))
    with open(path, "rb") as f:
        size = os.fstat(f.fileno()).st_size
        if size != expected:  # not the file the block wrote (replaced, truncated): as if gone
            raise FileNotFoundError(errno.ENOENT, f"holds {size} bytes where its block's layout {dtype} {shape} "
                                    f"takes {expected}: not this block's file any more", path)
        pages = mmap.mmap(f.fileno(), 0, access=mmap.ACCESS_READ)
    return np.frombuffer(pages, dtype=dtype).reshape(shape)


def _write(directory: str, name: str, arr: np.ndarray, gid: int | None) -> None:
    with os.fdopen(create_file(os.path.join(directory, name), gid), "wb") as f:  # a full disk: OSError(ENOSPC)
        f.write(byte_view(np.ascontiguousarray(arr)))
