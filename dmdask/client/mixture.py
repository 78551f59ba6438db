"""A weighted mixture of datasets (`dmdask.Mix`) as one dataset (`MixedInfo`), so the
iterator plans, fetches and deals it with the code of a single dataset; each source stays
a dataset of its own in the cluster.
"""
from __future__ import annotations

from collections.abc import Callable, Sequence

import numpy as np
from dask.base import tokenize

from ..errors import SpecError
from ..plan.mix import MixOrder, apportion
from ..shm.memory import empty_batch
from ..source import DatasetInfo
from ..spec import Mix
from .arenas import LocalArenas, split_batches

SOURCE_FIELD = "source"  # the batch field that holds each row's source index
_matching: set = set()  # (identity, fields) of mixtures whose sources' rows were found to match


class MixedInfo:
    """The sources of a mixture as one dataset of global ids (the source's offset + its sample
    id). `counts`: each source's draws per epoch; `identity`: what a resume state must share.
    With a `window` (`dmdask.Window`), what is drawn is a source's windows (`draws`: their
    global ids, `window_rows` their rows), and epochs and weights count windows."""

    def __init__(self, mix: Mix, sources: Sequence[DatasetInfo], window=None):
        self.mix, self.window = mix, window
        self.sources = tuple(sources)
        identities = [s.identity for s in self.sources]
        if len(set(identities)) < len(identities):
            twice = next(s.url for s in self.sources if identities.count(s.identity) > 1)
            raise SpecError("source", f"each source once in a mixture ({twice} is there twice, with the same keys, "
                            "block_size and storage_options): give it a larger weight instead", mix)
        self.sizes = [s.num_samples for s in self.sources]
        self.fields = _common_fields(self.sources)
        self.draws = self.sizes if window is None else [window.count(n) for n in self.sizes]  # per source
        if not all(self.draws):
            short = self.sources[self.draws.index(0)]
            raise SpecError("window", f"a length of at most the {short.num_samples} rows of {short.url}", window)
        self.epoch_size = mix.epoch_size or sum(self.draws)
        self.counts = apportion(self.epoch_size, mix.weights if mix.weights is not None else self.draws)
        self.offsets = np.cumsum([0] + self.sizes).astype(np.int64)
        self._draw_offsets = np.cumsum([0] + self.draws).astype(np.int64)
        self.block_offsets = np.cumsum([0] + [s.num_blocks for s in self.sources]).astype(np.int64)
        self._block_lens = np.array([s.block_len for s in self.sources], dtype=np.int64)
        self.identity = "mix-" + tokenize([s.identity for s in self.sources], self.counts)[:16]
        self.name = self.identity
        self.url = " + ".join(s.url for s in self.sources)
        self.num_samples = int(self.offsets[-1])  # of the global ids, not the positions of an epoch
        self.num_blocks = int(self.block_offsets[-1])
        sizes = [s.nbytes for s in self.sources]
        self.nbytes = None if any(n is None for n in sizes) else sum(sizes)

    def order(self, *, shuffle: bool, seed: int, epoch: int, shuffle_window=None) -> MixOrder:
        stride = 1 if self.window is None else self.window.stride  # a block's draws, about
        return MixOrder(self.draws, self.counts, [max(1, s.block_len // stride) for s in self.sources],
                        shuffle=shuffle, seed=seed, epoch=epoch, shuffle_window=shuffle_window)

    def window_split(self, ids: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
        """(source index, window id in that source) of global window ids."""
        ids = np.asarray(ids, dtype=np.int64)
        sources = np.searchsorted(self._draw_offsets, ids, side="right") - 1
        return sources, ids - self._draw_offsets[sources]

    def window_starts(self, ids: np.ndarray) -> np.ndarray:
        """The global row id of the first row of each window with global id in `ids`."""
        sources, windows = self.window_split(ids)
        return self.window.starts(windows) + self.offsets[sources]

    def split(self, ids: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
        """(source index, sample id in that source) of global ids."""
        ids = np.asarray(ids, dtype=np.int64)
        sources = np.searchsorted(self.offsets, ids, side="right") - 1
        return sources, ids - self.offsets[sources]

    def locate(self, ids: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
        """(global block number, row in that block) of global ids."""
        sources, local = self.split(ids)
        blocks = local // self._block_lens[sources]
        return blocks + self.block_offsets[sources], local - blocks * self._block_lens[sources]

    def block_key(self, k: int) -> str:
        source = int(np.searchsorted(self.block_offsets, k, side="right") - 1)
        return self.sources[source].block_key(k - int(self.block_offsets[source]))

    def block_keys(self, blocks: np.ndarray) -> list[str]:
        """`block_key` of each block number, a source at a time."""
        blocks = np.asarray(blocks, dtype=np.int64)
        sources = np.searchsorted(self.block_offsets, blocks, side="right") - 1
        keys = np.empty(len(blocks), dtype=object)
        for source in np.unique(sources).tolist():
            mine = sources == source
            keys[mine] = self.sources[source].block_keys(blocks[mine] - self.block_offsets[source])
        return keys.tolist()

    def batch_fields(self, ids: np.ndarray) -> tuple[np.ndarray, dict[str, np.ndarray]]:
        """A group's "index" (ids in their sources) and extra fields ("source") from its global ids."""
        sources, index = self.split(ids)
        return index, {SOURCE_FIELD: sources}


def _common_fields(sources: Sequence[DatasetInfo]) -> tuple[str, ...]:
    """The fields every source gives (the first's order); `SpecError` unless all give the same, none "source"."""
    first = sources[0].fields
    if SOURCE_FIELD in first:
        raise SpecError("keys", f"fields without {SOURCE_FIELD!r}, the batch field of a mixture that tells each "
                        f"row's source: {sources[0].url} has a field of that name; choose the others with "
                        "keys=[...]", list(first))
    for other in sources[1:]:
        if set(other.fields) != set(first):
            raise SpecError("keys", "the same fields in every source of a mixture (choose common ones with keys="
                            f"[...]): {sources[0].url} has {sorted(first)}, {other.url} has {sorted(other.fields)}",
                            None)
    return tuple(first)


def check_fields_match(mix: MixedInfo, first_rows: Callable[[], list[dict[str, np.ndarray] | None]]) -> None:
    """`SpecError` unless the sources drawn match in every field's dtype and sample shape; once
    per process and mixture. From the sources' metadata (`DatasetInfo.field_types`) when every
    source drawn declares it, with no wait; else from their first rows (`first_rows()`, None
    for the sources not drawn), once each has its first block."""
    if (mix.identity, mix.fields) in _matching:
        return
    drawn = [i for i, count in enumerate(mix.counts) if count]
    if all(mix.sources[i].field_types is not None for i in drawn):
        types = [{name: (np.dtype(dtype), tuple(shape)) for name, dtype, shape in mix.sources[i].field_types}
                 for i in drawn]
    else:
        rows = first_rows()
        types = [{name: (rows[i][name].dtype, rows[i][name].shape[1:]) for name in mix.fields} for i in drawn]
    first_info, first = mix.sources[drawn[0]], types[0]
    for i, other in zip(drawn[1:], types[1:]):
        for name in mix.fields:
            (a, a_shape), (b, b_shape) = first[name], other[name]
            if a != b or a_shape != b_shape:
                raise SpecError("source", f"sources whose fields match: field {name!r} is {a} of sample "
                                f"shape {a_shape} in {first_info.url} but {b} of sample shape "
                                f"{b_shape} in {mix.sources[i].url} (cast or reshape it in a source of its own, "
                                "or leave it out with keys=[...])", mix.mix)
    _matching.add((mix.identity, mix.fields))


def take_mixed(mix: MixedInfo, arenas: list[LocalArenas], group: list[np.ndarray], count) -> list[dict]:
    """The warm path of a mixture: each source's rows from its arenas (`LocalArenas.take`,
    `Moved` likewise), put together in the group's order."""
    ids = np.concatenate(group)
    index, extra = mix.batch_fields(ids)
    sources = extra[SOURCE_FIELD]
    parts = []
    for source in np.unique(sources).tolist():
        chosen = np.flatnonzero(sources == source)
        parts.append((chosen, arenas[source].take([index[chosen]], count)[0]))
    first = parts[0][1]
    layout = tuple((name, first[name].dtype.str, first[name].shape[1:]) for name in mix.fields)
    out = empty_batch(layout, len(ids))
    for chosen, part in parts:
        for name in mix.fields:
            out[name][chosen] = part[name]
    out.update(extra)
    return split_batches(out, index, [len(b) for b in group])


def take_mixed_windows(mix: MixedInfo, arenas: list[LocalArenas], ids: np.ndarray, count) -> tuple:
    """The same-host path of a windowed mixture: windows with global ids `ids`, each source's
    taken a window at a time from its arenas (`LocalArenas.take_windows`, `Moved` likewise)
    into one set of arrays, in `ids`' order; (those arrays, each window's id in its source,
    its source)."""
    sources, windows = mix.window_split(ids)
    out = None
    for source in np.unique(sources).tolist():
        chosen = np.flatnonzero(sources == source)
        part = arenas[source].take_windows(mix.window.starts(windows[chosen]), mix.window.length, count)
        if len(chosen) == len(ids):
            return part, windows, sources
        if out is None:
            out = {name: np.empty((len(ids),) + values.shape[1:], values.dtype) for name, values in part.items()}
        for name, values in part.items():
            out[name][chosen] = values
    return out, windows, sources
