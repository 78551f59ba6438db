"""The workers' handlers as typed messages, and `WorkerAPI`, which sends them. On the wire a
message is the handler's keyword arguments: "message" (its class) and its fields, the
`PAYLOAD` ones (arrays, bytes) wrapped by `to_serialize`. A handler checks its request once
(`Message.check`, as the scheduler's do: by the fields' types and declared ranges,
`dmdask.protocol.message`; fields of arrays by the request's own `check` too). Blocks not
held where asked are the `Missing` reply on the wire and `Moved` everywhere else.
"""
from __future__ import annotations

import asyncio

import dataclasses
import inspect
from dataclasses import dataclass
from typing import Any, ClassVar

import numpy as np
import dask
from dask.utils import parse_timedelta
from distributed.core import send_recv
from distributed.protocol.serialize import to_serialize

from .. import arguments as check
from ..errors import HandlerArgumentError
from .message import Message as Checked
from .message import checked, from_dict, ranged

MAX_WAIT = 5.0  # seconds a request may wait for blocks its worker is loading


class Moved(Exception):
    """Blocks are not (or no longer) where they were located: locate them again."""

    def __init__(self, keys):
        self.keys = list(keys)
        super().__init__(f"blocks moved: {self.keys[:3]}")


class Message(Checked):
    PAYLOAD: ClassVar[tuple] = ()  # fields serialised by Dask (`to_serialize`)


@dataclass
class Missing(Message):
    keys: list[str]


@dataclass
class BatchRequest(Message):
    """`dmdask_batch`: consecutive batches gathered from their holders (`requests`, `positions`:
    `plan_rows`); `extra`: fields given whole (a mixture's "source"); `context`: a
    `TransformContext`; `isolate`: the transform in a process of its own; `same_host`: batches
    may come back in shared memory; `priority`: the position of the first batch (lower
    first; None: last); `wait`: seconds a holder may wait for blocks it is loading."""
    op: ClassVar[str] = "dmdask_batch"
    requests: dict[str, dict[str, np.ndarray]] = checked(None)  # checked below
    positions: dict[str, np.ndarray] = checked(None)
    index: np.ndarray = checked(None)
    sizes: list[int] = checked(None)
    fields: list[str] = checked(check.texts)
    transform: bytes | None = None
    context: Any = checked(None, None)
    extra: dict[str, np.ndarray] | None = checked(lambda op, name, value: value is None or check.mapping(op, name, value),
                                                  None)
    isolate: bool = False
    same_host: bool = False
    priority: int | None = None
    wait: float = ranged(0, MAX_WAIT, 0.0)
    PAYLOAD: ClassVar[tuple] = ("requests", "positions", "index", "extra", "context", "transform")

    def check(self, handler: str | None = None) -> None:
        """The rows themselves are checked against their blocks when taken (`check_rows`)."""
        handler = handler or self.op
        super().check(handler)
        index = np.asarray(self.index)
        if index.ndim != 1 or (index.size and index.dtype.kind not in "iu"):
            raise check.refuse(handler, "index", "a 1-d array of sample ids", self.index)
        sizes = self.sizes
        if not isinstance(sizes, (list, tuple)) or sum(check.count(handler, "sizes", s) for s in sizes) != len(index):
            raise check.refuse(handler, "sizes", f"batch lengths that add up to {len(index)}", sizes)
        requests = check.mapping(handler, "requests", self.requests)
        check.mapping(handler, "positions", self.positions, known=list(requests), required=list(requests))
        for holder, wanted in requests.items():
            check.mapping(handler, f"requests[{holder!r}]", wanted)
            check.indices(handler, f"positions[{holder!r}]", self.positions[holder], len(index))
        for name in ("epoch", "seed") if self.context is not None else ():
            check.count(handler, f"context.{name}", getattr(self.context, name, None))


