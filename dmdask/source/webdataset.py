"""WebDataset tar shards: each sample is the run of a shard's members that share a key
(`dir/abc.seg.jpg` is field `seg.jpg` of sample `dir/abc`). Opening reads the tar headers,
never member data; the index of the members travels with the block readers, not in
`DatasetInfo` (docs/formats/webdataset.md)."""
from __future__ import annotations

import re
import tarfile
from collections.abc import Sequence
from concurrent.futures import ThreadPoolExecutor

import numpy as np

from ..errors import SourceError, SourceNotFoundError, SpecError
from .base import DatasetInfo, Source, StoreReader, filesystem, options_json, protocol_of, string_dtype
from .registry import Format, Place

DEFAULT_SAMPLES_PER_BLOCK = 256
KEY = "__key__"
OPEN_THREADS = 16  # shards indexed at once
TAR_BLOCK = 512
META = re.compile(r"__[^/]*__($|/)")  # WebDataset's metadata members, skipped

Sample = tuple[str, dict[str, tuple[int, int]]]  # key, {extension: (offset, size)}


def tar_files(entries: Sequence[dict]) -> list[str]:
    """The `.tar` files of a folder listing (`fs.ls(path, detail=True)`), sorted by name."""
    return sorted(e["name"] for e in entries if e["type"] == "file" and e["name"].endswith(".tar"))


def split_name(name: str) -> tuple[str, str] | None:
    """(key, extension) of a member name by WebDataset's convention; None for a name it skips."""
    if META.match(name):
        return None
    folder = name[:name.rfind("/") + 1]
    stem, dot, ext = name[len(folder):].partition(".")
    if not stem or not dot or not ext:
        return None
    return folder + stem, ext.lower()


