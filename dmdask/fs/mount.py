"""`dmdask mount URL MOUNTPOINT`: the transparent cache as a read-only POSIX folder (FUSE through
`mfusepy`, over a `DmdaskFileSystem`) for loaders that only `open()` paths; docs/transparent.md.

Guarantees: requests are served concurrently (libfuse's multithreaded loop; the session is
thread-safe); listings, attributes and file pages stay in the kernel's caches for the mount's
lifetime (`CACHE_SECONDS`, `kernel_cache`). The lookup of a file new to the run reads up to
`READ_AHEAD_FILES` other new files of its folder ahead (the kernel sends one folder's lookups
one at a time), each still from the store once.
"""
from __future__ import annotations

import errno
import functools
import logging
import os
import shutil
import signal
import stat
import subprocess
import sys
import threading

import fsspec

from . import DmdaskFileSystem

TIME_KEYS = ("mtime", "LastModified", "last_modified", "updated", "created")
CACHE_SECONDS = 86400.0  # how long the kernel keeps names and attributes (the mount is one run)
THREADS = 16  # libfuse's idle threads kept for concurrent requests
# New files of a folder whose first blocks the lookup of one of them reads along with its own
# (one scheduler request for their claims, the GETs concurrent): the kernel sends lookups of
# names in one folder one at a time, so a reader opening a folder's files in any order would
# otherwise wait for one store round trip after the other.
READ_AHEAD_FILES = 16
AHEAD_LOOKED = 4 * READ_AHEAD_FILES  # the most names after it a lookup looks at for files to read ahead
logger = logging.getLogger(__name__)


def _answering(FuseOSError, op):
    """`op` with its errors as the errno a reader of a local file system expects: a missing
    path ENOENT, a folder EISDIR, anything else (a lost scheduler, no workers, a store error)
    EIO, logged with its message (never libfuse's default EINVAL)."""

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
    except (ImportError, OSError) as exc:  # no mfusepy, or no libfuse on this machine
        raise RuntimeError(f"dmdask mount needs mfusepy and libfuse (pip install 'dmdask[fuse]'; "
                           f"apt-get install fuse3): {exc}") from exc
    return mfusepy


def _seconds(entry: dict) -> float:
    """The entry's first time that is a number (0.0: none)."""
    return next((float(entry[key]) for key in TIME_KEYS if isinstance(entry.get(key), (int, float))), 0.0)


def _kernel_opens_files() -> bool:
    """Whether the kernel opens a FUSE file itself when `open` answers ENOSYS (Linux
    4.20's no-open mode); older kernels and macFUSE would fail the caller's open()."""
    system = os.uname()
    try:
        version = tuple(int(part) for part in system.release.split("-")[0].split(".")[:2])
    except ValueError:
        return False
    return system.sysname == "Linux" and version >= (4, 20)


def operations(fs: DmdaskFileSystem, root: str):
    """The FUSE operations of a read-only view of folder `root` of `fs` (target naming)."""
    mfusepy = _fuse()
    FuseOSError = mfusepy.FuseOSError

    class CacheMount(mfusepy.Operations):
        use_ns = False

        def __init__(self):
            self.root = root.rstrip("/")
            self._folders: dict[str, dict[str, dict]] = {}  # mount path -> {name: listing entry}
            self._orders: dict[str, tuple] = {}  # mount path -> (its names in listing order, name -> position)

        def _target(self, path: str) -> str:
            return self.root if path in ("", "/") else f"{self.root}/{path.lstrip('/')}"

        def _entries(self, path: str) -> dict[str, dict]:
            found = self._folders.get(path)
            if found is None:
                try:
                    entries = fs.ls(self._target(path), detail=True)
                except (FileNotFoundError, NotADirectoryError):
                    raise FuseOSError(errno.ENOENT) from None
                found = self._folders[path] = {e["name"].rstrip("/").rsplit("/", 1)[-1]: e for e in entries}
            return found

        def getattr(self, path, fh=None):
            if path in ("", "/"):
                return {"st_mode": stat.S_IFDIR | 0o555, "st_nlink": 2}
            parent, _, name = path.rstrip("/").rpartition("/")
            entry = self._entries(parent or "/").get(name)
            if entry is None:
                raise FuseOSError(errno.ENOENT)
            if entry.get("type") == "directory":
                return {"st_mode": stat.S_IFDIR | 0o555, "st_nlink": 2, "st_mtime": _seconds(entry)}
            if entry.get("size") is None:  # listings that give no sizes (HTTP): the first block's GET does
                entry = fs.open_info(self._target(path), self._ahead(parent or "/", name), READ_AHEAD_FILES)
            seconds = _seconds(entry)
            return {"st_mode": stat.S_IFREG | 0o444, "st_nlink": 1, "st_size": int(entry.get("size") or 0),
                    "st_mtime": seconds, "st_ctime": seconds, "st_atime": seconds}

        def _ahead(self, folder: str, name: str):
            """The files of `folder` after `name` (in listing order, wrapping; at most
            `AHEAD_LOOKED` of them) whose sizes the listing does not give: what a lookup of
            `name` may read ahead (those new to the run, up to `READ_AHEAD_FILES`)."""
            names, where = self._order(folder)
            start = where.get(name, -1) + 1
            entries = self._entries(folder)
            for i in range(start, start + min(AHEAD_LOOKED, len(names) - 1)):
                other = names[i % len(names)]
                entry = entries[other]
                if other != name and entry.get("type") != "directory" and entry.get("size") is None:
                    yield self._target(f"{folder.rstrip('/')}/{other}")

        def _order(self, folder: str) -> tuple[list[str], dict[str, int]]:
            found = self._orders.get(folder)
            if found is None:
                names = list(self._entries(folder))
                found = self._orders[folder] = (names, {n: i for i, n in enumerate(names)})
            return found

        def readdir(self, path, fh):
            entries = self._entries(path)
            return [".", ".."] + [(name, stat.S_IFDIR if e.get("type") == "directory" else stat.S_IFREG, 0)
                                  for name, e in sorted(entries.items())]

        def read(self, path, size, offset, fh):
            return fs.cat_file(self._target(path), start=offset, end=offset + size)

    if _kernel_opens_files():
        def no_open(self, path, flags):
            """ENOSYS: the kernel then opens and closes files of this mount without asking
            it, keeping their cached pages (a file handle holds nothing here), so re-reading
            a cached file costs no round trip to this process."""
            raise FuseOSError(errno.ENOSYS)

        CacheMount.open = no_open  # elsewhere no open: libfuse answers it

    for name in ("getattr", "readdir", "read"):
        setattr(CacheMount, name, _answering(FuseOSError, getattr(CacheMount, name)))
    return CacheMount()