@dataclass
class Batches(Message):
    """The batches, as arrays or written to shared memory on the caller's host (`shared`,
    for `map_batches`); `error`: the first failed transform's `TransformError`."""
    batches: list | None = None
    shared: dict | None = None
    error: BaseException | None = None
    from_store: int = 0
    PAYLOAD: ClassVar[tuple] = ("batches", "error")


@dataclass
class DescribeRequest(Message):
    """`dmdask_describe`: how to map these blocks' files."""
    op: ClassVar[str] = "dmdask_describe"
    keys: list[str]


def _layout(op: str, name: str, value) -> None:
    """One (field, kind, dtype, shape) per field (`dmdask.shm.fileblocks`)."""
    if not isinstance(value, (list, tuple)) or not all(
            isinstance(e, (list, tuple)) and len(e) == 4 and isinstance(e[0], str) and e[0]
            and e[1] in ("fixed", "ragged", "strings") and isinstance(e[2], str) and _shape(e[3]) for e in value):
        raise check.refuse(op, name, "a list of [field, 'fixed'|'ragged'|'strings', dtype, shape]", value)


def _arena_fields(op: str, name: str, value) -> None:
    """Field -> (file, dtype, row shape) (`dmdask.shm.arena.Arena.fields`)."""
    for field, entry in check.mapping(op, name, value).items():
        if not (isinstance(entry, (list, tuple)) and len(entry) == 3 and isinstance(entry[0], str) and entry[0]
                and isinstance(entry[1], str) and _shape(entry[2])):
            raise check.refuse(op, f"{name}[{field!r}]", "[file, dtype, row shape]", entry)


def _shape(value) -> bool:
    return isinstance(value, (list, tuple)) and all(
        isinstance(n, int) and not isinstance(n, bool) and n >= 0 for n in value)


@dataclass
class FileLayout(Message):
    """How a process on the worker's host maps a block held in files of its own
    (`FileBlock.describe`): its folder, each field's layout, its tier."""
    path: str
    layout: list = checked(_layout)
    tier: str = "ssd"


@dataclass
class ArenaLayout(Message):
    """How it takes the rows of a RAM block held in a slot of its dataset's arena
    (`ArenaBlock.describe`): the arena's files, the slot's first row, the block's first sample."""
    arena: dict = checked(_arena_fields)
    first_row: int = 0
    start: int = 0
    tier: str = "ram"


def read_layout(value) -> dict | None:
    """`value`, a block's description from `dmdask_describe`, if it is a `FileLayout` or an
    `ArenaLayout` (each field of its type); None otherwise: not mappable, its rows then come
    by request, as for a block in no file."""
    kind = ArenaLayout if isinstance(value, dict) and "arena" in value else FileLayout
    try:
        from_dict(kind, value, "dmdask_describe").check("dmdask_describe")
    except HandlerArgumentError:
        return None
    return value


@dataclass
class Descriptions(Message):
    """Key -> how to map its files (`Holding.describe`; None: in no file); keys not held are left out."""
    blocks: dict[str, dict | None]


@dataclass
class HitsReport(Message):
    """`dmdask_count_hits`: tier -> [samples, bytes] taken from the worker's files by others."""
    op: ClassVar[str] = "dmdask_count_hits"
    hits: dict[str, list[int]] = checked(None)  # checked below: [samples, bytes], each in its range

    def check(self, handler: str | None = None) -> None:
        handler = handler or self.op
        check.mapping(handler, "hits", self.hits, known=("ram", "ssd"))
        for tier, pair in self.hits.items():
            if not isinstance(pair, (list, tuple)) or len(pair) != 2:
                raise check.refuse(handler, f"hits[{tier!r}]", "[samples, bytes]", pair)
            check.count(handler, f"hits[{tier!r}] samples", pair[0], high=check.REPORT_SAMPLES)
            check.count(handler, f"hits[{tier!r}] bytes", pair[1], high=check.REPORT_BYTES)


@dataclass
class HandOver(Message):
    """`dmdask_hand_over`: bytes of blocks a reader read, for their load tasks of `claim`."""
    op: ClassVar[str] = "dmdask_hand_over"
    blocks: dict[str, bytes]
    claim: str
    PAYLOAD: ClassVar[tuple] = ("blocks",)


