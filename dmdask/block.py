"""`Block`: a contiguous run of samples held in memory, and the row take on it."""
from __future__ import annotations

from typing import Dict

import numpy as np

Arrays = Dict[str, np.ndarray]


def arrays_nbytes(arrays: Arrays) -> int:
    """Bytes held by the arrays; an object array counts its elements' bytes too."""
    total = 0
    for arr in arrays.values():
        total += arr.nbytes
        if arr.dtype == object:
            total += sum(getattr(v, "nbytes", 0) for v in arr)
    return total


class Block:
    """Samples `start..stop-1` of a dataset as one array per field (first axis: samples).

    Variable-size fields are object arrays of per-sample `uint8` arrays.
    """

    __slots__ = ("arrays", "start", "stop", "nbytes")

    def __init__(self, arrays: Arrays, start: int, stop: int):
        self.arrays = arrays
        self.start = start
        self.stop = stop
        self.nbytes = arrays_nbytes(arrays)

    def __len__(self) -> int:
        return self.stop - self.start

    def take(self, rows: np.ndarray) -> Arrays:
        """The given rows (offsets inside the block), in that order."""
        return {name: arr[rows] for name, arr in self.arrays.items()}

    def __reduce__(self):
        return (Block, (self.arrays, self.start, self.stop))

    def __sizeof__(self) -> int:  # what Dask's memory accounting reads
        return self.nbytes


class Streamed:
    """Stands in the worker's data for a block that did not fit any tier.

    Holding the reader (not the bytes), it lets the worker stream the block from the
    shared store when a rank asks for its rows.
    """

    __slots__ = ("reader",)

    def __init__(self, reader):
        self.reader = reader

    def __reduce__(self):
        return (Streamed, (self.reader,))

    def __sizeof__(self) -> int:
        return 64


class FillingBlock:
    """A block of a one-file-per-sample source, filled sample by sample as ranks ask.

    Its tier room is reserved when it is created; each sample is read from the store
    the first time a rank wants it, so epoch 1 streams like a plain loader, and every
    sample is still read once for the whole run. Used only from the worker's event
    loop (reads run in threads, fills happen on the loop).
    """

    __slots__ = ("reader", "arrays", "have", "nbytes", "start", "stop")

    def __init__(self, reader):
        n = reader.stop - reader.start
        self.reader = reader
        self.arrays = None  # field -> array, made on the first fill
        self.have = np.zeros(n, dtype=bool)
        self.nbytes = reader.nbytes
        self.start, self.stop = reader.start, reader.stop

    def __len__(self) -> int:
        return self.stop - self.start

    def missing(self, rows: np.ndarray) -> np.ndarray:
        """The rows not read yet, each once."""
        return np.unique(rows[~self.have[rows]])

    def fill(self, rows: np.ndarray, arrays: Arrays) -> None:
        if self.arrays is None:
            self.arrays = {}
            for name, values in arrays.items():
                shape = (len(self),) + values.shape[1:]
                self.arrays[name] = np.empty(shape, dtype=values.dtype)
        for name, values in arrays.items():
            self.arrays[name][rows] = values
        self.have[rows] = True

    @property
    def complete(self) -> bool:
        return bool(self.have.all())

    def take(self, rows: np.ndarray) -> Arrays:
        return {name: arr[rows] for name, arr in self.arrays.items()}

    def __reduce__(self):
        # Leaving the worker (a graceful retirement): travel as a complete block.
        arrays = self.reader.read() if not self.complete else Block(self.arrays, self.start, self.stop)
        return (Block, (arrays.arrays, self.start, self.stop))

    def __sizeof__(self) -> int:
        return self.nbytes
