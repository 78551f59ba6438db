"""`Spec` and `Mix`: the frozen, validated description of what one rank reads."""
from __future__ import annotations

import dataclasses
import math
import os
from collections.abc import Mapping, Sequence
from typing import Any

import numpy as np

from .errors import SpecError
from .source.urls import resolve_local
from .transform import (Transform, TransformContext, dumps_transform, loads_transform, per_sample,
                        transform_context, using_context)

# the transform's names (dmdask.transform) are imported from here too
__all__ = ["Mix", "Spec", "Tokens", "Window", "Transform", "TransformContext", "as_int", "as_source", "dumps_transform",
           "loads_transform", "per_sample", "transform_context", "using_context"]


@dataclasses.dataclass(frozen=True)
class Spec:
    """What to read and how to cut it into batches, for one rank.

    Guarantees: a `Spec` is immutable and picklable, and every field is checked on
    construction (`SpecError`, a `ValueError`, names the field and the allowed range).
    Integer fields accept Python and numpy integers (stored as `int`), never bools or
    floats.

    source: a local path or any fsspec URL of a Zarr v3 group or array, Parquet, HDF5
        (`file.h5/group`), a Megatron indexed dataset (`.bin` + `.idx`, named by either file
        or by their common prefix), a class-per-subfolder folder of files or WebDataset tar
        shards (docs/quickstart.md, "Sources"); a `dmdask.Tokens` (a raw file of token ids);
        a list of URLs, kept as a tuple: WebDataset shards
        when all end in `.tar`, else one file per sample (opened without listing the store),
        both read in the list's order; or a `dmdask.Mix` of several sources.
    batch_size: samples per batch (>= 1).
    shuffle: a seeded permutation per epoch (True) or the stored order (False).
    seed: seed of the permutation; the same seed and epoch give the same order on
        any number of workers and ranks.
    rank, world_size: this rank and the number of ranks; each sample of an epoch
        goes to exactly one rank.
    drop_last: drop the tail so every rank gets the same number of full batches.
    shuffle_window: None shuffles all samples of the dataset together (an exact global
        permutation). An integer k permutes the blocks, then shuffles the samples of each
        run of k blocks together (docs/quickstart.md, "Shuffle window").
    keys: the arrays (Parquet columns, HDF5 datasets) of the source to read (None: all).
    transform: a picklable function `dict[str, ndarray] -> dict[str, ndarray]` applied to
        each batch on the workers, after the cache (see `per_sample` and `dmdask.images`).
    prefetch: at most this many batches requested or ready ahead of the consumer (>= 1);
        None (the default): 8, or more small batches where they hold under 16 MiB (asked
        up to 32 and about 8 MiB a request, two requests ahead: fewer requests per byte;
        of other hosts' workers, up to 32 MiB a request).
    block_size: samples per block for file folders and tar shards; for Zarr and HDF5,
        a multiple of the chunk length along the sample axis; for Parquet, rows whose
        multiples fall on row-group boundaries (None: one chunk, the smallest run of
        whole row groups, about 8 MiB of a contiguous HDF5 file, or 256 samples).
    storage_options: fsspec options.
    window: None (a sample is a row of the source), or a `Window`: a sample is that many
        consecutive rows of every field (token windows, time windows), its "index" the
        window's id; every guarantee for rows holds for windows.
    """

    source: str | Sequence[str] | Tokens | Mix
    batch_size: int
    shuffle: bool = True
    seed: int = 0
    rank: int = 0
    world_size: int = 1
    drop_last: bool = False
    shuffle_window: int | None = None
    keys: Sequence[str] | None = None
    transform: Transform | None = None
    prefetch: int | None = None
    block_size: int | None = None
    storage_options: Mapping[str, Any] | None = None
    window: Window | None = None

    def __post_init__(self):
        object.__setattr__(self, "source", as_source(self.source))
        if self.window is not None:
            if not isinstance(self.window, Window):
                raise SpecError("window", "None or a dmdask.Window(length, stride)", self.window)
            for name, value in (("transform", self.transform is not None),
                                ("shuffle_window", self.shuffle_window is not None)):
                if value:
                    raise SpecError("window", f"None with {name}= (windows with a transform or a shuffle window "
                                    "are not supported yet)", self.window)
        for name, low in (("batch_size", 1), ("seed", 0), ("world_size", 1), ("prefetch", 1),
                          ("shuffle_window", 1), ("block_size", 1)):
            if name in ("shuffle_window", "block_size", "prefetch") and getattr(self, name) is None:
                continue
            object.__setattr__(self, name, as_int(name, getattr(self, name), low=low))
        object.__setattr__(self, "rank", as_int("rank", self.rank, low=0, high=self.world_size - 1,
                                                hint=f"0 <= rank < world_size={self.world_size}"))
        for name in ("shuffle", "drop_last"):
            if not isinstance(getattr(self, name), bool):
                raise SpecError(name, "True or False", getattr(self, name))
        if self.keys is not None:
            if isinstance(self.keys, str) or not all(isinstance(k, str) for k in self.keys):
                raise SpecError("keys", "a list of array names, or None for all", self.keys)
            if len(self.keys) == 0 or "index" in self.keys:
                raise SpecError("keys", "a non-empty list without the reserved name 'index'", self.keys)
            object.__setattr__(self, "keys", tuple(self.keys))
        if isinstance(self.source, Mix) and self.keys is not None and "source" in self.keys:
            raise SpecError("keys", "names without 'source', which a mixture's batches use for the source "
                            "index", self.keys)
        if self.transform is not None:
            if not callable(self.transform):
                raise SpecError("transform", "a callable dict -> dict", self.transform)
            try:
                dumps_transform(self.transform)
            except Exception as exc:
                raise SpecError("transform", f"a picklable callable ({exc})", self.transform) from None
        if self.storage_options is not None and not isinstance(self.storage_options, Mapping):
            raise SpecError("storage_options", "a mapping of fsspec options", self.storage_options)

    def replace(self, **changes) -> "Spec":
        """A copy with some fields changed (validated again)."""
        return dataclasses.replace(self, **changes)