def mount(url: str, mountpoint: str, scheduler=None, block_size=None, debug: bool = False) -> None:
    """Serve `url` (a folder, through the dmdask cluster at `scheduler`) read-only at
    `mountpoint` until unmounted (`fusermount3 -u MOUNTPOINT`), interrupted (Ctrl-C) or
    terminated (SIGTERM, SIGHUP); it returns after either, the mount point unmounted.
    `SourceNotFoundError` (naming `url`) if there is nothing at `url`, `NotADirectoryError`
    if it is a file: nothing is mounted then."""
    if not os.path.isdir(mountpoint):
        raise NotADirectoryError(f"mount point {mountpoint!r} is not a folder")
    mountpoint = os.path.abspath(mountpoint)  # libfuse changes the working folder to /
    stop = _Stopper(mountpoint)  # first: the threads started from here on inherit its signal mask
    try:
        chained = url if url.startswith(("dmdask::", "dmdask://")) else f"dmdask::{url}"
        fs, path = fsspec.core.url_to_fs(chained, scheduler=scheduler, block_size=block_size)
        _check_folder(fs, path, url)
        ops = operations(fs, path)
        # nothreads=False: concurrent requests; max_idle_threads: else libfuse 3.14 warns "Ignoring invalid max threads"
        fuse = _fuse()
        options = dict(kernel_cache=True, attr_timeout=CACHE_SECONDS, entry_timeout=CACHE_SECONDS,
                       negative_timeout=CACHE_SECONDS)
        if fuse.fuse_version_major >= 3:
            options["max_idle_threads"] = THREADS
        stop.serving()
        fuse.FUSE(ops, mountpoint, foreground=True, nothreads=False, debug=debug, ro=True, fsname="dmdask", **options)
    finally:
        stop.done()


def _check_folder(fs, path: str, url: str) -> None:
    """Refuse to mount what is not a folder of the store, naming `url`."""
    from ..errors import SourceNotFoundError
    from ..source.urls import public

    if fs.isdir(path):
        return
    try:
        fs.info(path)
    except FileNotFoundError:
        raise SourceNotFoundError(f"{public(url)} does not exist: nothing to mount (give a folder of the "
                                  "store, e.g. https://host/train or s3://bucket/train)") from None
    raise NotADirectoryError(f"{public(url)} is a file, not a folder: dmdask mount serves a folder of the store")


class _Stopper:
    """Ctrl-C, SIGTERM and SIGHUP stop the mount by unmounting it: the FUSE loop then ends as
    after `fusermount3 -u`, and `mount` returns. Before the FUSE loop starts, they end the
    process at once (status 128 + the signal's number), nothing being mounted yet. The
    signals are blocked in the thread that makes this and in every thread started after it
    (libfuse's and the Dask client's), and taken by a thread of this class. Left to libfuse,
    a signal ended its loop with an error status (8), which mfusepy raises."""

    SIGNALS = {signal.SIGINT, signal.SIGTERM, signal.SIGHUP}

    def __init__(self, mountpoint: str):
        self.mountpoint = mountpoint
        self._lock = threading.Lock()
        self._serving = False
        self._ended = threading.Event()
        self._blocked = signal.pthread_sigmask(signal.SIG_BLOCK, self.SIGNALS)
        threading.Thread(target=self._wait, name="dmdask-mount-signals", daemon=True).start()

    def serving(self) -> None:
        """The FUSE loop is about to mount and serve: a signal from now on unmounts."""
        with self._lock:
            self._serving = True

    def _wait(self) -> None:
        got = signal.sigwait(self.SIGNALS)
        with self._lock:
            if not self._serving and not self._ended.is_set():
                sys.stderr.flush()
                os._exit(128 + got)
        logger.info("dmdask mount: %s, unmounting %s", signal.Signals(got).name, self.mountpoint)
        # a signal while FUSE mounts: wait for the mount (or for FUSE to give up)
        while not os.path.ismount(self.mountpoint) and not self._ended.wait(0.05):
            pass
        if not self._ended.is_set():
            _unmount(self.mountpoint)

    def done(self) -> None:
        """The FUSE loop ended (or never started): signals act as before again."""
        with self._lock:
            self._ended.set()
        signal.pthread_sigmask(signal.SIG_SETMASK, self._blocked)


def _unmount(mountpoint: str) -> None:
    """Detach the mount (lazily: a reader with a file still open keeps it until it closes)."""
    tool = shutil.which("fusermount3") or shutil.which("fusermount")
    if tool:
        subprocess.run([tool, "-u", "-z", mountpoint], check=False, timeout=60)
    else:  # root without fuse3's tools (libfuse mounted with mount(2))
        subprocess.run(["umount", "-l", mountpoint], check=False, timeout=60)