@dataclass
class PlaceBlocks(Message):
    """`dmdask_place_blocks`: bytes of blocks a reader read (`blocks`), kept by the worker as
    their loads would keep them but without a load task each: `readers` pickles their
    `StoreReader`s (a reader's claim is `claim`). Reply: `Placed`."""
    op: ClassVar[str] = "dmdask_place_blocks"
    blocks: dict[str, bytes]
    claim: str
    readers: bytes
    PAYLOAD: ClassVar[tuple] = ("blocks", "readers")


@dataclass
class Placed(Message):
    held: dict[str, int]  # block key -> its size, as the worker holds it now (the others: not placed)


@dataclass
class GiveRows(Message):
    """`dmdask_give_rows`: rows of blocks a rank read from the store itself (block key ->
    rows, block key -> one array per field), for the worker to keep if their readers
    name them with `claim`; `retries`: the transient errors the reads retried; `wait`:
    seconds to wait for blocks loading."""
    op: ClassVar[str] = "dmdask_give_rows"
    rows: dict[str, np.ndarray] = checked(None)  # checked below, with `arrays`
    arrays: dict[str, dict[str, np.ndarray]] = checked(None)
    claim: str = ""
    retries: int = 0
    wait: float = ranged(0, MAX_WAIT, 0.0)
    PAYLOAD: ClassVar[tuple] = ("rows", "arrays")

    def check(self, handler: str | None = None) -> None:
        handler = handler or self.op
        super().check(handler)
        keys = list(check.mapping(handler, "rows", self.rows))
        for key, rows in self.rows.items():
            if not isinstance(rows, np.ndarray) or rows.ndim != 1 or (rows.size and rows.dtype.kind not in "iu"):
                raise check.refuse(handler, f"rows[{key!r}]", "a 1-d array of integer offsets", rows)
        check.mapping(handler, "arrays", self.arrays, known=keys, required=keys)
        for key, fields in self.arrays.items():
            for name, values in check.mapping(handler, f"arrays[{key!r}]", fields).items():
                if not isinstance(values, np.ndarray) or values.shape[:1] != (len(self.rows[key]),):
                    raise check.refuse(handler, f"arrays[{key!r}][{name!r}]",
                                       f"an array of {len(self.rows[key])} rows (one per row given)", values)


@dataclass
class ChannelRequest(Message):
    """`dmdask_channel`: where the worker serves rows (`dmdask.protocol.rows`)."""
    op: ClassVar[str] = "dmdask_channel"


@dataclass
class Channel(Message):
    """Where a worker serves rows: host, port, and the secret a connection starts with."""
    host: str
    port: int
    secret: str


@dataclass
class Kept(Message):
    keys: list[str]  # those whose bytes the worker kept (others had no room)


OPS = {kind: kind.op for kind in (BatchRequest, DescribeRequest, HitsReport, HandOver, PlaceBlocks, GiveRows,
                                   ChannelRequest)}
_MESSAGES = {cls.__name__: cls for cls in (*OPS, Missing, Batches, Descriptions, Kept, Placed, Channel)}


def to_wire(message: Message) -> dict:
    wire = {"message": type(message).__name__}
    for f in dataclasses.fields(message):
        value = getattr(message, f.name)
        wire[f.name] = to_serialize(value) if f.name in message.PAYLOAD and value is not None else value
    return wire


def handler(kind: type, method):
    """`method` (a `kind` request -> a reply or None) as the Dask handler of its op, which checks the request."""
    op = OPS[kind]

    async def handle(message=None, **wire):
        if message != kind.__name__:
            raise check.refuse(op, "message", f"a {kind.__name__} (send it with WorkerAPI)", message)
        try:
            request = kind(**wire)
        except TypeError:
            fields = [f.name for f in dataclasses.fields(kind)]
            raise check.refuse(op, "arguments", f"the fields {fields} of {kind.__name__}", sorted(wire)) from None
        request.check(op)
        reply = method(request)
        reply = (await reply) if inspect.isawaitable(reply) else reply
        return None if reply is None else to_wire(reply)

    handle.__name__ = op
    return handle


