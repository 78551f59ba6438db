"""`RowServer`: a worker's end of the row channel (`dmdask.protocol.rows`). A thread per
connection reads a request, takes its rows and writes them back, off the worker's event
loop: rows of one arena (the RAM tier of fixed-size fields) with one vectorised take per
field straight into the connection's send buffer; rows of other blocks in files with one
take per block; rows that need the store or a block still loading through the event loop
(`BlockCache.serve`), as before. Guarantees: a reply holds every row asked, in the order
asked, or names the blocks not held (`Moved`), or carries the error (a `ValueError` for
rows outside their block, a `HandlerArgumentError` for a malformed request); rows of a
block released while they were taken are never sent (the arena's labels are checked
after the copy); only a connection that starts with the worker's secret is served.
"""
from __future__ import annotations

import asyncio
import concurrent.futures
import hmac
import logging
import secrets
import socket
import threading
import time
from collections.abc import Callable
from operator import attrgetter
from typing import NamedTuple

import numpy as np

from .. import arguments as check
from ..errors import HandlerArgumentError
from ..protocol.pieces import Pieces
from ..protocol.rows import (MAX_ROWS, Buffer, RowsAsked, describe_fields, error_header, recv_header,
                             recv_into, send_frame)
from ..protocol.worker import MAX_WAIT, Channel, Moved
from ..recovery import reply_seconds
from ..shm.arena import ID_FIELD, ArenaMaps
from .holdings import ArenaBlock, FileBlock, concat, payload_bytes

logger = logging.getLogger(__name__)
ZERO_COPY_ROW_BYTES = 2 << 10  # fields of rows at least this large are sent from the arena's pages (`Pieces`)
_ARENA, _SLOT = attrgetter("arena"), attrgetter("slot")  # of ArenaBlocks, in map()
_START, _STOP = attrgetter("start"), attrgetter("stop")  # of any Holding
HELLO_SECONDS = 10.0  # a connection that does not say the secret in time is closed
OP = "dmdask row channel"


