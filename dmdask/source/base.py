"""What every source layout has in common: a dataset's description and its block readers.

A dataset is `num_samples` samples cut into blocks of `block_len` consecutive samples
(the last block may be shorter). `DatasetInfo` is all a training process needs to plan
an epoch; a `BlockReader` is the small picklable object a worker reads one block with.
"""
from __future__ import annotations

import contextlib
import dataclasses
import errno
import functools
import importlib
import json
import logging
import threading
import time
from collections.abc import Callable
from typing import Protocol, runtime_checkable

import aiohttp  # fsspec's HTTP client: imported with dmdask rather than within a rank's first epoch
import dask.config
import fsspec
import numpy as np

from ..errors import BlockReadError, SourceError, redact

logger = logging.getLogger(__name__)

BLOCK_KEY_PREFIX = "dmdask-block-"
FIRST_RETRY_WAIT = 0.05  # seconds before the first retry of a read; doubled for each next one
LONGEST_RETRY_WAIT = 5.0
TRANSIENT_ERRNOS = frozenset({errno.ECONNREFUSED, errno.ECONNRESET, errno.ECONNABORTED, errno.ETIMEDOUT,
                              errno.EHOSTUNREACH, errno.ENETUNREACH, errno.ENETDOWN, errno.ENETRESET, errno.EPIPE})
TRANSIENT_ERRORS = (ConnectionError, TimeoutError, aiohttp.ServerDisconnectedError, aiohttp.ClientOSError,
                    aiohttp.ClientPayloadError)
PERMANENT_ERRORS = (aiohttp.ClientSSLError,)  # a TLS certificate refused: a ClientOSError, but never transient
# The most a dataset may have (`DatasetInfo`, checked where it is opened and registered): the
# scheduler keeps a few values per block (a registration of 3x10^7 blocks grew it by 1.4 GiB and
# froze its event loop 6.4 s; one of 2**20 blocks took 0.25 s and 48 MiB, measured in-process)
MAX_BLOCKS = 1 << 20
MAX_SAMPLES = 1 << 48
MAX_BYTES = 1 << 60