async def connect_within(rpc, address: str, seconds: float | None = None):
    """A comm to `address` from the pool `rpc`, or a `TimeoutError` naming the worker once
    `seconds` passed (None: `distributed.comm.timeouts.connect`). Dask bounds only the TCP
    connect, not the handshake after it (dask/distributed#7698), so a paused worker, whose
    kernel still accepts connections, would otherwise keep its caller waiting forever."""
    if seconds is None:
        seconds = parse_timedelta(dask.config.get("distributed.comm.timeouts.connect"), default="seconds")
    try:
        return await asyncio.wait_for(rpc.connect(address, timeout=seconds), seconds)
    except asyncio.TimeoutError:
        raise TimeoutError(f"worker {address} did not answer a new connection within {seconds:.0f} s: "
                           "paused or hung?") from None


class WorkerAPI:
    """The workers' handlers over a `ConnectionPool` (`client.rpc`, `worker.rpc`).
    `connect_seconds`: how long a connection, its handshake included, may take before a
    `TimeoutError` (an OSError; None: `distributed.comm.timeouts.connect`);
    `reply_seconds`: how long a reply may take before a `TimeoutError` (an OSError: a lost
    worker to the callers) that names the worker (None: no bound)."""

    def __init__(self, rpc, connect_seconds: float | None = None, reply_seconds: float | None = None):
        self.rpc, self.connect_seconds, self.reply_seconds = rpc, connect_seconds, reply_seconds

    async def call(self, address: str, request: Message) -> Message | None:
        """The worker's reply to `request`; `Moved` for blocks it does not hold. A connection
        whose reply did not come (a timeout, a cancelled call) is closed, never reused."""
        comm = await connect_within(self.rpc, address, self.connect_seconds)
        loop = asyncio.get_running_loop()
        started = loop.time()
        try:
            reply = await asyncio.wait_for(send_recv(comm, op=OPS[type(request)], **to_wire(request)),
                                           self.reply_seconds)
        except asyncio.TimeoutError:
            if self.reply_seconds is None or loop.time() - started < self.reply_seconds:
                raise  # the worker's own TimeoutError (one it met asking another), sent back as its reply
            comm.abort()
            raise TimeoutError(f"worker {address} sent no reply to {OPS[type(request)]} within "
                               f"{self.reply_seconds:.0f} s: paused or hung?") from None
        except asyncio.CancelledError:  # its reply may come later: not for the next caller
            comm.abort()
            raise
        finally:
            self.rpc.reuse(address, comm)
        reply = None if reply is None else _MESSAGES[reply.pop("message")](**reply)
        if isinstance(reply, Missing):
            raise Moved(reply.keys)
        return reply

    async def channel(self, address: str) -> Channel:
        return await self.call(address, ChannelRequest())

    async def describe(self, address: str, keys: list[str]) -> dict[str, dict | None]:
        """Key -> its layout (`read_layout`: None when not mappable) of the blocks `address` holds."""
        blocks = (await self.call(address, DescribeRequest(keys))).blocks
        return {key: read_layout(found) for key, found in blocks.items()}

    async def count_hits(self, address: str, hits: dict[str, list[int]]) -> None:
        await self.call(address, HitsReport(hits))

    async def hand_over(self, address: str, blocks: dict[str, bytes], claim: str) -> list[str]:
        return (await self.call(address, HandOver(blocks, claim))).keys

    async def place_blocks(self, address: str, blocks: dict[str, bytes], claim: str, readers: bytes) -> dict[str, int]:
        return (await self.call(address, PlaceBlocks(blocks, claim, readers))).held

    async def give_rows(self, address: str, request: GiveRows) -> list[str]:
        return (await self.call(address, request)).keys