def _suggesting(init):
    """`Spec.__init__` whose TypeError for an unknown keyword names the nearest field."""
    import difflib
    import functools

    @functools.wraps(init)
    def __init__(self, *args, **kwargs):
        names = [f.name for f in dataclasses.fields(Spec)]
        for key in kwargs:
            if key not in names:
                near = difflib.get_close_matches(key, names, n=1, cutoff=0.6)
                hint = f"; did you mean {near[0]!r}?" if near else f"; the fields are {names}"
                raise TypeError(f"Spec() got an unexpected keyword argument {key!r}{hint}")
        init(self, *args, **kwargs)

    return __init__


Spec.__init__ = _suggesting(Spec.__init__)


def as_source(source):
    """`source` as a `str`, a list of shard or file URLs as a tuple of `str`, a `Mix` as it is;
    `SpecError` unless it is a non-empty path or URL, or a non-empty list of them. A
    relative local path is made absolute here, in the client's working directory."""
    allowed = ("a non-empty path or fsspec URL, or a non-empty list of shard or sample-file paths or URLs, "
               "a dmdask.Tokens or a dmdask.Mix")
    if isinstance(source, (Mix, Tokens)):
        return source
    if isinstance(source, (list, tuple)):
        urls = tuple(os.fspath(s) if isinstance(s, os.PathLike) else s for s in source)
        if not urls or not all(isinstance(s, str) and s for s in urls):
            raise SpecError("source", allowed, source)
        return tuple(resolve_local(s) for s in urls)
    if isinstance(source, os.PathLike):
        source = os.fspath(source)
    if not isinstance(source, str) or not source:
        raise SpecError("source", allowed, source)
    return resolve_local(source)


@dataclasses.dataclass(frozen=True)
class Tokens:
    """A raw file of token ids laid end to end, as `numpy.memmap(path, dtype)` would see it
    (nanoGPT's `train.bin`): `Spec(source=dmdask.Tokens("train.bin", "uint16"), ...)`.

    Each token is a sample (field "tokens"); with `Spec(window=dmdask.Window(seq_len + 1,
    seq_len))` a sample is a training sequence and its next token. Blocks are byte ranges of
    the file, each one ranged read (so any fsspec store that serves ranges works, HTTP
    included); `Spec.block_size` counts tokens (default: 8 MiB of them).

    path: a local path or fsspec URL of the file. dtype: the token ids' integer numpy dtype
        ("uint16", "uint32", or a `numpy.dtype`; byte order little-endian unless named,
        as "<u2" or ">u4"). Its size must be a whole number of tokens.
    """

    path: str
    dtype: Any

    def __post_init__(self):
        path = os.fspath(self.path) if isinstance(self.path, os.PathLike) else self.path
        if not isinstance(path, str) or not path:
            raise SpecError("source", "dmdask.Tokens(path, dtype) with a non-empty path or fsspec URL", self.path)
        object.__setattr__(self, "path", resolve_local(path))
        object.__setattr__(self, "dtype", token_dtype(self.dtype, "dtype"))


