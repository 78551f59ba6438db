"""The worker's storage: a RAM tier and an SSD tier for dmdask blocks, a dict for the rest.

Placement is MinIO (CoorDL): a block goes to the fastest tier with room when it is
first read, and stays there until its key is released; nothing is ever evicted to make
room, so a fresh shuffle each epoch cannot thrash the cache. A block that fits no tier
is stored as a `Streamed` marker and read from the shared store when asked for.

`TieredStore` is the `data=` mapping of a dmdask worker. Like every Dask worker
mapping it never drops a key on its own.
"""
from __future__ import annotations

import errno
import os
import shutil
import tempfile
import threading
from collections.abc import MutableMapping
from dataclasses import dataclass, field
from typing import Dict, Optional

import numpy as np

from .block import Arrays, Block, FillingBlock, Streamed
from .sources import is_block_key


@dataclass
class TierStats:
    """What one tier holds and what it served. Read by `dmdask.stats` and the dashboard."""

    capacity: int
    bytes: int = 0
    blocks: int = 0
    reserved: int = 0
    hits: int = 0  # samples served from this tier
    hit_bytes: int = 0
    full: bool = False  # set when the device refused a write (SSD out of space)

    def room(self) -> int:
        return self.capacity - self.bytes - self.reserved

    def as_dict(self) -> dict:
        return {"capacity": self.capacity, "bytes": self.bytes, "blocks": self.blocks,
                "hits": self.hits, "hit_bytes": self.hit_bytes, "full": self.full}


class SsdBlock:
    """A block kept on local disk: one `.npy` file per fixed-size field (read by memory
    map, so a take reads only the wanted rows) and values + offsets for ragged fields."""

    __slots__ = ("path", "start", "stop", "nbytes", "ragged")

    def __init__(self, path: str, start: int, stop: int, nbytes: int, ragged: tuple):
        self.path, self.start, self.stop, self.nbytes, self.ragged = path, start, stop, nbytes, ragged

    @classmethod
    def write(cls, directory: str, block: Block) -> "SsdBlock":
        """Write `block` under a new folder of `directory`; on error nothing is left behind."""
        path = tempfile.mkdtemp(dir=directory, prefix=f"b{block.start}-")
        ragged = []
        try:
            for name, arr in block.arrays.items():
                if arr.dtype == object:
                    sizes = np.fromiter((len(v) for v in arr), dtype=np.int64, count=len(arr))
                    offsets = np.concatenate([[0], np.cumsum(sizes)]).astype(np.int64)
                    values = np.concatenate(list(arr)) if len(arr) else np.zeros(0, np.uint8)
                    np.save(os.path.join(path, f"{name}.values.npy"), values)
                    np.save(os.path.join(path, f"{name}.offsets.npy"), offsets)
                    ragged.append(name)
                else:
                    np.save(os.path.join(path, f"{name}.npy"), arr)
        except BaseException:
            shutil.rmtree(path, ignore_errors=True)
            raise
        names = tuple(block.arrays)
        return cls(path, block.start, block.stop, block.nbytes, (names, tuple(ragged)))

    def take(self, rows: np.ndarray) -> Arrays:
        names, ragged = self.ragged
        out = {}
        for name in names:
            if name in ragged:
                values = np.load(os.path.join(self.path, f"{name}.values.npy"), mmap_mode="r")
                offsets = np.load(os.path.join(self.path, f"{name}.offsets.npy"))
                col = np.empty(len(rows), dtype=object)
                for i, r in enumerate(rows):
                    col[i] = np.array(values[offsets[r]:offsets[r + 1]])
                out[name] = col
            else:
                out[name] = np.asarray(np.load(os.path.join(self.path, f"{name}.npy"), mmap_mode="r")[rows])
        return out

    def load(self) -> Block:
        return Block(self.take(np.arange(self.stop - self.start)), self.start, self.stop)

    def __reduce__(self):
        # Leaving this worker (a graceful retire, a gather): travel as the data itself.
        block = self.load()
        return (Block, (block.arrays, block.start, block.stop))

    def __sizeof__(self) -> int:
        return 256


