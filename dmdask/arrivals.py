"""`Arrivals`: coroutines waiting, up to a timeout, for keys to arrive (a block stored on a
worker, a task finishing on the scheduler)."""
from __future__ import annotations

import asyncio
from collections.abc import Iterable


class Arrivals:
    """Futures waiting per key, each woken by `wake(key)`. Used from one event loop."""

    def __init__(self):
        self._waiting: dict[str, list[asyncio.Future]] = {}

    async def wait(self, keys: Iterable[str], timeout: float) -> None:
        """Until each of `keys` was woken, or `timeout` seconds passed."""
        keys = list(keys)
        loop = asyncio.get_running_loop()
        futures = [loop.create_future() for _ in keys]
        for key, fut in zip(keys, futures):
            self._waiting.setdefault(key, []).append(fut)
        try:
            await asyncio.wait(futures, timeout=timeout)
        finally:
            for key, fut in zip(keys, futures):
                if not fut.done():
                    fut.cancel()
                    left = [f for f in self._waiting.get(key, ()) if f is not fut]
                    if left:
                        self._waiting[key] = left
                    else:
                        self._waiting.pop(key, None)

    def wake(self, key: str) -> None:
        for fut in self._waiting.pop(key, ()):
            if not fut.done():
                fut.set_result(None)