def token_dtype(dtype, name: str) -> str:
    """`dtype` as the string of an integer numpy dtype (little-endian unless it names an order:
    "uint16" -> "<u2"); `SpecError` naming `name` for anything else."""
    allowed = "an integer numpy dtype of token ids, such as 'uint16' or 'uint32'"
    try:
        parsed = np.dtype(dtype)
    except TypeError:
        raise SpecError(name, allowed, dtype) from None
    if isinstance(dtype, (bool, type(None))) or parsed.kind not in "iu":
        raise SpecError(name, allowed, dtype)
    if parsed.byteorder == "=":  # native: little-endian, as files are written on x86 and ARM
        parsed = parsed.newbyteorder("<")
    return parsed.str


@dataclasses.dataclass(frozen=True)
class Window:
    """A sample made of consecutive rows: `Spec(..., window=dmdask.Window(length, stride))`.

    Window w holds rows w*stride .. w*stride + length - 1 along the first axis of every
    field (a token array: `length` = sequence length + 1 and `stride` = sequence length;
    a (time, lat, lon) array: `length` time steps). Windows that would pass the last row
    are not made. A batch's fields have shape (batch, length, ...) and "index" holds the
    window ids; the order, the ranks' shares and resume work on window ids as on rows.

    length: rows a window (>= 1). stride: rows between window starts (>= 1; None:
        `length`, windows end to end). dim: for a Zarr group written by xarray (arrays
        that name their dimensions), the dimension the windows run along: the fields are
        the arrays whose first dimension it is, its coordinate included (times decoded
        from CF units to datetime64), so each window carries its own coordinates; None:
        every array (or `Spec.keys`), all of one length along their first axis.
    """

    length: int
    stride: int | None = None
    dim: str | None = None

    def __post_init__(self):
        object.__setattr__(self, "length", as_int("window", self.length, low=1, hint="a length >= 1"))
        stride = self.length if self.stride is None else self.stride
        object.__setattr__(self, "stride", as_int("window", stride, low=1, hint="a stride >= 1"))
        if self.dim is not None and (not isinstance(self.dim, str) or not self.dim):
            raise SpecError("window", "a Window whose dim is None or a dimension name such as 'time'", self)

    def count(self, rows: int) -> int:
        """How many windows `rows` rows hold."""
        return 0 if rows < self.length else (rows - self.length) // self.stride + 1

    def starts(self, windows: np.ndarray) -> np.ndarray:
        """The first row id of each of `windows` (int64)."""
        return np.asarray(windows, dtype=np.int64) * self.stride

    def rows(self, windows: np.ndarray) -> np.ndarray:
        """The row ids of `windows` (int64), window after window."""
        return self.rows_from(self.starts(windows))

    def rows_from(self, starts: np.ndarray) -> np.ndarray:
        """The row ids of the windows whose first rows are `starts`, window after window."""
        return (np.asarray(starts, dtype=np.int64)[:, None] + np.arange(self.length, dtype=np.int64)).ravel()

    def as_windows(self, batch: dict[str, np.ndarray], per_window=()) -> dict[str, np.ndarray]:
        """A batch of the rows of windows (`rows`, "index" the row ids) as windows: each
        field (n*length, ...) viewed as (n, length, ...), "index" the window ids, and the
        fields named in `per_window` (the same for a window's rows) one value a window."""
        windows = batch["index"][::self.length] // self.stride
        out = {name: values[::self.length] if name in per_window else
               values.reshape((len(windows), self.length) + values.shape[1:])
               for name, values in batch.items() if name != "index"}
        out["index"] = windows
        return out


