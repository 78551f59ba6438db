"""Waiting out a lost worker, scheduler or block: attempts until a deadline (`Tries`).

`for _ in Tries(seconds, pause):` (`async for` on an event loop) runs its body at once,
then every `pause` seconds (a number, or a function of the attempt number) until the
deadline; the body leaves with `return` or `break` on success, and after the loop the
caller raises its own error. Guarantees: there is always a first attempt; no pause once
the deadline passed; `deadline.renew()` gives the loop its full time again; `no_pause()`
starts the next attempt at once; time is `time.monotonic()`.
"""
from __future__ import annotations

import asyncio
import time

import dask.config


def reply_seconds() -> float:
    """How long a worker's reply to a request for rows (or for their layout) may take
    before the worker counts as lost (paused, hung): half `dmdask.client.recovery-seconds`,
    so the request can be asked again of the blocks' next holders (the scheduler's once
    it treats a silent worker as lost, `dmdask.scheduler.silent`) within the batch's deadline."""
    return float(dask.config.get("dmdask.client.recovery-seconds")) / 2


class Deadline:
    """`seconds` from now, or from the last `renew()`."""

    def __init__(self, seconds: float):
        self.seconds = float(seconds)
        self.renew()

    def renew(self, not_after: float | None = None) -> None:
        """`seconds` from now again; no later than the monotonic time `not_after`, if given."""
        self.at = time.monotonic() + self.seconds
        if not_after is not None:
            self.at = min(self.at, not_after)

    def left(self) -> float:
        return self.at - time.monotonic()


class Tries:
    """Attempts until `deadline` (a `Deadline`, or seconds from now) passes, `pause`
    seconds apart (see the module docstring); `count`: the attempts begun."""

    def __init__(self, deadline, pause=0.0):
        self.deadline = deadline if isinstance(deadline, Deadline) else Deadline(deadline)
        self.pause, self.count, self._at_once = pause, 0, False

    def no_pause(self) -> None:
        self._at_once = True

    def _pause(self) -> float | None:
        """Seconds before the next attempt; None: the deadline passed."""
        if self.count and self.deadline.left() < 0:
            return None
        pause = self.pause(self.count) if callable(self.pause) else self.pause
        pause = 0.0 if not self.count or self._at_once else pause
        self.count, self._at_once = self.count + 1, False
        return pause

    def __iter__(self):
        return self

    def __next__(self) -> int:
        pause = self._pause()
        if pause is None:
            raise StopIteration
        if pause:
            time.sleep(pause)
        return self.count

    def __aiter__(self):
        return self

    async def __anext__(self) -> int:
        pause = self._pause()
        if pause is None:
            raise StopAsyncIteration
        if pause:
            await asyncio.sleep(pause)
        return self.count
