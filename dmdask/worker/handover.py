"""What a process outside the worker read from the store itself and handed to the worker, kept
for the block's load task so that it is not read again: a transparent-mode reader's block
bytes (`dmdask_hand_over`, `dmdask.fs.claims`) and the rows an opening rank read for its
first batch (`dmdask_give_rows`, `dmdask.client.first_batch`). One store for both.

Guarantees: an entry is kept under the claim it came with, a secret of the process that
read it also carried by the block's reader (`StoreReader.claim`: one secret per reading process, for either kind), and is
taken only with that claim, at most once (docs/failures.md#trust-model); memory is bounded
(`capacity` bytes, both kinds together: what does not fit is refused, and the load task
reads the store); an entry not taken within its lifetime is dropped; a taker waits at most
the `timeout` it gives.
"""
from __future__ import annotations

import threading
import time
from typing import Any

HANDOVER_BYTES = 256 << 20
HANDOVER_SECONDS = 120.0  # a transparent-mode block's bytes: its load task may be queued a while
GIVEN_SECONDS = 5.0  # a rank's given rows: how long a whole read of their block waits for them


BYTES, ROWS = "bytes", "rows"  # the kinds of entries: a block's bytes, or some of its rows


class Handovers:
    """Entries per (block key, claim, kind): a value and its size in bytes. Thread-safe."""

    def __init__(self, capacity: int = HANDOVER_BYTES, seconds: float = HANDOVER_SECONDS):
        self.capacity, self.seconds = capacity, seconds
        self.bytes = 0
        self._entries: dict[tuple, tuple] = {}  # (key, claim, kind) -> (value, nbytes, expires)
        self._changed = threading.Condition()

    def put(self, key: str, claim: str, value: Any, nbytes: int, seconds: float | None = None,
            kind: str = BYTES) -> bool:
        """Keep `value` (`nbytes` bytes, of `kind`) for the block `key`'s task of claim `claim`,
        for `seconds` (default: the store's); False when there is no room for it (an entry
        already kept under (key, claim, kind) stays)."""
        now = time.monotonic()
        with self._changed:
            self._expire(now)
            if (key, claim, kind) in self._entries:
                return True
            if self.bytes + nbytes > self.capacity:
                return False
            self._entries[(key, claim, kind)] = (value, nbytes, now + (self.seconds if seconds is None else seconds))
            self.bytes += nbytes
            self._changed.notify_all()
            return True

    def take(self, key: str, claim: str | None, timeout: float = 0.0, kind: str = BYTES) -> Any:
        """The value of `kind` kept for `key` with `claim` (removed), waited for up to `timeout` s; or None."""
        if claim is None:
            return None
        with self._changed:
            self._changed.wait_for(lambda: (key, claim, kind) in self._entries, timeout)
            found = self._entries.pop((key, claim, kind), None)
            if found is None:
                return None
            self.bytes -= found[1]
            return found[0]

    def _expire(self, now: float) -> None:
        for entry in [e for e, (_, _, expires) in self._entries.items() if expires <= now]:
            self.bytes -= self._entries.pop(entry)[1]
