"""The warm path (docs/architecture.md section 3, step 6): rows of blocks in arenas on this
host taken with no request, one `np.take` per field over a `Window`, into pooled memory.
A block released, moved or whose slot was reused while mapped raises `Moved` (the row
labels are checked after the copy), never rows of another block; nothing here writes to a
worker's files.
"""
from __future__ import annotations

import os
import threading

import numpy as np

from ..protocol.worker import Moved
from ..shm.arena import ID_FIELD
from ..shm.memory import empty_batch
from ..shm.window import MAX_ARENAS, Window


class LocalArenas:
    """Per process and dataset (`of`): the blocks in arenas on this host, as `Gatherer` finds them. Thread-safe."""

    _of: dict[str, tuple[str, LocalArenas]] = {}  # dataset name -> (identity, its arenas)
    _registry = threading.Lock()

    @classmethod
    def of(cls, info) -> LocalArenas:
        """The arenas of the dataset `info` (a `DatasetInfo`); new ones when its data changed."""
        with cls._registry:
            identity, found = cls._of.get(info.name, (None, None))
            if identity != info.identity or (found.num_samples, found.block_len) != (info.num_samples, info.block_len):
                found = cls(info.num_samples, info.block_len)
                cls._of[info.name] = (info.identity, found)
        return found

    @classmethod
    def knows_dataset(cls, name: str) -> bool:
        """Whether every block of the dataset `name` was in a known arena when last looked at."""
        with cls._registry:
            found = cls._of.get(name)
        return found is not None and found[1].knows(np.arange(len(found[1].arena_of)))

    def __init__(self, num_samples: int, block_len: int):
        self.num_samples, self.block_len = num_samples, block_len
        num_blocks = -(-num_samples // block_len)
        self._lock = threading.Lock()
        self.arena_of = np.full(num_blocks, -1, dtype=np.int32)  # block -> index into self.arenas
        self.first_row = np.zeros(num_blocks, dtype=np.int64)  # block -> its first row in that arena
        self.arenas: list[tuple[str, dict]] = []  # (holder, arena fields)
        self._index: dict[tuple[str, str], int] = {}
        self._windows: dict[str, Window] | None = None  # field -> its window; {} when none can be made
        self._data_row_bytes = 0  # a row's bytes, its label not counted (`_row_bytes`, once the windows are open)
        self._slices: dict[tuple[str, int], np.ndarray] = {}  # (field, length) -> its window's rows as slices

    def knows(self, blocks: np.ndarray) -> bool:
        """Whether every block is in a known arena (`take` applies)."""
        return bool(self.arenas) and bool(len(blocks)) and bool((self.arena_of[blocks] >= 0).all())

    def remember(self, holder: str, fields: dict, blocks, first_rows) -> None:
        """Blocks `blocks` are in `holder`'s arena `fields` (`ArenaBlock.describe`), each from
        its row in `first_rows`; ignored if unmappable, as are indices beyond this dataset's blocks."""
        blocks, first_rows = np.asarray(blocks, dtype=np.int64), np.asarray(first_rows, dtype=np.int64)
        ours = (blocks >= 0) & (blocks < len(self.arena_of))
        blocks, first_rows = blocks[ours], first_rows[ours]
        if not len(blocks):
            return
        sizes = np.minimum(self.block_len, self.num_samples - blocks * self.block_len)
        rows = int((first_rows + sizes).max())
        ident = (holder, fields[ID_FIELD][0])
        with self._lock:
            if self._windows is None:
                self._windows = self._open_windows(fields)
                self._data_row_bytes = self._row_bytes() if self._windows else 0
            arena = self._index.get(ident, len(self.arenas))
            if not self._windows or arena >= MAX_ARENAS:
                return
            # the labels faulted in ahead only where the worker backs them by huge pages (`Arena`): else
            # a page-table entry a 4 KiB page, for labels a take reads a few of (`take_windows`)
            data_bytes = self._row_bytes()
            try:
                for name, window in self._windows.items():
                    window.map(arena, fields[name][0], rows, ahead=name != ID_FIELD or data_bytes >= 8)
            except (OSError, KeyError):  # gone already, or another layout: not known here
                return
            if arena == len(self.arenas):
                self._index[ident] = arena
                self.arenas.append((holder, fields))
            self.first_row[blocks] = first_rows
            self.arena_of[blocks] = arena

    def _open_windows(self, fields: dict) -> dict[str, Window]:
        windows = {}
        for name, (_, dtype, shape) in fields.items():
            window = Window.open(self.num_samples, dtype, tuple(shape))
            if window is None:
                for opened in windows.values():
                    opened.close()
                return {}
            windows[name] = window
        return windows

    def forget(self) -> None:
        """After a move: find every block's place again (and stop mapping gone workers' files)."""
        with self._lock:
            for window in (self._windows or {}).values():
                window.close()
            self._windows = None
            self._slices.clear()
            self.arena_of[:] = -1
            self.arenas.clear()
            self._index.clear()

    def forget_if_gone(self) -> None:
        """Forget everything if a known arena's worker is gone (mapped, its memory stays alive)."""
        with self._lock:
            gone = any(not os.path.exists(fields[ID_FIELD][0]) for _, fields in self.arenas)
        if gone:
            self.forget()

    def take(self, group: list[np.ndarray], count, run: int = 1) -> list[dict[str, np.ndarray]]:
        """Batches of sample ids `group` (all in known arenas), each with its "index" and in
        pooled memory of its own (let go with its last array); hits recorded by
        `count(holder, tier, rows, bytes)`. `Moved` for a block no longer there. `run`:
        the ids come in runs of that many consecutive ids (the rows of windows), planned
        and checked a run at a time rather than a row at a time."""
        ids = np.concatenate(group)
        bounds = np.cumsum([0] + [len(b) for b in group]).tolist()
        with self._lock:  # held through the copy: nothing is unmapped while it reads
            if not self._windows:
                raise Moved([int(ids[0] // self.block_len)] if len(ids) else [])
            if 1 < run <= self.block_len and len(ids) % run == 0:
                rows, arena, checked = self._runs(ids, run)
            else:
                rows, arena = self._rows(ids)
                checked = (rows, arena, ids)
            layout = tuple((name, w.rows.dtype.str, w.rows.shape[1:]) for name, w in self._windows.items()
                           if name != ID_FIELD)
            out = [empty_batch(layout, len(b)) for b in group]
            for name, window in self._windows.items():
                stride = np.int64(window.stride)  # rows of an arena in this field's mapping
                if name == ID_FIELD:
                    held = window.rows[checked[1] * stride + checked[0]]
                    continue
                where = arena * stride + rows
                for batch, a, b in zip(out, bounds[:-1], bounds[1:]):  # "clip": no buffered copy; all mapped
                    np.take(window.rows, where[a:b], axis=0, out=batch[name], mode="clip")
            holders = [holder for holder, _ in self.arenas]
        if not np.array_equal(held, checked[2]):  # after the copy: were those rows still the right ones?
            self.forget()
            raise Moved([holders[a] for a in np.unique(checked[1][held != checked[2]]).tolist()])
        row_bytes = sum(values[:1].nbytes for values in out[0].values())
        for a, n in enumerate(np.bincount(arena).tolist()):
            if n:
                count(holders[a], "ram", n, n * row_bytes)
        for batch, a, b in zip(out, bounds[:-1], bounds[1:]):
            batch["index"] = ids[a:b]
        return out

    def take_windows(self, starts: np.ndarray, length: int, count) -> dict[str, np.ndarray]:
        """The windows of `length` consecutive rows from each row id in `starts` (all in known
        arenas; `length` at most a block): each field (len(starts), length, ...), a new array
        (each window copied once, into memory of its own). A window is one slice of an arena,
        copied whole, never a row at a time (one that crosses into a block placed elsewhere:
        its rows, as `take`). After the copy, the label of the first row of the block of each
        window's first row, and of its last row where that is in the next block, is checked:
        all of a slot's labels are cleared before another block's rows are written there, so a
        slot whose label (of any of its rows) still names its block held that block's rows
        during the copy; the windows of a block read the same label, not two of their own.
        `Moved` as `take`; hits recorded by `count` under the arena of each window's first row.
        Planned and checked with a few numpy calls a call, whatever the number of windows
        (a warm group's fixed cost)."""
        starts = np.asarray(starts, dtype=np.int64)
        block_len = self.block_len
        if not 1 <= length <= block_len:
            raise ValueError(f"a window of {length} rows: 1 to the {block_len} rows of a block")
        first_blocks = starts // block_len
        out = {}
        with self._lock:  # held through the copy: nothing is unmapped while it reads
            if not self._windows:
                raise Moved([int(starts[0] // block_len)] if len(starts) else [])
            arena = self.arena_of[first_blocks]
            first_rows = self.first_row[first_blocks] + (starts - first_blocks * block_len)
            # a window in one block is one slice; one into the next block, where that block follows in its arena
            spanning = np.flatnonzero((starts + (length - 1)) // block_len != first_blocks)
            next_blocks = first_blocks[spanning] + 1
            next_arena = self.arena_of[next_blocks]
            if (arena < 0).any() or (next_arena < 0).any():
                missing = np.concatenate([first_blocks[arena < 0], next_blocks[next_arena < 0]])
                raise Moved([int(b) for b in missing[:3]])
            crossing = spanning[(next_arena != arena[spanning]) |
                                (self.first_row[next_blocks] != self.first_row[first_blocks[spanning]] + block_len)]
            if len(crossing):  # each row's place, for the windows not in one slice
                whole = np.setdiff1d(np.arange(len(starts)), crossing, assume_unique=True)
                cross_rows, cross_arenas = self._rows(self._spread(starts[crossing], length))
            for name, window in self._windows.items():
                if name == ID_FIELD:
                    continue
                stride, mapped = np.int64(window.stride), window.rows  # stride: rows of an arena in this mapping
                shape = (len(starts), length) + mapped.shape[1:]
                windows = self._slices.get((name, length))
                if windows is None:  # slice i: rows i..i+length-1 as one item of their bytes (a view; read only
                    # where they are mapped), so that a take copies each window with one move (10% faster than
                    # a view of (length, ...) rows: numpy's inner loop per row)
                    row_bytes = mapped.strides[0]
                    windows = self._slices[name, length] = np.ndarray(
                        (len(mapped) - length + 1,), np.dtype((np.void, length * row_bytes)), buffer=mapped,
                        strides=(row_bytes,))
                if len(crossing):
                    taken = np.empty(len(starts), windows.dtype)
                    taken[whole] = windows[arena[whole] * stride + first_rows[whole]]
                    taken = taken.view(mapped.dtype).reshape(shape)
                    taken[crossing] = mapped[cross_arenas * stride + cross_rows].reshape((len(crossing),) + shape[1:])
                else:
                    taken = windows[arena * stride + first_rows].view(mapped.dtype).reshape(shape)
                out[name] = taken
            labels = self._windows[ID_FIELD]  # read after the rows: each block's first label
            blocks = np.concatenate([first_blocks, next_blocks]) if len(spanning) else first_blocks
            arenas = np.concatenate([arena, next_arena]) if len(spanning) else arena
            held = labels.rows[arenas * np.int64(labels.stride) + self.first_row[blocks]]
            row_bytes = self._data_row_bytes
            holders = [holder for holder, _ in self.arenas]
        expected = blocks * block_len
        if not np.array_equal(held, expected):  # after the copy: were those rows still the right ones?
            self.forget()
            raise Moved([holders[a] for a in np.unique(arenas[held != expected]).tolist()])
        if len(holders) == 1:
            count(holders[0], "ram", len(starts) * length, len(starts) * length * row_bytes)
            return out
        for a, n in enumerate(np.bincount(arena).tolist()):
            if n:
                count(holders[a], "ram", n * length, n * length * row_bytes)
        return out

    def _row_bytes(self) -> int:
        """Bytes of a row's fields, its label not counted (the windows' lock held)."""
        return sum(w.rows[:1].nbytes for name, w in self._windows.items() if name != ID_FIELD)

    @staticmethod
    def _spread(starts: np.ndarray, length: int) -> np.ndarray:
        return (starts[:, None] + np.arange(length, dtype=np.int64)).ravel()

    def _rows(self, ids: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
        """(each id's row in its arena, that arena); `Moved` if one is not in a known arena."""
        blocks = ids // self.block_len
        arena = self.arena_of[blocks]
        if (arena < 0).any():
            raise Moved([int(b) for b in blocks[arena < 0][:3]])
        return self.first_row[blocks] + (ids - blocks * self.block_len), arena

    def _runs(self, ids: np.ndarray, run: int) -> tuple[np.ndarray, np.ndarray, tuple]:
        """`_rows` for runs of `run` consecutive ids (at most a block long): a run's rows
        follow its first row's, but for a run that crosses into a block placed elsewhere;
        and (rows, arenas, ids) to check: each run's first and last (a block's rows are
        replaced together, so a run is right if its ends are)."""
        firsts = ids[::run]
        lasts = firsts + (run - 1)
        first_rows, arena = self._rows(firsts)
        last_rows, last_arena = self._rows(lasts)
        rows = first_rows[:, None] + np.arange(run, dtype=np.int64)
        arenas = np.repeat(arena, run).reshape(-1, run)
        crossing = np.flatnonzero((last_rows - first_rows != run - 1) | (last_arena != arena))
        if len(crossing):
            crossing_rows, crossing_arenas = self._rows((firsts[crossing, None] + np.arange(run)).ravel())
            rows[crossing], arenas[crossing] = crossing_rows.reshape(-1, run), crossing_arenas.reshape(-1, run)
        checked = (np.concatenate([first_rows, last_rows]), np.concatenate([arena, last_arena]),
                   np.concatenate([firsts, lasts]))
        return rows.ravel(), arenas.ravel(), checked


def _after_fork() -> None:
    """In a forked child: the registry's lock made anew (a parent thread may have held it)."""
    LocalArenas._registry = threading.Lock()


os.register_at_fork(after_in_child=_after_fork)


def split_batches(arrays: dict[str, np.ndarray], ids: np.ndarray, sizes: list[int]) -> list[dict[str, np.ndarray]]:
    """A group's arrays cut into its batches (views), each with its "index"."""
    out, a = [], 0
    items = list(arrays.items())
    for size in sizes:
        b = a + size
        batch = {f: v[a:b] for f, v in items}
        batch["index"] = ids[a:b]
        out.append(batch)
        a = b
    return out