class RowServer:
    """Serves the rows of `cache` (a `BlockCache`) on a port of `host`; TLS with `ssl_context`."""

    def __init__(self, cache, host: str, ssl_context=None, ports: str | int = 0):
        self.cache, self.ssl_context = cache, ssl_context
        self._listener = listen(host, ports)
        self.channel = Channel(host, self._listener.getsockname()[1], secrets.token_hex(16))
        self._connections: set[socket.socket] = set()
        self._lock = threading.Lock()
        self._closed = False
        self._threads = [threading.Thread(target=self._accept, name="dmdask-rows-accept", daemon=True)]
        self._threads[0].start()

    def _accept(self) -> None:
        while True:
            try:
                conn, _ = self._listener.accept()
            except OSError:  # closed
                return
            thread = threading.Thread(target=self._serve, args=(conn,), name="dmdask-rows", daemon=True)
            with self._lock:
                self._threads = [t for t in self._threads if t.is_alive()] + [thread]
            thread.start()

    def _serve(self, conn: socket.socket) -> None:
        with self._lock:
            if self._closed:
                conn.close()
                return
            self._connections.add(conn)
        try:
            conn.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
            conn.settimeout(HELLO_SECONDS)
            if self.ssl_context is not None:
                conn = self.ssl_context.wrap_socket(conn, server_side=True)
            hello = recv_header(conn)
            if not hmac.compare_digest(str(hello.get("secret", "")).encode(), self.channel.secret.encode()):
                logger.warning("closed a row-channel connection without this worker's secret")
                return
            conn.settimeout(None)
            buffer = Buffer()
            while True:
                header = recv_header(conn)
                try:
                    asked = read_request(header, lambda view: recv_into(conn, view))
                except HandlerArgumentError as exc:  # its payload cannot be skipped: answer, then close
                    header, buffers = error_header(exc)
                    send_frame(conn, {**header, "closing": True}, buffers)
                    return
                reply = self.answer(asked, buffer, zero_copy=self.ssl_context is None)
                send_frame(conn, reply.header, reply.buffers)
                if reply.header["status"] == "rows":  # the trailer: rows that turned out not held
                    send_frame(conn, {"moved": reply.moved() if reply.moved is not None else []})
        except (OSError, ValueError):  # the caller left, or sent what is not a request: drop it
            pass
        except Exception:  # noqa: BLE001 - never let a connection's thread take the worker down
            logger.exception("row channel connection failed")
        finally:
            with self._lock:
                self._connections.discard(conn)
            conn.close()

    def answer(self, asked: RowsAsked, buffer: Buffer, zero_copy: bool = False) -> Reply:
        """The reply to a request (`zero_copy`: its rows may be sent from the arena itself)."""
        try:
            reply = self.rows(asked, buffer, zero_copy)
        except Moved as exc:
            return Reply({"status": "missing", "keys": exc.keys}, [])
        except Exception as exc:  # noqa: BLE001 - sent to the caller, raised there
            return Reply(*error_header(exc))
        with self._lock:
            self.cache.peer_bytes_out += sum(size for *_, size in reply.header["fields"])
            self.cache.peer_requests += 1
        return reply

    def rows(self, asked: RowsAsked, buffer: Buffer, zero_copy: bool = False) -> Reply:
        """The reply holding the rows asked, field by field in the order asked. `Moved` for
        blocks not held."""
        held = self.cache.store.holdings(asked.keys)  # per key, only C-level loops: up to a key a row
        kinds = set(map(type, held))
        if held and kinds <= {ArenaBlock, FileBlock}:
            starts = np.fromiter(map(_START, held), dtype=np.int64, count=len(held))
            check_offsets(asked, np.fromiter(map(_STOP, held), dtype=np.int64, count=len(held)) - starts)
            try:
                if kinds == {ArenaBlock} and len(set(map(_ARENA, held))) == 1:
                    return self._from_arena(asked, held, starts, buffer, zero_copy)
                return _rows_reply(self._from_files(asked, held), 0)
            except OSError:  # files gone or unreadable: the event loop's path reads them again
                pass
        return _rows_reply(*self._on_loop(asked))

    def _from_arena(self, asked: RowsAsked, held: list[ArenaBlock], start: np.ndarray, buffer: Buffer,
                    zero_copy: bool) -> Reply:
        """Rows of one arena: fields of large rows sent from the arena's pages themselves
        (`sendmsg`: the kernel's copy is the only one), the others taken into `buffer` with
        one `np.take` per field. Labels are checked before sending when every field was
        taken, else once sent (the trailer names the blocks released meanwhile). `start`:
        each block's first sample."""
        arena, n = held[0].arena, len(asked.rows)
        first_row = np.fromiter(map(_SLOT, held), dtype=np.int64, count=len(held)) * arena.block_len
        rows = first_row[asked.blocks] + asked.rows
        needed = int(rows.max()) + 1 if n else 0
        maps = ArenaMaps.shared
        fields = {name: (maps.rows(path, dtype, shape, needed), np.dtype(dtype).itemsize * int(np.prod(shape)))
                  for name, (path, dtype, shape) in arena.fields.items() if name != ID_FIELD}

        def moved() -> list[str]:
            wrong = maps.rows(*arena.fields[ID_FIELD], needed)[rows] != start[asked.blocks] + asked.rows
            return [asked.keys[b] for b in np.unique(asked.blocks[wrong]).tolist()] if wrong.any() else []

        header = {"status": "rows", "from_store": 0,
                  "fields": [[name, "fixed", values.dtype.str, list(values.shape[1:]), n * row_bytes]
                             for name, (values, row_bytes) in fields.items()]}
        self.cache.store.count_hit("ram", n, sum(n * row_bytes for _, row_bytes in fields.values()))
        zero_copy = zero_copy and n and max(row_bytes for _, row_bytes in fields.values()) >= ZERO_COPY_ROW_BYTES
        if zero_copy:  # runs of consecutive rows: one view each
            cuts = np.flatnonzero(np.diff(rows) != 1) + 1
            firsts, lengths = rows[np.r_[0, cuts]], np.diff(np.r_[0, cuts, n])
        sent_from_arena = {name for name, (_, row_bytes) in fields.items() if zero_copy and row_bytes >= ZERO_COPY_ROW_BYTES}
        memory = buffer.view(sum(n * row_bytes for name, (_, row_bytes) in fields.items() if name not in sent_from_arena))
        at, out = 0, []
        for name, (values, row_bytes) in fields.items():
            if name in sent_from_arena:
                out.append(Pieces(values, firsts * row_bytes, lengths * row_bytes))
                continue
            target = memory[at:at + n * row_bytes].view(values.dtype).reshape((n,) + values.shape[1:])
            np.take(values, rows, axis=0, out=target, mode="clip")
            out.append(target)
            at += n * row_bytes
        if zero_copy:  # labels checked once sent: the trailer names the blocks released meanwhile
            return Reply(header, out, moved)
        gone = moved()  # released (and reused) while taken
        if gone:
            raise Moved(gone)
        return Reply(header, out)

    def _from_files(self, asked: RowsAsked, held: list) -> dict[str, np.ndarray]:
        """One take per block (files mapped by this worker), put in the order asked."""
        order = np.argsort(asked.blocks, kind="stable")
        sorted_blocks = asked.blocks[order]
        cuts = np.searchsorted(sorted_blocks, np.arange(len(held) + 1))
        parts = []
        for b, holding in enumerate(held):
            mine = order[cuts[b]:cuts[b + 1]]
            if len(mine):
                taken = holding.take(asked.rows[mine])
                self.cache.store.count_hit(holding.tier, len(mine), payload_bytes(taken))
                parts.append(taken)
        return _in_order({f: concat([p[f] for p in parts]) for f in parts[0]}, order)

    def _on_loop(self, asked: RowsAsked) -> tuple[dict[str, np.ndarray], int]:
        """Through the event loop (`BlockCache.serve`: waits for loads, reads the store)."""
        order = np.argsort(asked.blocks, kind="stable")
        sorted_blocks = asked.blocks[order]
        cuts = np.searchsorted(sorted_blocks, np.arange(len(asked.keys) + 1))
        by_key = {asked.keys[b]: asked.rows[order[cuts[b]:cuts[b + 1]]]
                  for b in range(len(asked.keys)) if cuts[b + 1] > cuts[b]}
        priority = float("inf") if asked.priority is None else float(asked.priority)
        served = asyncio.run_coroutine_threadsafe(self.cache.serve(by_key, priority, asked.wait),
                                                  self.cache.worker.loop.asyncio_loop)
        seconds = reply_seconds()  # as long as the caller waits for it
        try:
            arrays, from_store = served.result(seconds)
        except concurrent.futures.TimeoutError:
            served.cancel()
            raise TimeoutError(f"rows of {len(by_key)} blocks not served within {seconds:.0f} s (half "
                               "dmdask.client.recovery-seconds): the worker's event loop or store reads are stuck") \
                from None
        return _in_order(arrays, order), from_store

    def close(self) -> None:
        """Stop listening and end every connection (a reply being written is cut off:
        its caller sees a lost worker); waits for the threads, at most 2 s in all."""
        with self._lock:
            self._closed = True
            connections, threads = list(self._connections), list(self._threads)
        for sock in [self._listener, *connections]:
            try:
                sock.shutdown(socket.SHUT_RDWR)  # wakes a thread blocked in accept or recv
            except OSError:
                pass
        self._listener.close()
        deadline = time.monotonic() + 2.0
        for thread in threads:
            thread.join(max(0.0, deadline - time.monotonic()))


