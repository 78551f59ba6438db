"""The workers' handlers as typed messages, and `WorkerAPI`, which sends them.

Every handler takes one request and answers one reply (or nothing), both dataclasses
here. On the wire a message is the handler's keyword arguments: its fields, "message"
naming its class, and its `PAYLOAD` fields (arrays, bytes, pickled objects) wrapped for
Dask's own serialisation, so arrays travel as they always did (no pickle of the whole
message). A handler rebuilds its request with `received`, which checks it once
(`HandlerArgumentError` naming the handler and the argument).

One fact, one type: blocks not held where they were asked for are the `Missing` reply
on the wire and the `Moved` exception everywhere else (the caller locates them again).
"""
from __future__ import annotations

import dataclasses
import inspect
from dataclasses import dataclass, field
from typing import Any, ClassVar, Dict, List, Optional

import numpy as np
from distributed.core import send_recv
from distributed.protocol.serialize import to_serialize

from .. import arguments as check

MAX_WAIT = 5.0  # seconds a request may wait for blocks its worker is loading


class Moved(Exception):
    """Blocks are no longer where they were located (released, recomputed elsewhere, or
    not held yet): locate them again."""

    def __init__(self, keys):
        self.keys = list(keys)
        super().__init__(f"blocks moved: {self.keys[:3]}")


class Message:
    """A request or a reply. `PAYLOAD`: fields serialised by Dask (`to_serialize`)."""

    PAYLOAD: ClassVar[tuple] = ()

    def check(self, handler: str) -> None:
        """`HandlerArgumentError` unless the fields are of their types and ranges."""


@dataclass
class RowsRequest(Message):
    """`dmdask_rows`: rows (offsets) of blocks the worker holds, block key -> rows.
    `priority`: the position of the batch that waits for them (lower first; None: after
    every prioritised read); `wait`: seconds to wait for blocks it is loading."""

    rows: Dict[str, np.ndarray]
    priority: Optional[float] = None
    wait: float = 0.0
    PAYLOAD: ClassVar[tuple] = ("rows",)

    def check(self, handler: str) -> None:
        check.mapping(handler, "rows", self.rows)
        if self.priority is not None:
            check.number(handler, "priority", self.priority, 0, float("inf"))
        check.number(handler, "wait", self.wait, 0, MAX_WAIT)


@dataclass
class Rows(Message):
    """The rows asked for, one array per field in request order; `from_store`: how many
    of them were read from the store for this request."""

    arrays: Dict[str, np.ndarray]
    from_store: int = 0
    PAYLOAD: ClassVar[tuple] = ("arrays",)


@dataclass
class Missing(Message):
    """The worker does not hold these blocks (`Moved` for the caller)."""

    keys: List[str]


@dataclass
class BatchRequest(Message):
    """`dmdask_batch`: consecutive batches gathered from their holders, in batch order.

    `requests`: holder -> block key -> rows; `positions`: holder -> where its rows go in
    the group; `index`: the group's sample ids; `sizes`: the batch lengths; `extra`: more
    fields given whole (a mixture's "source"); `context`: what `transform_context()`
    gives the transform; `isolate`: run the transform in a process of its own;
    `same_host`: the caller maps batches written to shared memory; `priority` and `wait`
    as in `RowsRequest` (a group sent to a block's planned holder is not served in part)."""

    requests: Dict[str, Dict[str, np.ndarray]]
    positions: Dict[str, np.ndarray]
    index: np.ndarray
    sizes: List[int]
    fields: List[str]
    transform: Optional[bytes] = None
    context: Any = None  # a dmdask.spec.TransformContext
    extra: Optional[Dict[str, np.ndarray]] = None
    isolate: bool = False
    same_host: bool = False
    priority: Optional[int] = None
    wait: float = 0.0
    PAYLOAD: ClassVar[tuple] = ("requests", "positions", "index", "extra", "context")

    def check(self, handler: str) -> None:
        """The rows themselves are checked against their blocks when taken."""
        index = np.asarray(self.index)
        if index.ndim != 1 or (index.size and index.dtype.kind not in "iu"):
            raise check.refuse(handler, "index", "a 1-d array of sample ids", self.index)
        sizes = self.sizes
        if not isinstance(sizes, (list, tuple)) or sum(check.count(handler, "sizes", s) for s in sizes) != len(index):
            raise check.refuse(handler, "sizes", f"batch lengths that add up to {len(index)}", sizes)
        check.texts(handler, "fields", self.fields)
        requests = check.mapping(handler, "requests", self.requests)
        check.mapping(handler, "positions", self.positions, known=list(requests), required=list(requests))
        for holder, wanted in requests.items():
            check.mapping(handler, f"requests[{holder!r}]", wanted)
            check.indices(handler, f"positions[{holder!r}]", self.positions[holder], len(index))
        if self.transform is not None and not isinstance(self.transform, bytes):
            raise check.refuse(handler, "transform", "a pickled transform (bytes) or None", type(self.transform))
        if self.context is not None:
            for name in ("epoch", "seed"):
                check.count(handler, f"context.{name}", getattr(self.context, name, None))
        if self.extra is not None:
            check.mapping(handler, "extra", self.extra)
        check.flag(handler, "isolate", self.isolate)
        check.flag(handler, "same_host", self.same_host)
        if self.priority is not None:
            check.count(handler, "priority", self.priority)
        check.number(handler, "wait", self.wait, 0, MAX_WAIT)


@dataclass
class Batches(Message):
    """The batches, as arrays (`batches`) or written to a shared-memory file of the
    caller's host (`shared`, for `dmdask.shm.results.map_batches`); `error`: the
    `TransformError` of the first batch whose transform failed (the batches before it
    are given); `from_store` as in `Rows`."""

    batches: Optional[list] = None
    shared: Optional[dict] = None
    error: Optional[BaseException] = None
    from_store: int = 0
    PAYLOAD: ClassVar[tuple] = ("batches", "error")


