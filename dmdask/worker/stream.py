"""`StreamBuffer`: blocks beyond the cache, held briefly while ranks take their rows."""
from __future__ import annotations

import asyncio

import zict

from .holdings import Block
from .reads import LAST, PriorityPool


class StreamBuffer:
    """A block leaves once as many rows were served as it holds, or when the buffer is
    full (least recently used first): never a cache across epochs. One read per block at
    a time. Used from the worker's event loop."""

    def __init__(self, capacity_bytes: int, read, executor: PriorityPool):
        self.capacity = capacity_bytes
        self._read = read
        self._executor = executor
        self._served: dict[str, int] = {}  # key -> rows served
        self._blocks = zict.LRU(capacity_bytes, {}, weight=lambda key, block: block.nbytes,
                                on_evict=lambda key, block: self._served.pop(key, None))
        self._loading: dict[str, asyncio.Future] = {}

    async def get(self, reader, priority: float = LAST) -> Block:
        """The block of `reader`, read once (in the `PriorityPool` at `priority`) however
        many ask at once."""
        key = reader.key
        if key in self._blocks:
            return self._blocks[key]
        if key in self._loading:
            return await asyncio.shield(self._loading[key])
        loop = asyncio.get_running_loop()
        fut = self._loading[key] = loop.create_future()
        try:
            block = await asyncio.wrap_future(self._executor.submit_at(priority, self._read, reader))
        except BaseException as exc:
            fut.set_exception(exc)
            fut.exception()  # mark retrieved: the awaiting callers re-raise it
            raise
        finally:
            del self._loading[key]
        self.put(key, block)
        fut.set_result(block)
        return block

    def put(self, key: str, block: Block) -> None:
        if block.nbytes > self.capacity or key in self._blocks:
            return
        self._blocks[key] = block  # the least recently used dropped until it fits
        self._served[key] = 0

    @property
    def bytes(self) -> int:
        return int(self._blocks.total_weight)

    def served(self, key: str, rows: int) -> None:
        """Count rows handed out; drop the block once all of its rows were."""
        if key not in self._blocks:
            return
        self._served[key] += rows
        if self._served[key] >= len(self._blocks[key]):
            del self._blocks[key], self._served[key]
