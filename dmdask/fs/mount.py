"""`dmdask mount URL MOUNTPOINT`: the transparent cache as a read-only POSIX folder, for
loaders that only `open()` paths (tf.data, C++ readers).

The mount is a FUSE file system (libfuse 2 or 3 through `mfusepy`) over a
`DmdaskFileSystem`: the same blocks, placement, same-host shared memory and accounting
as `dmdask::` URLs. Folders come from the store's listings (once per run), file sizes
and times from its infos; a file's reads go through one open `DmdaskFile` per open
file handle, a cached block at a time. Writes fail with EROFS.
"""
from __future__ import annotations

import errno
import functools
import logging
import os
import stat
import threading
from typing import Dict, Tuple

from . import DmdaskFileSystem  # noqa: F401  (operations take one)

TIME_KEYS = ("mtime", "LastModified", "last_modified", "updated", "created")
logger = logging.getLogger(__name__)


def _answering(FuseOSError, op):
    """`op` with its errors as the errno a reader of a local file system expects: a
    missing path ENOENT, a folder EISDIR, anything else (a lost scheduler, no workers
    within `dmdask.client.recovery-seconds`, a store error) EIO, logged with its message
    (never libfuse's default EINVAL)."""

    @functools.wraps(op)
    def answer(*args):
        try:
            return op(*args)
        except FuseOSError:
            raise
        except FileNotFoundError:
            raise FuseOSError(errno.ENOENT) from None
        except (IsADirectoryError, NotADirectoryError) as exc:
            raise FuseOSError(errno.EISDIR if isinstance(exc, IsADirectoryError) else errno.ENOTDIR) from None
        except Exception as exc:  # noqa: BLE001 - every other failure is an I/O error to the reader
            logger.error("dmdask mount: %s%r failed: %s: %s", op.__name__, args[1:2], type(exc).__name__, exc)
            raise FuseOSError(errno.EIO) from exc

    return answer


def _fuse():
    try:
        import mfusepy
    except (ImportError, OSError, EnvironmentError) as exc:  # no mfusepy, or no libfuse on this machine
        raise RuntimeError(f"dmdask mount needs mfusepy and libfuse (pip install 'dmdask[fuse]'; "
                           f"apt-get install fuse3): {exc}") from exc
    return mfusepy


def _seconds(entry: dict) -> float:
    for key in TIME_KEYS:
        value = entry.get(key)
        if isinstance(value, (int, float)):
            return float(value)
    return 0.0


def operations(fs: DmdaskFileSystem, root: str):
    """The FUSE operations of a read-only view of folder `root` of `fs` (target naming)."""
    mfusepy = _fuse()
    FuseOSError = mfusepy.FuseOSError

    class CacheMount(mfusepy.Operations):
        use_ns = False

        def __init__(self):
            self.root = root.rstrip("/")
            self._files: Dict[int, Tuple[object, threading.Lock]] = {}
            self._next = 0
            self._lock = threading.Lock()

        def _target(self, path: str) -> str:
            return self.root if path in ("", "/") else f"{self.root}/{path.lstrip('/')}"

        def _entries(self, path: str) -> Dict[str, dict]:
            try:
                entries = fs.ls(self._target(path), detail=True)
            except (FileNotFoundError, NotADirectoryError):
                raise FuseOSError(errno.ENOENT) from None
            return {e["name"].rstrip("/").rsplit("/", 1)[-1]: e for e in entries}

        def getattr(self, path, fh=None):
            if path in ("", "/"):
                return {"st_mode": stat.S_IFDIR | 0o555, "st_nlink": 2}
            parent, _, name = path.rstrip("/").rpartition("/")
            entry = self._entries(parent).get(name)
            if entry is None:
                raise FuseOSError(errno.ENOENT)
            if entry.get("type") == "directory":
                return {"st_mode": stat.S_IFDIR | 0o555, "st_nlink": 2, "st_mtime": _seconds(entry)}
            if entry.get("size") is None:  # listings that give no sizes (HTTP): the file's info does
                entry = fs.info(self._target(path))
            seconds = _seconds(entry)
            return {"st_mode": stat.S_IFREG | 0o444, "st_nlink": 1, "st_size": int(entry.get("size") or 0),
                    "st_mtime": seconds, "st_ctime": seconds, "st_atime": seconds}

        def readdir(self, path, fh):
            return [".", ".."] + sorted(self._entries(path))

        def open(self, path, flags):
            if flags & (os.O_WRONLY | os.O_RDWR | os.O_APPEND | os.O_TRUNC):
                raise FuseOSError(errno.EROFS)
            try:
                handle = fs.open(self._target(path), "rb")
            except FileNotFoundError:
                raise FuseOSError(errno.ENOENT) from None
            except IsADirectoryError:
                raise FuseOSError(errno.EISDIR) from None
            with self._lock:
                self._next += 1
                self._files[self._next] = (handle, threading.Lock())
                return self._next

        def read(self, path, size, offset, fh):
            handle, lock = self._files[fh]
            with lock:  # one file object per handle: its position and blocks are not shared
                handle.seek(offset)
                return handle.read(size)

        def release(self, path, fh):
            with self._lock:
                handle, _ = self._files.pop(fh, (None, None))
            if handle is not None:
                handle.close()
            return 0

    for name in ("getattr", "readdir", "open", "read"):
        setattr(CacheMount, name, _answering(FuseOSError, getattr(CacheMount, name)))
    return CacheMount()


def mount(url: str, mountpoint: str, scheduler=None, block_size=None, debug: bool = False) -> None:
    """Serve `url` (a folder, through the dmdask cluster at `scheduler`) read-only at
    `mountpoint` until unmounted (`fusermount3 -u MOUNTPOINT`) or interrupted."""
    import fsspec

    if not os.path.isdir(mountpoint):
        raise NotADirectoryError(f"mount point {mountpoint!r} is not a folder")
    chained = url if url.startswith(("dmdask::", "dmdask://")) else f"dmdask::{url}"
    fs, path = fsspec.core.url_to_fs(chained, scheduler=scheduler, block_size=block_size)
    ops = operations(fs, path)
    # max_idle_threads: libfuse 3.14 otherwise warns "Ignoring invalid max threads value" (10: its default)
    _fuse().FUSE(ops, mountpoint, foreground=True, nothreads=False, debug=debug, ro=True, fsname="dmdask",
                 max_idle_threads=10)