def index_shard(fs, path: str, url: str) -> tuple[int, list[Sample]]:
    """(size, samples) of one shard, from its tar headers. `SourceNotFoundError` if it cannot be
    reached, `SourceError` if it is not a tar file, is truncated, or a sample has an extension twice."""
    try:
        size = fs.size(path)
    except Exception as exc:
        cause = exc  # fsspec's HTTP answers FileNotFoundError for any failure, the real one as its cause
        while isinstance(cause, FileNotFoundError) and cause.__cause__ is not None:
            cause = cause.__cause__
        if isinstance(cause, FileNotFoundError) or getattr(cause, "status", None) == 404:
            raise SourceNotFoundError(f"WebDataset shard {url} does not exist") from None
        raise SourceNotFoundError(f"cannot reach WebDataset shard {url}: {type(cause).__name__}: {cause}") from exc
    if size is None:
        raise SourceError(f"the store gives no size for WebDataset shard {url}: it must answer with Content-Length")
    samples: list[Sample] = []
    end = 0  # where the header after the last member read starts
    try:
        with fs.open(path, "rb", block_size=TAR_BLOCK, cache_type="readahead", size=size) as f:
            with tarfile.open(fileobj=f, mode="r:") as tar:
                for info in tar:
                    end = info.offset_data + -(-info.size // TAR_BLOCK) * TAR_BLOCK
                    split = split_name(info.name) if info.isreg() else None
                    if split is not None and (not samples or samples[-1][0] != split[0]):
                        samples.append((split[0], {}))
                    if info.offset_data + info.size > size:
                        sample = f" (sample {split[0]!r}, the shard's sample {len(samples) - 1})" if split else ""
                        raise SourceError(f"WebDataset shard {url} is truncated: its member {info.name}{sample} "
                                          f"needs bytes up to {info.offset_data + info.size} but the shard has {size}")
                    if split is None:
                        continue
                    key, ext = split
                    if ext in samples[-1][1]:
                        raise SourceError(f"WebDataset shard {url}: sample {key!r} has two members with "
                                          f"extension {ext!r} (the second is {info.name})")
                    samples[-1][1][ext] = (info.offset_data, info.size)
            if end < size:  # what follows the last member must be the end-of-archive zeros
                f.seek(end)
                trailer = f.read(TAR_BLOCK)
                if len(trailer) < TAR_BLOCK or any(trailer):
                    raise SourceError(
                        f"WebDataset shard {url} is truncated or damaged: it ends inside a tar header, or holds "
                        f"an unreadable one, at byte {end} of {size} (after {len(samples)} samples)")
    except tarfile.TarError as exc:
        raise SourceError(f"WebDataset shard {url} is not a readable tar file: {exc}") from None
    except (SourceError, SourceNotFoundError):
        raise
    except Exception as exc:
        raise SourceNotFoundError(f"cannot read WebDataset shard {url}: {type(exc).__name__}: {exc}") from exc
    return size, samples


class WebDatasetSource(Source):
    def __init__(self, info: DatasetInfo, protocol: str, options: str, urls: list[str], paths: list[str],
                 exts: tuple[str, ...], shard: np.ndarray, offsets: np.ndarray, sizes: np.ndarray, keys: np.ndarray):
        self.info, self.protocol, self.options = info, protocol, options
        self.urls, self.paths, self.exts = urls, paths, exts
        self.shard, self.offsets, self.sizes, self.keys = shard, offsets, sizes, keys

    def reader(self, k: int) -> TarBlockReader:
        a, b = self.info.block_range(k)
        used, local = np.unique(self.shard[a:b], return_inverse=True)
        return TarBlockReader(
            [self.urls[s] for s in used], self.protocol, self.options, [self.paths[s] for s in used], self.exts,
            local.astype(np.int32), self.offsets[a:b], self.sizes[a:b], self.keys[a:b], self.info.identity, k, a, b,
            block_nbytes(self.sizes[a:b]))


def block_nbytes(sizes: np.ndarray) -> int:
    """Bytes a run of samples takes in memory: the members, an object pointer per member, and
    a 16-byte `StringDType` entry per key."""
    n, fields = sizes.shape
    return int(sizes.sum()) + 8 * n * fields + 16 * n


def open_webdataset(place: Place) -> WebDatasetSource:
    """Index the tar headers of the shards the spec names, or of a folder's `.tar` files, and
    describe the blocks. Raises as the table in docs/formats/webdataset.md#errors says."""
    spec = place.spec
    if place.shards is not None:
        (fs, paths), urls = place.listed_paths("shards"), place.shards
        label = place.label("shards")
    else:
        if any(e["type"] == "directory" for e in place.listing):
            raise SourceError(
                f"{place.url} holds both .tar files and subfolders: is it WebDataset shards or a folder of class "
                "subfolders? Pass the shards as a brace pattern or a list of URLs, or move the .tar files away")
        fs, paths, label = place.fs, tar_files(place.listing), place.url
        urls = [f"{label}/{t.rstrip('/').rsplit('/', 1)[-1]}" for t in paths]
    string = string_dtype(f"the {KEY} fields (StringDType arrays) of WebDataset shards {label}")
    with ThreadPoolExecutor(min(OPEN_THREADS, len(urls))) as pool:
        indexed = list(pool.map(lambda up: index_shard(fs, up[1], up[0]), zip(urls, paths)))
    present = sorted({ext for _, samples in indexed for _, members in samples for ext in members})
    if not present:
        raise SourceError(f"dataset {label} has no samples: its WebDataset shards hold no members named "
                          "key.extension")
    exts = tuple(sorted({k for k in spec.keys or present if k != KEY}))
    if any(e not in present for e in exts) or (spec.keys is not None and not exts):
        raise SpecError("keys", f"extensions among {present} of the shards {label}", list(spec.keys))
    if "index" in exts:
        raise SourceError(f"WebDataset shards {label} have members with extension 'index', a reserved field "
                          "name: pass Spec(keys=[...]) without it")
    for url, (_, samples) in zip(urls, indexed):
        for i, (key, members) in enumerate(samples):
            missing = [e for e in exts if e not in members]
            if missing:
                raise SourceError(
                    f"WebDataset shard {url}: sample {key!r} (the shard's sample {i}) has no member "
                    f"{key}.{missing[0]}, and lacks {missing} of the fields {list(exts)} that other samples have; "
                    "pass Spec(keys=[...]) naming extensions every sample has")
    n = sum(len(samples) for _, samples in indexed)
    shard = np.repeat(np.arange(len(urls), dtype=np.int32), [len(samples) for _, samples in indexed])
    where = np.array([[members[e] for e in exts] for _, samples in indexed for _, members in samples],
                     dtype=np.int64).reshape(n, len(exts), 2)
    keys = np.array([key for _, samples in indexed for key, _ in samples], dtype=string())
    offsets, sizes = np.ascontiguousarray(where[..., 0]), np.ascontiguousarray(where[..., 1])
    block_len = spec.block_size or DEFAULT_SAMPLES_PER_BLOCK
    identity = place.identity("webdataset", urls, [size for size, _ in indexed], exts, block_len, shard, offsets,
                              sizes, keys.tolist())
    info = DatasetInfo(name=place.name, identity=identity, url=label, fields=tuple(sorted(exts + (KEY,))),
                       num_samples=n, block_len=block_len, nbytes=block_nbytes(sizes))
    return WebDatasetSource(info, protocol_of(fs), options_json(place.options), list(urls), list(paths), exts, shard,
                            offsets, sizes, keys)


class TarBlockReader(StoreReader):
    """Reads the members of one block's samples, all of them or only some (row-granular).
    `url`: the block's shard URLs joined by ", "."""

    row_granular = True

    def __init__(self, urls, protocol, options, paths, exts, shard, offsets, sizes, keys, identity, index, start,
                 stop, nbytes):
        super().__init__(", ".join(urls), identity, index, start, stop, nbytes)
        self.urls, self.protocol, self.options, self.paths, self.exts = list(urls), protocol, options, list(paths), exts
        self.shard, self.offsets, self.sizes, self.keys = shard, offsets, sizes, keys

    def sources(self) -> list[str]:
        return self.urls

    def _read_rows(self, rows) -> dict[str, np.ndarray]:
        """The given rows: a range request per non-empty member, all at once; an error names the
        shard, sample and member."""
        rows = np.asarray(rows, dtype=np.int64)
        wanted = [(r, j) for r in rows.tolist() for j in range(len(self.exts)) if self.sizes[r, j]]
        starts = [int(self.offsets[r, j]) for r, j in wanted]
        ends = [s + int(self.sizes[r, j]) for s, (r, j) in zip(starts, wanted)]
        paths = [self.paths[self.shard[r]] for r, _ in wanted]
        contents = iter(filesystem(self.protocol, self.options).cat_ranges(paths, starts, ends, on_error="return")
                        if wanted else [])
        arrays = {ext: np.empty(len(rows), dtype=object) for ext in self.exts}
        for i, r in enumerate(rows.tolist()):
            for j, ext in enumerate(self.exts):
                start = int(self.offsets[r, j])
                end = start + int(self.sizes[r, j])
                content = next(contents) if end > start else b""
                if isinstance(content, BaseException) or len(content) != end - start:
                    raise self._member_error(r, j, content, start, end)
                arrays[ext][i] = np.frombuffer(content, dtype=np.uint8)
        arrays[KEY] = self.keys[rows]
        return arrays

    def _member_error(self, row: int, j: int, content, start: int, end: int) -> OSError:
        key = str(self.keys[row])
        where = (f"WebDataset shard {self.urls[self.shard[row]]}, sample {self.start + row} ({key!r}), "
                 f"member {key}.{self.exts[j]} (bytes {start}..{end - 1})")
        if isinstance(content, BaseException):
            error = OSError(f"{where}: {type(content).__name__}: {content}")
            error.__cause__ = content  # kept for `is_transient` (a 503 is retried)
            return error
        return OSError(f"{where}: the shard returned {len(content)} bytes; it was truncated or changed since "
                       "it was opened (release the dataset after changing it)")


FORMAT = Format("webdataset", open=open_webdataset,
                claims=lambda place: place.shards is not None or bool(tar_files(place.listing)))
