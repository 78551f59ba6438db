"""Blocks transparent mode's first reader already read from the store, handed to the
block's planned worker for its load task to take instead of reading again (`dmdask.fs.claims`).

Bytes are kept under the claim they came with, a secret of the reading process also in
the block's load task (`FileBlockReader.claim`), so another client's bytes for the same
key are never served (docs/failures.md#trust-model). Memory is bounded (`capacity`
bytes; a block that does not fit is dropped, and its task reads the store); a block not
taken within `seconds` is dropped; a block is taken at most once.
"""
from __future__ import annotations

import threading
import time
from collections import OrderedDict

HANDOVER_BYTES = 256 << 20
HANDOVER_SECONDS = 120.0


class Handovers:
    """Bytes handed over per (block key, claim). Thread-safe."""

    def __init__(self, capacity: int = HANDOVER_BYTES, seconds: float = HANDOVER_SECONDS):
        self.capacity, self.seconds = capacity, seconds
        self.bytes = 0
        self._blocks: OrderedDict[tuple, tuple] = OrderedDict()  # (key, claim) -> (bytes, when)
        self._lock = threading.Lock()

    def put(self, key: str, claim: str, content: bytes) -> bool:
        """Keep `content` for the block `key`'s task of claim `claim`; False when there is
        no room for it."""
        now = time.monotonic()
        with self._lock:
            self._expire(now)
            if (key, claim) in self._blocks or self.bytes + len(content) > self.capacity:
                return (key, claim) in self._blocks
            self._blocks[(key, claim)] = (content, now)
            self.bytes += len(content)
            return True

    def take(self, key: str, claim: str | None) -> bytes | None:
        """The bytes handed over for `key` with `claim` (removed), or None."""
        with self._lock:
            found = self._blocks.pop((key, claim), None) if claim is not None else None
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