@dataclasses.dataclass(frozen=True)
class DatasetInfo:
    """A dataset as the training process sees it. Small (no per-block or per-sample arrays).

    name: the registry name, a function of the spec alone; identity: a token of the data
    as opened, part of every block key, so a dataset changed and released gets new blocks;
    it starts with the token of `name` (`bound`), so a registry entry can only name blocks
    whose loads read that name's source; nbytes: decoded bytes of the whole dataset, None
    when the store gives no sizes; field_types: each field's (name, numpy dtype string,
    sample shape), in `fields`' order, as the source's metadata declares the rows its
    blocks give, or None when only a block's rows tell (a mixture then reads a first row of
    each source to check that they match: `dmdask.client.mixture.check_fields_match`).
    """

    name: str
    identity: str
    url: str
    fields: tuple[str, ...]
    num_samples: int
    block_len: int
    nbytes: int | None
    field_types: tuple[tuple[str, str, tuple[int, ...]], ...] | None = None

    @property
    def bound(self) -> bool:
        """Whether `identity` is bound to `name` (`bound_identity`): what the scheduler
        registers under a name (docs/failures.md, "Trust model")."""
        token = name_token(self.name)
        return bool(token) and self.identity.startswith(token)

    @property
    def num_blocks(self) -> int:
        return -(-self.num_samples // self.block_len)

    def block_range(self, k: int) -> tuple[int, int]:
        """Samples start..stop-1 of block k."""
        start = k * self.block_len
        return start, min(self.num_samples, start + self.block_len)

    def locate(self, sample_ids: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
        """(block index, row in that block) of each sample id."""
        return np.divmod(np.asarray(sample_ids, dtype=np.int64), self.block_len)

    def block_key(self, k: int) -> str:
        return block_key(self.identity, k)

    def block_keys(self, blocks: np.ndarray) -> list[str]:
        """`block_key` of each block number, in C-level loops (a shuffled request of a large
        dataset names up to a block a row)."""
        return list(map(f"{BLOCK_KEY_PREFIX}{self.identity}-".__add__, map(str, np.asarray(blocks).tolist())))


NAME_PREFIXES = ("ds-", "fs-")  # a spec's dataset (`dataset_name`), a file's (`dmdask.source.files`)


def name_token(name: str) -> str:
    """The token of a registry name (`ds-<token>` or `fs-<token>`); "" for any other name."""
    return name[3:] if name.startswith(NAME_PREFIXES) else ""


def bound_identity(name: str, data_token: str) -> str:
    """The identity of a dataset registered as `name` whose data `data_token` names: the
    name's token, then the data's. Block keys carry the identity, and the name is a hash of
    the source's URL, options, fields and block size: a registry entry under one name cannot
    point at the blocks of another source (`DatasetInfo.bound`, checked on the scheduler)."""
    return name_token(name) + data_token


def block_key(identity: str, index: int) -> str:
    """The Dask key of a block: the same for every rank and every job."""
    return f"{BLOCK_KEY_PREFIX}{identity}-{index}"


def parse_block_key(key) -> tuple[str, int] | None:
    """(identity, index) of a block key; None for any other key."""
    if not isinstance(key, str) or not key.startswith(BLOCK_KEY_PREFIX):
        return None
    identity, _, index = key[len(BLOCK_KEY_PREFIX):].rpartition("-")
    return (identity, int(index)) if index.isdigit() else None


def is_block_key(key) -> bool:
    return parse_block_key(key) is not None


def options_json(options) -> str:
    """Storage options as a canonical string (hashable, picklable)."""
    return json.dumps(options or {}, sort_keys=True, default=str)


_fs_lock = threading.Lock()


def read_options(protocol: str, options: dict) -> dict:
    """`options` for a filesystem that reads: over HTTP(S), unless they set aiohttp's timeout,
    a read (or a connection) that receives nothing for `dmdask.store.read-seconds` fails
    with a `TimeoutError`, which the reads retry (aiohttp's own is 300 s for the whole request)."""
    if protocol not in ("http", "https"):
        return options
    client_kwargs = dict(options.get("client_kwargs") or {})
    if "timeout" in client_kwargs:
        return options
    seconds = float(dask.config.get("dmdask.store.read-seconds"))
    client_kwargs["timeout"] = aiohttp.ClientTimeout(total=None, sock_connect=seconds, sock_read=seconds)
    return {**options, "client_kwargs": client_kwargs}


@functools.lru_cache(maxsize=16)
def _filesystem(protocol: str, options: str, read_seconds: float):
    with _fs_lock:
        return fsspec.filesystem(protocol, **read_options(protocol, json.loads(options)))


def filesystem(protocol: str, options: str):
    """The fsspec filesystem of `protocol` with these `options_json` (and `read_options`), made
    once per process (and `dmdask.store.read-seconds`)."""
    return _filesystem(protocol, options, float(dask.config.get("dmdask.store.read-seconds")))


def import_extra(module: str, requirement: str, reading: str):
    """`module`, or an ImportError saying that `reading` sources need the `formats` extra (or `requirement`)."""
    try:
        return importlib.import_module(module)
    except ImportError as exc:
        package = requirement.split(">")[0]
        raise ImportError(f"reading {reading} sources needs {package}: pip install 'dmdask[formats]' "
                          f"(or {requirement}) ({exc})") from exc


def string_dtype(what: str):
    """numpy's `StringDType`, or a `SourceError` saying that `what` needs numpy >= 2."""
    dtype = getattr(getattr(np, "dtypes", None), "StringDType", None)
    if dtype is None:
        raise SourceError(f"{what} need numpy >= 2 (numpy.dtypes.StringDType)")
    return dtype


def protocol_of(fs) -> str:
    """The protocol name a filesystem is made again with (`filesystem`)."""
    return fs.protocol if isinstance(fs.protocol, str) else fs.protocol[0]


def is_transient(exc: BaseException) -> bool:
    """Whether a store read that raised `exc` may succeed when tried again: a refused, reset or
    timed-out connection or an HTTP 5xx or 429 (as `exc` or in its `__cause__` chain); never
    a missing file (404), data that does not decode, a TLS certificate refused."""
    while exc is not None:
        if isinstance(exc, PERMANENT_ERRORS):
            return False
        if isinstance(exc, TRANSIENT_ERRORS) or getattr(exc, "errno", None) in TRANSIENT_ERRNOS:
            return True
        status = getattr(exc, "status", None)  # aiohttp.ClientResponseError (fsspec's HTTP)
        if isinstance(status, int) and (500 <= status < 600 or status == 429):
            return True
        exc = exc.__cause__
    return False


@runtime_checkable
class BlockReader(Protocol):
    """Reads one block from the shared store. Picklable and small.

    nbytes: the block's decoded size, or None when it is known only once read.
    row_granular: True when `read_rows` reads only the wanted samples from the store
    (one file per sample); False when the store's unit is the whole block (Zarr chunks).

    `read()` returns the whole block, one array per field; `read_rows(rows)` the given
    rows (offsets in the block), equal to `read()` indexed by `rows`. Both retry a
    transient store error for up to `dmdask.store.retry-seconds` (docs/architecture.md,
    "Transient store errors"), calling `on_retry(exc)` before each retry; then, or for
    any other error, they raise `BlockReadError` naming the URL and the samples.
    `prepare()` makes what the reads need ahead of the first (never raises). `sources()`:
    the URLs the reads read, which `dmdask.worker.allowed-sources` must allow.
    """

    key: str
    index: int
    start: int
    stop: int
    nbytes: int | None
    url: str
    row_granular: bool

    def read(self, on_retry: Callable | None = None) -> dict: ...

    def read_rows(self, rows, on_retry: Callable | None = None) -> dict: ...

    def prepare(self) -> None: ...

    def sources(self) -> list[str]: ...


class StoreReader(BlockReader):
    """A `BlockReader` whose subclass implements `_read` or `_read_rows` (or both), raising
    whatever the store raised; this adds the retries and errors. A subclass that reads
    through `filesystem(protocol, options)` sets those two attributes."""

    row_granular = False
    protocol: str | None = None
    options = "{}"
    rank_rows: tuple = ()  # rows the opening rank reads itself and gives the worker (`dmdask.client.first_batch`)
    claim: str | None = None  # the secret of what a process read itself and handed this block's worker:
    # those rows, or a transparent-mode block's bytes (`dmdask.worker.handover`)

    def __init__(self, url: str, identity: str, index: int, start: int, stop: int, nbytes: int | None):
        self.url, self.index, self.start, self.stop, self.nbytes = url, index, start, stop, nbytes
        self.key = block_key(identity, index)

    def read(self, on_retry: Callable | None = None) -> dict:
        return self._retrying(self._read, on_retry)

    def read_rows(self, rows, on_retry: Callable | None = None) -> dict:
        return self._retrying(lambda: self._read_rows(rows), on_retry)

    def sources(self) -> list[str]:
        """The URLs this reader reads (what `dmdask.worker.allowed-sources` must allow)."""
        return [self.url]

    def prepare(self) -> None:
        """Make the store's filesystem ahead of the first read; never raises (the read reports it)."""
        if self.protocol is not None:
            with contextlib.suppress(Exception):
                filesystem(self.protocol, self.options)

    def _read(self) -> dict:
        """Every row of the block: for readers whose unit is the row."""
        return self._read_rows(np.arange(self.stop - self.start))

    def _read_rows(self, rows) -> dict:
        """The whole block read, then indexed: for readers whose unit is the block."""
        return {field: values[rows] for field, values in self._read().items()}

    def _retrying(self, read: Callable[[], dict], on_retry: Callable | None) -> dict:
        budget = float(dask.config.get("dmdask.store.retry-seconds"))
        started = time.monotonic()
        wait, tries = FIRST_RETRY_WAIT, 1
        while True:
            try:
                return read()
            except BlockReadError:
                raise
            except Exception as exc:
                error = exc
            spent, transient = time.monotonic() - started, is_transient(error)
            if not transient or spent + wait > budget:
                detail = f" (after {tries} tries in {spent:.1f} s)" if tries > 1 or transient else ""
                # Raised outside the `except`: the store's exception (aiohttp's do not pickle)
                # must not travel with it; its type and text are in the message.
                raise BlockReadError(self.url, self.index, self.start, self.stop, error, detail)
            logger.warning("transient error reading block %d of %s, try %d, next in %.2f s: %s: %s",
                           self.index, redact(self.url), tries, wait, type(error).__name__, redact(str(error)))
            if on_retry is not None:
                on_retry(error)
            time.sleep(wait)
            wait, tries = min(2 * wait, LONGEST_RETRY_WAIT), tries + 1


@runtime_checkable
class Source(Protocol):
    """An opened dataset in the process that creates its blocks: `info` plus `reader(k)`,
    the reader of block k (0 <= k < info.num_blocks), made with no I/O."""

    info: DatasetInfo

    def reader(self, k: int) -> BlockReader: ...
