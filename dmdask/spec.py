"""`Spec` and `Mix`: the frozen, validated description of what one rank reads."""
from __future__ import annotations

import dataclasses
import math
import os
from typing import Any, Mapping, Optional, Sequence, Union

import numpy as np

from .errors import SpecError
from .source.urls import resolve_local
from .transform import (Transform, TransformContext, dumps_transform, loads_transform, per_sample,
                        transform_context, using_context)

# the transform's names (dmdask.transform) are imported from here too
__all__ = ["Mix", "Spec", "Transform", "TransformContext", "as_int", "as_source", "dumps_transform",
           "loads_transform", "per_sample", "transform_context", "using_context"]


@dataclasses.dataclass(frozen=True)
class Spec:
    """What to read and how to cut it into batches, for one rank.

    Guarantees: a `Spec` is immutable and picklable, and every field is checked on
    construction (`SpecError`, a `ValueError`, names the field and the allowed range).
    Integer fields accept Python and numpy integers (stored as `int`), never bools or
    floats.

    source: a Zarr v3 group or array, a Parquet file, folder of Parquet files or
        glob, an HDF5 file or a group in it (`file.h5/group`), a folder of per-sample
        files in class-per-subfolder layout, or WebDataset tar shards (a folder of
        `.tar` files, a `.tar` URL, or a brace pattern such as
        `train-{000000..000099}.tar`); a local path or any fsspec URL. A list of shard
        URLs (paths or URLs) is kept as a tuple and read as WebDataset shards in that order.
        A `dmdask.Mix` of several sources reads them as one weighted mixture.
    batch_size: samples per batch (>= 1).
    shuffle: a seeded permutation per epoch (True) or the stored order (False).
    seed: seed of the permutation; the same seed and epoch give the same order on
        any number of workers and ranks.
    rank, world_size: this rank and the number of ranks; each sample of an epoch
        goes to exactly one rank.
    drop_last: drop the tail so every rank gets the same number of full batches.
    shuffle_window: None shuffles all samples of the dataset together (an exact
        global permutation, `dmdask.plan.order`). An integer k permutes the blocks,
        then shuffles the samples of each run of k blocks together: blocks beyond
        the cluster cache are then wanted a window at a time, so they leave the
        shared store once per epoch as long as the workers' stream buffers hold a
        window's streamed blocks and the ranks move through the epoch together.
    keys: the arrays (Parquet columns, HDF5 datasets) of the source to read (None: all).
    transform: a picklable function `dict[str, ndarray] -> dict[str, ndarray]`
        applied to each batch on the workers, after the cache (see `per_sample`,
        and `dmdask.images` for ready image transforms). While it runs,
        `dmdask.transform_context()` gives the batch's epoch and this spec's seed.
    prefetch: batches in flight ahead of the consumer (>= 1).
    block_size: samples per block for file folders and tar shards; for Zarr and HDF5,
        a multiple of the chunk length along the sample axis; for Parquet, rows whose
        multiples fall on row-group boundaries (None: one chunk, the smallest run of
        whole row groups, about 8 MiB of a contiguous HDF5 file, or 256 samples).
    storage_options: passed to fsspec when opening the source.
    """

    source: Union[str, Sequence[str], "Mix"]
    batch_size: int
    shuffle: bool = True
    seed: int = 0
    rank: int = 0
    world_size: int = 1
    drop_last: bool = False
    shuffle_window: Optional[int] = None
    keys: Optional[Sequence[str]] = None
    transform: Optional[Transform] = None
    prefetch: int = 8
    block_size: Optional[int] = None
    storage_options: Optional[Mapping[str, Any]] = None

    def __post_init__(self):
        object.__setattr__(self, "source", as_source(self.source))
        for name, low in (("batch_size", 1), ("seed", 0), ("world_size", 1), ("prefetch", 1),
                          ("shuffle_window", 1), ("block_size", 1)):
            if name in ("shuffle_window", "block_size") and getattr(self, name) is None:
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
    """`Spec.__init__` that names the nearest field of a misspelt keyword (`batchsize`
    -> `batch_size`) in the TypeError Python raises for it."""
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
    """`source` as a `str`, or a list of shard URLs as a tuple of `str` (path-like
    objects become strings), or a `Mix` as it is; `SpecError` unless it is a non-empty
    path or URL, or a non-empty list of them. A relative local path is made absolute
    here, in the client's working directory (workers run in their own)."""
    allowed = "a non-empty path or fsspec URL, or a non-empty list of shard paths or URLs, or a dmdask.Mix"
    if isinstance(source, Mix):
        return source
    if isinstance(source, (list, tuple)):
        shards = tuple(os.fspath(s) if isinstance(s, os.PathLike) else s for s in source)
        if not shards or not all(isinstance(s, str) and s for s in shards):
            raise SpecError("source", allowed, source)
        return tuple(resolve_local(s) for s in shards)
    if isinstance(source, os.PathLike):
        source = os.fspath(source)
    if not isinstance(source, str) or not source:
        raise SpecError("source", allowed, source)
    return resolve_local(source)


