"""`Coalesced`: one request at a time for a set of keys; keys asked for while one is under
way go together in the next. A rank's first groups all locate their blocks at once: one
locate instead of eight saves the scheduler seven connections and handshakes per rank,
which at an epoch's start compete with the first store reads for the CPU."""
from __future__ import annotations

import asyncio
from collections.abc import Awaitable, Callable, Iterable


class Coalesced:
    """`await coalesced(keys)`: `request(keys')` for a `keys'` that holds every key of `keys`
    (and perhaps others asked for at the same time). At most one request is under way; a
    failed request fails the callers whose keys it held, and the next callers ask anew. Used
    from one event loop."""

    def __init__(self, request: Callable[[list], Awaitable]):
        self._request = request
        self._queued: dict = {}  # keys for the next request, in the order asked
        self._answer: asyncio.Future | None = None  # the next request's reply
        self._running = False

    async def __call__(self, keys: Iterable):
        self._queued.update(dict.fromkeys(keys))
        if self._answer is None:
            self._answer = asyncio.get_running_loop().create_future()
        answer = self._answer
        if not self._running:
            self._running = True
            asyncio.get_running_loop().create_task(self._send_queued())
        return await asyncio.shield(answer)  # a caller cancelled does not cancel the others' request

    async def _send_queued(self) -> None:
        try:
            while self._queued:
                keys, answer = list(self._queued), self._answer
                self._queued, self._answer = {}, None
                try:
                    answer.set_result(await self._request(keys))
                except asyncio.CancelledError:  # the loop is closing
                    answer.cancel()
                    raise
                except Exception as exc:  # noqa: BLE001 - handed to the callers
                    answer.set_exception(exc)
                    answer.exception()  # retrieved here too: every caller may have been cancelled
        finally:
            self._running = False
            if self._answer is not None and self._queued:  # left by a cancellation: its callers stop too
                self._answer.cancel()
                self._queued, self._answer = {}, None