class TieredStore(MutableMapping):
    """Worker storage: dmdask blocks in a RAM or SSD tier, every other key in a dict.

    Capacities are never exceeded: a block is admitted only after space was reserved
    (`reserve`), so use stays within capacity plus the blocks being read right now.
    Thread-safe: reservations come from task threads, the mapping is used by the
    worker's event loop.
    """

    def __init__(self, ram: int, ssd: int = 0, ssd_dir: Optional[str] = None):
        self.ram = TierStats(int(ram))
        self.ssd = TierStats(int(ssd))
        self._ssd_root = ssd_dir
        self._ssd_dir: Optional[str] = None
        self._blocks: Dict[str, object] = {}
        self._tier_of: Dict[str, str] = {}
        self._other: Dict[str, object] = {}
        self._reservations: Dict[str, tuple] = {}  # key -> (tier, bytes) placed, not yet stored
        self._lock = threading.Lock()

    # -- placement (called from the task that reads a block) -------------------------
    def reserve(self, nbytes: int) -> Optional[str]:
        """Reserve room for a block in the fastest tier that has it: "ram", "ssd" or None."""
        with self._lock:
            for name, tier in (("ram", self.ram), ("ssd", self.ssd)):
                if not tier.full and tier.room() >= nbytes:
                    tier.reserved += nbytes
                    return name
        return None

    def unreserve(self, tier: str, nbytes: int) -> None:
        with self._lock:
            getattr(self, tier).reserved -= nbytes

    def place(self, key: str, tier: str, block: Block, reserved: int):
        """Turn a reserved read block into the value the worker will store under `key`.

        Returns the `Block` (RAM), an `SsdBlock`, or None when the SSD refused the write
        (the SSD tier then stops growing; the caller streams the block instead). The
        reservation turns into held bytes when the worker stores the value.
        """
        if tier == "ssd":
            try:
                block = SsdBlock.write(self.ssd_dir(), block)
            except OSError as exc:
                with self._lock:
                    self.ssd.reserved -= reserved
                    if exc.errno in (errno.ENOSPC, errno.EDQUOT, errno.EFBIG):
                        self.ssd.full = True
                return None
        with self._lock:
            self._reservations[key] = (tier, reserved)
        return block

    def ssd_dir(self) -> str:
        with self._lock:
            if self._ssd_dir is None:
                root = self._ssd_root or tempfile.gettempdir()
                os.makedirs(root, exist_ok=True)
                self._ssd_dir = tempfile.mkdtemp(dir=root, prefix="dmdask-ssd-")
            return self._ssd_dir

    # -- reads ------------------------------------------------------------------------
    def tier_of(self, key: str) -> Optional[str]:
        return self._tier_of.get(key)

    def count_hit(self, tier: str, samples: int, nbytes: int) -> None:
        with self._lock:
            stats = getattr(self, tier)
            stats.hits += samples
            stats.hit_bytes += nbytes

    # -- MutableMapping ---------------------------------------------------------------
    def __setitem__(self, key, value):
        if is_block_key(key) and isinstance(value, (Block, FillingBlock, SsdBlock, Streamed)):
            self._discard_block(key)
            self._blocks[key] = value
            self._other.pop(key, None)
            if isinstance(value, Streamed):
                return
            # Charged here, whether placed by `load_block` (its reservation is released)
            # or brought by Dask itself (a graceful retirement moving blocks: RAM).
            tier = "ssd" if isinstance(value, SsdBlock) else "ram"
            self._tier_of[key] = tier
            with self._lock:
                placed_tier, reserved = self._reservations.pop(key, (tier, 0))
                getattr(self, placed_tier).reserved -= reserved
                stats = getattr(self, tier)
                stats.bytes += value.nbytes
                stats.blocks += 1
        else:
            self._discard_block(key)
            self._other[key] = value

    def __getitem__(self, key):
        if key in self._blocks:
            return self._blocks[key]
        return self._other[key]

    def __delitem__(self, key):
        if key in self._blocks:
            self._discard_block(key)
        else:
            del self._other[key]

    def _discard_block(self, key) -> None:
        value = self._blocks.pop(key, None)
        tier = self._tier_of.pop(key, None)
        if tier is None:
            return
        with self._lock:
            stats = getattr(self, tier)
            stats.bytes -= value.nbytes
            stats.blocks -= 1
        if isinstance(value, SsdBlock):
            shutil.rmtree(value.path, ignore_errors=True)

    def __contains__(self, key) -> bool:
        return key in self._blocks or key in self._other

    def __iter__(self):
        yield from self._blocks
        yield from self._other

    def __len__(self) -> int:
        return len(self._blocks) + len(self._other)

    def close(self) -> None:
        """Remove the SSD folder (its blocks die with the worker anyway)."""
        if self._ssd_dir:
            shutil.rmtree(self._ssd_dir, ignore_errors=True)

    def stats(self) -> dict:
        with self._lock:
            return {"ram": self.ram.as_dict(), "ssd": self.ssd.as_dict(),
                    "streamed_blocks": sum(isinstance(v, Streamed) for v in self._blocks.values())}