class Reply(NamedTuple):
    """A reply: its header, the buffers that follow it, and for rows sent before their
    labels were checked, `moved()`: the blocks released meanwhile (the trailer)."""
    header: dict
    buffers: list
    moved: Callable[[], list[str]] | None = None


def _rows_reply(arrays: dict[str, np.ndarray], from_store: int) -> Reply:
    fields, buffers = describe_fields(arrays)
    return Reply({"status": "rows", "fields": fields, "from_store": from_store}, buffers)


def _in_order(arrays: dict[str, np.ndarray], order: np.ndarray) -> dict[str, np.ndarray]:
    """Rows taken in `order` (row i of `arrays` is the row asked at `order[i]`) put back in the order asked."""
    if len(order) and not (order[1:] > order[:-1]).all():
        inverse = np.empty_like(order)
        inverse[order] = np.arange(len(order))
        return {f: a[inverse] for f, a in arrays.items()}
    return arrays


def listen(host: str, ports: str | int) -> socket.socket:
    """A listening socket on `host` at `ports` (`dmdask.worker.row-port`: 0, any free port;
    a port; "first:last", the first free one of that range); OSError naming the range
    when none is free, ValueError for a setting that is no port."""
    try:
        first, _, last = str(ports).partition(":")
        first, last = int(first), int(last or first)
    except ValueError:
        raise ValueError(f"dmdask.worker.row-port={ports!r} is not a port: give 0 (any free port), a port such as "
                         f"50000, or a range such as '50000:50100'") from None
    if not (0 <= first <= last <= 65535):
        raise ValueError(f"dmdask.worker.row-port={ports!r} is not a port range within 0..65535")
    family = socket.AF_INET6 if ":" in host else socket.AF_INET
    for port in range(first, last + 1):
        try:
            return socket.create_server((host, port), family=family, backlog=128)
        except OSError as exc:
            error = exc
    raise OSError(f"no free port for the row channel on {host} in dmdask.worker.row-port={ports!r}: {error}")