@dataclasses.dataclass(frozen=True)
class Mix:
    """Several sources read as one weighted mixture: `Spec(source=dmdask.Mix(...), ...)`.

        spec = dmdask.Spec(source=dmdask.Mix(["/data/web.zarr", "/data/books.zarr"], weights=[0.7, 0.3]),
                           batch_size=256)

    Each batch then also holds "source" (int64: the position of each sample's source in
    `sources`), and "index" is the sample id within that source. What an epoch is:

    - it has `epoch_size` positions (default: the sum of the sources' sizes), and source
      i takes exactly `epoch_size * weights[i] / sum(weights)` of them (rounded by
      largest remainder; default weights: the sources' sizes, which makes an epoch one
      pass over every source, shuffled together);
    - the positions of a source are spread evenly over the epoch: rounds of fewer than
      64 positions (with up to 32 sources) each hold every source's share to within one,
      placed at random within the round (`Spec.shuffle`; without it, the sources in
      list order);
    - a source is read in passes: each pass is a permutation of all its samples (from
      the seed, the pass and the source), so within a pass no sample repeats; passes go
      on from one epoch to the next (a source drawn less than its size per epoch is
      covered over several epochs, one drawn more starts new passes within an epoch);
    - the positions are dealt to the ranks as those of a single source (exactly once
      over the ranks, `resume=` and elastic resume alike).

    sources: a list of sources, each as `Spec.source` takes one (a path or URL, or a list
        of WebDataset shard URLs), or a `Spec` whose `source`, `keys`, `block_size` and
        `storage_options` are used (its other fields are not; it may have no transform).
        Plain sources take those three from the mixture's `Spec`. Every source must give
        the same fields with the same dtypes and sample shapes (`keys=` selects them).
        Each source is a dataset of its own in the cluster: cached, shared with any
        other job that reads it, and released (`dmdask.release`) as one.
    weights: non-negative numbers with a positive sum, one per source (a zero weight
        leaves its source out); None: in proportion to the sources' sizes, so that an
        epoch reads every sample of every source once, as dmdask's epochs of one source
        do (tf.data and Grain default to equal weights instead: pass `[1] * len(sources)`).
    epoch_size: positions per epoch (>= 1); None: the sum of the sources' sizes.
    """

    sources: Sequence[Any]
    weights: Optional[Sequence[float]] = None
    epoch_size: Optional[int] = None

    def __post_init__(self):
        allowed = ("a non-empty list of sources: paths or URLs, lists of shard URLs, or Specs (of one source "
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


def as_int(name: str, value, low: int, high: Optional[int] = None, hint: str = "") -> int:
    """`value` as an `int` when it is a Python or numpy integer in low..high; otherwise
    `SpecError` naming `name` (bools and floats are refused, even integral ones)."""
    if isinstance(value, (bool, np.bool_)) or not isinstance(value, (int, np.integer)) or value < low \
            or (high is not None and value > high):
        raise SpecError(name, hint or f"an integer >= {low}", value)
    return int(value)