@dataclasses.dataclass(frozen=True)
class Mix:
    """Several sources read as one weighted mixture: `Spec(source=dmdask.Mix(...), ...)`.

    Each batch then also holds "source" (int64: the position of each sample's source in
    `sources`), and "index" is the sample id within that source. What an epoch is (its
    rounds and passes): docs/quickstart.md, "Mixing sources"; docs/architecture.md.

    sources: a list of sources, each as `Spec.source` takes one (a path or URL, or a list
        of shard or sample-file URLs), or a `Spec` whose `source`, `keys`, `block_size` and
        `storage_options` are used (its other fields are not; it may have no transform).
        Plain sources take those three from the mixture's `Spec`. Every source must give
        the same fields with the same dtypes and sample shapes (`keys=` selects them).
    weights: non-negative numbers with a positive sum, one per source (a zero weight
        leaves its source out); None: in proportion to the sources' sizes, so that an
        epoch reads every sample of every source once.
    epoch_size: positions per epoch (>= 1); None: the sum of the sources' sizes.
    With `Spec(window=...)`, sizes, weights and `epoch_size` count windows.
    """

    sources: Sequence[Any]
    weights: Sequence[float] | None = None
    epoch_size: int | None = None

    def __post_init__(self):
        allowed = ("a non-empty list of sources: paths or URLs, lists of shard or file URLs, or Specs (of one source "
                   "each, without a transform)")
        if isinstance(self.sources, (str, os.PathLike, Mix, Spec)) or not isinstance(self.sources, Sequence) \
                or not len(self.sources):
            raise SpecError("source", allowed, self.sources)
        sources = []
        for source in self.sources:
            if isinstance(source, Spec):
                if isinstance(source.source, Mix) or source.transform is not None:
                    raise SpecError("source", allowed + "; a mixture inside a mixture, and a transform of one "
                                    "source, are not supported", source)
            elif isinstance(source, Mix):
                raise SpecError("source", allowed + "; a mixture inside a mixture is not supported", source)
            else:
                source = as_source(source)
            sources.append(source)
        object.__setattr__(self, "sources", tuple(sources))
        if self.weights is not None:
            object.__setattr__(self, "weights", _as_weights(self.weights, len(sources)))
        if self.epoch_size is not None:
            object.__setattr__(self, "epoch_size", as_int("epoch_size", self.epoch_size, low=1))

    def specs(self, spec: "Spec") -> list:
        """One `Spec` per source, for the mixture `spec`: its own fields with the source's
        (and, for a `Spec` source, its keys, block size and storage options); no transform."""
        out = []
        for source in self.sources:
            if isinstance(source, Spec):
                out.append(spec.replace(source=source.source, keys=source.keys, block_size=source.block_size,
                                        storage_options=source.storage_options, transform=None))
            else:
                out.append(spec.replace(source=source, transform=None))
        return out


def _as_weights(weights, count: int) -> tuple:
    """`weights` as a tuple of Python numbers; `SpecError` unless there are `count`
    finite non-negative ones with a positive sum."""
    allowed = f"{count} finite numbers >= 0 (one per source) with a positive sum"
    if isinstance(weights, (str, bytes, Mapping)) or not isinstance(weights, (Sequence, np.ndarray)):
        raise SpecError("weights", allowed, weights)
    out = []
    for w in weights:
        if isinstance(w, (bool, np.bool_)) or not isinstance(w, (int, float, np.integer, np.floating)):
            raise SpecError("weights", allowed, list(weights))
        w = int(w) if isinstance(w, (int, np.integer)) else float(w)
        if not math.isfinite(w) or w < 0:
            raise SpecError("weights", allowed, list(weights))
        out.append(w)
    if len(out) != count or sum(out) <= 0:
        raise SpecError("weights", allowed, list(weights))
    return tuple(out)


def as_int(name: str, value, low: int, high: int | None = None, hint: str = "") -> int:
    """`value` as an `int` when it is a Python or numpy integer in low..high; otherwise
    `SpecError` naming `name` (bools and floats are refused, even integral ones)."""
    if isinstance(value, (bool, np.bool_)) or not isinstance(value, (int, np.integer)) or value < low \
            or (high is not None and value > high):
        raise SpecError(name, hint or f"an integer >= {low}", value)
    return int(value)
