"""Rows the rank that opened a dataset read from the store itself and gave this worker
(`dmdask.client.first_batch`), for a load task that reads its block whole.

A block read whole (into the SSD tier) skips its `rank_rows` and waits for them here, up
to `GIVEN_SECONDS`, then reads them itself (the rank failed or is slow): each row leaves
the store once, and nothing waits longer than that. Rows are kept under the claim their
block's readers carry (`rank_claim`), a secret of the opening rank, so no other client's
rows for the key are taken (docs/failures.md#trust-model); rows not taken within
`GIVEN_SECONDS` are dropped.
"""
from __future__ import annotations

import threading
import time

import numpy as np

GIVEN_SECONDS = 5.0


class GivenRows:
    """Rows given per (block key, claim), each taken at most once. Thread-safe."""

    def __init__(self, seconds: float = GIVEN_SECONDS):
        self.seconds = seconds
        self._rows: dict[tuple, tuple] = {}  # (key, claim) -> (rows, arrays, when)
        self._changed = threading.Condition()

    def put(self, key: str, claim: str, rows: np.ndarray, arrays: dict) -> None:
        now = time.monotonic()
        with self._changed:
            self._rows = {k: v for k, v in self._rows.items() if now - v[2] < self.seconds}
            self._rows[(key, claim)] = (rows, arrays, now)
            self._changed.notify_all()

    def take(self, key: str, claim: str, timeout: float = 0.0) -> tuple[np.ndarray, dict] | None:
        """(rows, arrays) given for `key` with `claim` (removed), waited for up to `timeout` s; or None."""
        with self._changed:
            self._changed.wait_for(lambda: (key, claim) in self._rows, timeout)
            found = self._rows.pop((key, claim), None)
        return None if found is None else found[:2]
