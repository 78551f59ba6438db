"""The room of a worker's RAM and SSD tiers (`TierSpace`): capacities, reservations, what
each holds and served. Placement is MinIO (CoorDL): a block takes the fastest tier with
room when it is first read and keeps it until its key is released; nothing is evicted.
"""
from __future__ import annotations

import threading
from dataclasses import asdict, dataclass

import numpy as np

COUNT_MAX = (1 << 63) - 1  # where a counter stops


@dataclass
class TierStats:
    """What one tier holds and what it served. Read by `dmdask.stats` and the dashboard."""

    capacity: int
    bytes: int = 0
    blocks: int = 0
    reserved: int = 0
    samples: int = 0  # samples held (or with room reserved)
    hits: int = 0  # samples served from this tier
    hit_bytes: int = 0
    full: bool = False  # set when the device refused a write (SSD out of space)
    error: str | None = None  # why the tier's folder cannot be used; the tier then takes no blocks
    read_errors: int = 0  # blocks dropped because their files could not be read
    warning: str | None = None  # a capacity the device cannot hold (a RAM tier larger than /dev/shm)
    source: str | None = None  # where the capacity came from (a setting, the job's limits: `sizing`)

    def room(self) -> int:
        return self.capacity - self.bytes - self.reserved

    def open(self) -> bool:
        """Whether the tier takes new blocks (not full, no error)."""
        return not self.full and self.error is None

    def as_dict(self) -> dict:
        return {name: value for name, value in asdict(self).items() if name != "reserved"}


class TierSpace:
    """The "ram" and "ssd" tiers' `TierStats`. Capacities are never exceeded: a block is
    admitted only after room was reserved. Thread-safe (task threads reserve, the
    worker's event loop stores)."""

    def __init__(self, ram: int, ssd: int):
        self.ram = TierStats(int(ram))
        self.ssd = TierStats(int(ssd))
        self._lock = threading.Lock()
        self._closed_to_growth: set = set()  # tiers that refused a sample charged as read

    def reserve(self, nbytes: int) -> str | None:
        """Reserve room for a block in the fastest tier that has it: "ram", "ssd" or None."""
        with self._lock:
            for name, tier in (("ram", self.ram), ("ssd", self.ssd)):
                if tier.open() and tier.room() >= nbytes:
                    tier.reserved += nbytes
                    return name
        return None

    def charge(self, tier: str, sizes: np.ndarray) -> int:
        """Charge the first samples of `sizes` (bytes each) that fit to `tier`, for a block
        whose size is learnt as it is read; returns how many were charged. Once a sample
        did not fit, the tier takes no more this way (MinIO: what missed the cache in
        the first epoch stays out, so later epochs read exactly the same bytes)."""
        with self._lock:
            stats = getattr(self, tier)
            if tier in self._closed_to_growth:
                return 0
            k = int(np.searchsorted(np.cumsum(sizes), stats.room(), side="right"))
            if k < len(sizes):
                self._closed_to_growth.add(tier)
            stats.bytes += int(np.sum(sizes[:k]))
            stats.samples += k
            return k

    def has_room(self, tier: str) -> bool:
        with self._lock:
            stats = getattr(self, tier)
            return stats.open() and stats.room() > 0

    def room_to_charge(self, tier: str) -> int:
        """Bytes `charge` can still add to `tier` (0 once it refused a sample)."""
        with self._lock:
            stats = getattr(self, tier)
            return stats.room() if stats.open() and tier not in self._closed_to_growth else 0

    def unreserve(self, tier: str, nbytes: int) -> None:
        with self._lock:
            getattr(self, tier).reserved -= nbytes

    def set_capacity(self, tier: str, nbytes: int, source: str) -> None:
        """A tier's capacity and where it came from (`dmdask.worker.sizing`); set by the
        worker at start, before any block is placed."""
        with self._lock:
            stats = getattr(self, tier)
            stats.capacity, stats.source = int(nbytes), source

    def count_read_error(self, tier: str) -> None:
        """A block of `tier` whose files could not be read (it is then dropped)."""
        with self._lock:
            getattr(self, tier).read_errors += 1

    def count_hit(self, tier: str, samples: int, nbytes: int) -> None:
        """Count a hit; the counts stop at `COUNT_MAX` (they travel in the worker's heartbeat,
        whose msgpack takes no integer of 2**64 or more)."""
        with self._lock:
            stats = getattr(self, tier)
            stats.hits = min(COUNT_MAX, stats.hits + samples)
            stats.hit_bytes = min(COUNT_MAX, stats.hit_bytes + nbytes)