def read_request(header: dict, receive) -> RowsAsked:
    """The request of `header` with its payload read by `receive`; `HandlerArgumentError`
    naming what is wrong (the connection is then closed: its payload cannot be skipped)."""
    if not isinstance(header, dict):
        raise check.refuse(OP, "request", "a dict", type(header).__name__)
    keys = check.texts(OP, "keys", header.get("keys"))
    if len(set(keys)) != len(keys):
        raise check.refuse(OP, "keys", "distinct block keys", keys[:4])
    n = check.count(OP, "n", header.get("n"), 0, MAX_ROWS)
    priority = header.get("priority")
    if priority is not None:
        check.number(OP, "priority", priority, 0, float("inf"))
    wait = check.number(OP, "wait", header.get("wait", 0.0), 0, MAX_WAIT)
    blocks, rows = np.empty(n, dtype=np.int32), np.empty(n, dtype=np.int64)
    receive(memoryview(blocks))
    receive(memoryview(rows))
    if n and (blocks.min() < 0 or blocks.max() >= len(keys)):
        raise check.refuse(OP, "blocks", f"indices into the {len(keys)} keys", blocks[(blocks < 0) |
                                                                                       (blocks >= len(keys))][:4])
    return RowsAsked(keys, blocks, rows, priority, float(wait))


def check_offsets(asked: RowsAsked, lengths: np.ndarray) -> None:
    """ValueError naming the first block with rows that are not offsets inside it."""
    limit = lengths[asked.blocks]
    bad = (asked.rows < 0) | (asked.rows >= limit)
    if bad.any():
        b = int(asked.blocks[bad][0])
        offsets = np.unique(asked.rows[bad & (asked.blocks == b)])
        more = f" and {len(offsets) - 8} more" if len(offsets) > 8 else ""
        raise ValueError(f"rows of block {asked.keys[b]} must be offsets in 0..{lengths[b] - 1}; "
                         f"got {offsets[:8].tolist()}{more}")
