"""Blocks a reader already read from the store, handed to the worker that will hold them.

Transparent mode's first reader of a block reads it from the store itself (its caller
is waiting) and then hands the bytes to the block's planned worker, before it submits
the block's load task (`dmdask.scheduler.plugin.DatasetsPlugin.open_blocks`). The task
takes them from here instead of reading the store a second time.

Guarantees: memory is bounded (`capacity` bytes; a block that does not fit is dropped,
and its task then reads the store); a block not taken within `seconds` is dropped; a
block is taken at most once.
"""
from __future__ import annotations

import threading
import time
from collections import OrderedDict
from typing import Optional

HANDOVER_BYTES = 256 << 20
HANDOVER_SECONDS = 120.0


class Handovers:
    """Bytes handed over per block key (see the module docstring). Thread-safe."""

    def __init__(self, capacity: int = HANDOVER_BYTES, seconds: float = HANDOVER_SECONDS):
        self.capacity, self.seconds = capacity, seconds
        self.bytes = 0
        self._blocks: "OrderedDict[str, tuple]" = OrderedDict()  # key -> (bytes, when)
        self._lock = threading.Lock()

    def put(self, key: str, content: bytes) -> bool:
        """Keep `content` for the block `key`; False when there is no room for it."""
        now = time.monotonic()
        with self._lock:
            self._expire(now)
            if key in self._blocks or self.bytes + len(content) > self.capacity:
                return key in self._blocks
            self._blocks[key] = (content, now)
            self.bytes += len(content)
            return True

    def take(self, key: str) -> Optional[bytes]:
        """The bytes handed over for `key` (removed), or None."""
        with self._lock:
            found = self._blocks.pop(key, None)
            if found is None:
                return None
            self.bytes -= len(found[0])
            return found[0]

    def _expire(self, now: float) -> None:
        while self._blocks:
            key, (content, when) = next(iter(self._blocks.items()))
            if now - when < self.seconds:
                return
            del self._blocks[key]
            self.bytes -= len(content)