@dataclass
class DescribeRequest(Message):
    """`dmdask_describe`: how to map these blocks' files."""

    keys: List[str]

    def check(self, handler: str) -> None:
        check.texts(handler, "keys", self.keys)


@dataclass
class Descriptions(Message):
    """Key -> how to map the block's files (`FileBlock.describe`, `ArenaBlock.describe`),
    or None for a block held in no file; keys not held are left out."""

    blocks: Dict[str, Optional[dict]]


@dataclass
class HitsReport(Message):
    """`dmdask_count_hits`: tier -> [samples, bytes] that training processes took from
    the worker's files themselves (no reply)."""

    hits: Dict[str, List[int]]

    def check(self, handler: str) -> None:
        """Every count is checked before any is added."""
        check.mapping(handler, "hits", self.hits, known=("ram", "ssd"))
        for tier, pair in self.hits.items():
            if not isinstance(pair, (list, tuple)) or len(pair) != 2:
                raise check.refuse(handler, f"hits[{tier!r}]", "[samples, bytes]", pair)
            check.count(handler, f"hits[{tier!r}] samples", pair[0])
            check.count(handler, f"hits[{tier!r}] bytes", pair[1])


@dataclass
class HandOver(Message):
    """`dmdask_hand_over`: bytes of blocks a reader read from the store, for their load
    tasks of claim `claim` (transparent mode)."""

    blocks: Dict[str, bytes]
    claim: str
    PAYLOAD: ClassVar[tuple] = ("blocks",)

    def check(self, handler: str) -> None:
        check.mapping(handler, "blocks", self.blocks)
        check.text(handler, "claim", self.claim)
        for key, content in self.blocks.items():
            if not isinstance(content, (bytes, bytearray, memoryview)):
                raise check.refuse(handler, f"blocks[{key!r}]", "bytes", type(content).__name__)


@dataclass
class Kept(Message):
    """The keys whose bytes the worker kept (others had no room)."""

    keys: List[str] = field(default_factory=list)


OPS = {RowsRequest: "dmdask_rows", BatchRequest: "dmdask_batch", DescribeRequest: "dmdask_describe",
       HitsReport: "dmdask_count_hits", HandOver: "dmdask_hand_over"}
_MESSAGES = {cls.__name__: cls for cls in (*OPS, Rows, Missing, Batches, Descriptions, Kept)}


def to_wire(message: Message) -> dict:
    """The keyword arguments that carry `message`."""
    wire = {"message": type(message).__name__}
    for f in dataclasses.fields(message):
        value = getattr(message, f.name)
        wire[f.name] = to_serialize(value) if f.name in message.PAYLOAD and value is not None else value
    return wire


def from_wire(wire: dict) -> Message:
    """The message that keyword arguments carry (a worker's reply: not checked)."""
    wire = dict(wire)
    return _MESSAGES[wire.pop("message")](**wire)


def received(handler: str, kind: type, wire: dict) -> Message:
    """The `kind` request that `handler` received as keyword arguments, checked once."""
    wire = dict(wire)
    name = wire.pop("message", None)
    if name != kind.__name__:
        raise check.refuse(handler, "message", f"a {kind.__name__} (send it with WorkerAPI)", name)
    names = [f.name for f in dataclasses.fields(kind)]
    try:
        request = kind(**wire)
    except TypeError:
        raise check.refuse(handler, "arguments", f"the fields {names} of {kind.__name__}", sorted(wire)) from None
    request.check(handler)
    return request


def handler(kind: type, method):
    """`method` (a `kind` request -> a reply message or None) as the Dask handler of its op."""
    op = OPS[kind]

    async def handle(**wire):
        reply = method(received(op, kind, wire))
        if inspect.isawaitable(reply):
            reply = await reply
        return None if reply is None else to_wire(reply)

    handle.__name__ = op
    return handle


class WorkerAPI:
    """The workers' handlers as calls, over a `ConnectionPool` (`client.rpc`, `worker.rpc`).
    `connect_seconds`: how long a connection may take (None: the pool's timeout); a worker
    that has gone away then fails the call with an OSError at once instead of after Dask's
    whole connect timeout (30 s of retries against a closed port)."""

    def __init__(self, rpc, connect_seconds: Optional[float] = None):
        self.rpc = rpc
        self.connect_seconds = connect_seconds

    async def call(self, address: str, request: Message) -> Optional[Message]:
        comm = await self.rpc.connect(address, timeout=self.connect_seconds)
        try:
            reply = await send_recv(comm, op=OPS[type(request)], **to_wire(request))
        finally:
            self.rpc.reuse(address, comm)
        return None if reply is None else from_wire(reply)

    async def rows(self, address: str, request: RowsRequest) -> Rows:
        """`Moved` when the worker does not hold a block (after `request.wait`)."""
        return _found(await self.call(address, request))

    async def batch(self, address: str, request: BatchRequest) -> Batches:
        """`Moved` when a holder does not hold a block."""
        return _found(await self.call(address, request))

    async def describe(self, address: str, keys: List[str]) -> Dict[str, Optional[dict]]:
        return (await self.call(address, DescribeRequest(keys))).blocks

    async def count_hits(self, address: str, hits: Dict[str, List[int]]) -> None:
        await self.call(address, HitsReport(hits))

    async def hand_over(self, address: str, blocks: Dict[str, bytes], claim: str) -> List[str]:
        return (await self.call(address, HandOver(blocks, claim))).keys


def _found(reply):
    if isinstance(reply, Missing):
        raise Moved(reply.keys)
    return reply
