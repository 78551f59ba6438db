"""The row channel: how a process takes rows of blocks that a worker on another host holds
(docs/architecture.md section 3, step 6). Dask's comm carries the control messages; rows
travel on a plain TCP (or TLS) connection of their own, read and written by blocking
threads that release the GIL, one copy per side:

- a request names the holder's blocks once (`keys`) and every row as (block, offset) in
  the order the rows take in the caller's group, so the reply can land in place;
- the reply is one header and each field's rows back to back: the worker takes them
  straight from its arenas into its send buffer, the caller receives them straight into
  its group's pooled memory (or, when other holders' rows interleave, into the
  connection's buffer and then into place).

A frame is an 8-byte little-endian length, a msgpack header of that length, then the
payload the header describes. A connection starts with the worker's secret, which only a
process that may call the worker's Dask handlers learns (`dmdask_channel`), so the channel
trusts whom Dask's comm trusts; it is TLS when the worker's comm is.
"""
from __future__ import annotations

import asyncio
import contextlib
import pickle
import socket
import ssl
import struct
import threading
import time
import weakref
from dataclasses import dataclass

import msgpack
import numpy as np

from .pieces import IOV_MAX, Pieces, byte_view, send_pieces
from .worker import Channel, Moved

HEADER = struct.Struct("<Q")
MAX_HEADER = 16 << 20  # bytes of a header (the keys of a request): more is not a dmdask peer
MAX_ROWS = 1 << 24  # rows of one request
CONNECT_SECONDS = 5.0  # a connection that takes longer: the worker is gone


@dataclass
class RowsAsked:
    """Rows of a holder's blocks for one group: `keys` once, then for each row its block
    (an index into `keys`) and its offset in that block, in the caller's order;
    `priority`: the position of the batch waiting (lower first; None: last); `wait`:
    seconds the holder may wait for blocks it is loading."""
    keys: list[str]
    blocks: np.ndarray
    rows: np.ndarray
    priority: float | None = None
    wait: float = 0.0


def asked_of(wanted: dict[str, np.ndarray], priority: float | None = None, wait: float = 0.0) -> RowsAsked:
    """The request for the rows `wanted` (block key -> offsets), in that order; ValueError
    naming the block whose offsets are not a 1-d array of integers."""
    for key, rows in wanted.items():
        if rows.ndim != 1 or (rows.size and rows.dtype.kind not in "iu"):
            raise ValueError(f"rows of block {key} must be a 1-d array of integer offsets, "
                             f"got {rows.dtype} of shape {rows.shape}")
    keys = list(wanted)
    blocks = np.repeat(np.arange(len(keys), dtype=np.int32), [len(rows) for rows in wanted.values()])
    rows = np.concatenate(list(wanted.values())).astype(np.int64, copy=False) if keys else np.zeros(0, np.int64)
    return RowsAsked(keys, blocks, rows, priority, wait)


# -- framing ------------------------------------------------------------------------------


def send_frame(sock: socket.socket, header: dict, buffers=()) -> None:
    """One frame: the header, then `buffers` (contiguous arrays, bytes, memoryviews, or
    `Pieces` of an arena) as they are, gathered by `sendmsg` (no copy into one buffer)
    where the socket has it."""
    head = msgpack.packb(header, use_bin_type=True)
    views = [memoryview(HEADER.pack(len(head)) + head)]
    for buffer in buffers:
        if isinstance(buffer, Pieces):
            _send_views(sock, views)
            send_pieces(sock, buffer)
            views = []
        else:
            view = byte_view(buffer) if isinstance(buffer, np.ndarray) else memoryview(buffer).cast("B")
            if view.nbytes:
                views.append(view)
    _send_views(sock, views)


def _send_views(sock: socket.socket, views: list) -> None:
    if isinstance(sock, ssl.SSLSocket):  # no sendmsg over TLS
        for view in views:
            sock.sendall(view)
        return
    at = 0
    while at < len(views):
        sent = sock.sendmsg(views[at:at + IOV_MAX])
        while sent:
            if sent >= views[at].nbytes:
                sent -= views[at].nbytes
                at += 1
            else:
                views[at], sent = views[at][sent:], 0


def recv_header(sock: socket.socket) -> dict:
    size = HEADER.unpack(bytes(recv_exactly(sock, HEADER.size)))[0]
    if size > MAX_HEADER:
        raise ConnectionError(f"a row-channel header of {size} bytes (at most {MAX_HEADER}): not a dmdask peer")
    return msgpack.unpackb(recv_exactly(sock, size), raw=False)


def recv_exactly(sock: socket.socket, nbytes: int) -> bytearray:
    buffer = bytearray(nbytes)
    recv_into(sock, memoryview(buffer))
    return buffer


def recv_into(sock: socket.socket, view: memoryview) -> None:
    """Fill `view` from the socket; ConnectionError if the peer closes first. On a blocking
    plain socket each call waits in the kernel for the whole view (`MSG_WAITALL`): one
    system call and one wake-up where a partial read would return each time data came."""
    view = view.cast("B")
    flags = socket.MSG_WAITALL if sock.gettimeout() is None and not isinstance(sock, ssl.SSLSocket) else 0
    while view.nbytes:
        got = sock.recv_into(view, 0, flags)
        if not got:
            raise ConnectionResetError("the row channel's peer closed the connection mid-message")
        view = view[got:]


# -- the reply's fields -------------------------------------------------------------------


def describe_fields(arrays: dict[str, np.ndarray]) -> tuple[list, list]:
    """(the reply header's field list, the buffers to send) for rows of `arrays`. A fixed
    field travels as its rows; a ragged one (an object array of per-sample arrays) as its
    sizes then its values; a string field as its UTF-8 sizes then bytes."""
    fields, buffers = [], []
    for name, values in arrays.items():
        if values.dtype == object or values.dtype.kind == "T":
            kind = "strings" if values.dtype.kind == "T" else "ragged"
            items = [v.encode() for v in values.tolist()] if kind == "strings" else list(values)
            sizes = np.fromiter((len(v) for v in items), dtype=np.int64, count=len(items))
            flat = (np.frombuffer(b"".join(items), dtype=np.uint8) if kind == "strings"
                    else np.concatenate(items) if items else np.zeros(0, np.uint8))
            fields.append([name, kind, flat.dtype.str, [], int(flat.nbytes)])
            buffers += [sizes, np.ascontiguousarray(flat)]
        else:
            fields.append([name, "fixed", values.dtype.str, list(values.shape[1:]), int(values.nbytes)])
            buffers.append(np.ascontiguousarray(values))
    return fields, buffers


def fixed_layout(fields: list) -> tuple | None:
    """The layout (`dmdask.shm.memory.Layout`) of a reply whose fields are all fixed; else None."""
    if any(kind != "fixed" for _, kind, _, _, _ in fields):
        return None
    return tuple((name, dtype, tuple(shape)) for name, _, dtype, shape, _ in fields)


def recv_fields(sock: socket.socket, fields: list, n: int, into: dict | None, buffer) -> dict[str, np.ndarray]:
    """The reply's `n` rows, field by field: fixed fields into `into` (arrays of `n` rows)
    when given, else into `buffer` (a `Buffer`, valid until its next use); ragged and
    string fields into new memory (their samples are views of one array)."""
    out = {}
    if into is None:
        scratch = buffer.view(sum(size for _, kind, _, _, size in fields if kind == "fixed"))
    at = 0
    for name, kind, dtype, shape, size in fields:
        if kind == "fixed":
            if into is not None:
                target = into[name]
            else:
                target = scratch[at:at + size].view(dtype).reshape((n,) + tuple(shape))
                at += size
            recv_into(sock, byte_view(target))
            out[name] = target
            continue
        sizes = np.empty(n, dtype=np.int64)
        recv_into(sock, memoryview(sizes))
        values = np.empty(size // np.dtype(dtype).itemsize, dtype=dtype)
        recv_into(sock, byte_view(values))
        bounds = np.concatenate([[0], np.cumsum(sizes)]).tolist()
        if kind == "strings":
            raw = values.tobytes()
            out[name] = np.array([raw[a:b].decode() for a, b in zip(bounds[:-1], bounds[1:])],
                                 dtype=np.dtypes.StringDType())
        else:
            column = np.empty(n, dtype=object)
            for i, (a, b) in enumerate(zip(bounds[:-1], bounds[1:])):
                column[i] = values[a:b]
            out[name] = column
    return out


def into_new(fields: list, n: int, receive) -> dict[str, np.ndarray]:
    """A `place` for `RowChannels.exchange`: the rows in new arrays of their own."""
    layout = fixed_layout(fields)
    if layout is not None:
        return receive({name: np.empty((n,) + shape, dtype=dtype) for name, dtype, shape in layout})
    return _copied(receive(None))


def _copied(arrays: dict[str, np.ndarray]) -> dict[str, np.ndarray]:
    """Arrays out of a connection's buffer (reused by its next reply) copied into memory of their own."""
    return {name: a if a.dtype == object or a.dtype.kind == "T" else a.copy() for name, a in arrays.items()}


class Buffer:
    """Reusable memory of one connection (grown, never shrunk)."""

    def __init__(self):
        self._memory = np.empty(0, dtype=np.uint8)

    def view(self, nbytes: int) -> np.ndarray:
        if len(self._memory) < nbytes:
            self._memory = np.empty(max(nbytes, 2 * len(self._memory)), dtype=np.uint8)
        return self._memory[:nbytes]


# -- errors ---------------------------------------------------------------------------------


def error_header(exc: BaseException) -> tuple[dict, list]:
    """A reply that raises `exc` in the caller (pickled, as Dask's comm sends errors)."""
    try:
        payload = pickle.dumps(exc)
    except Exception:  # noqa: BLE001 - an exception that does not pickle: its text
        payload = pickle.dumps(RuntimeError(f"{type(exc).__name__}: {exc}"))
    return {"status": "error", "nbytes": len(payload)}, [payload]


# -- the caller's side ------------------------------------------------------------------------


class RowChannels:
    """One process's connections to the workers' row channels (a caller's side: a training
    process, or a worker gathering for a transform). `api`: a `WorkerAPI` (to learn a
    channel); `ssl_context`: for workers whose comm is TLS (`tls://`); `timeout`:
    seconds a reply may take before the holder counts as lost (an OSError, which callers
    recover from as from any lost worker). Thread-safe; a forked child connects anew."""

    def __init__(self, api, ssl_context: ssl.SSLContext | None, timeout: float):
        self.api, self.ssl_context, self.timeout = api, ssl_context, timeout
        self._channels: dict[str, Channel] = {}
        self._idle: dict[str, list] = {}  # holder -> idle (socket, Buffer)
        self._busy: dict[str, weakref.WeakSet] = {}  # holder -> its connections waiting for a reply
        self._silent: dict[str, float] = {}  # holder -> until when it counts as lost (`_cut`)
        self._sending: dict[str, asyncio.Lock] = {}  # holder -> held while a request to it is sent (`fetch`)
        self._lock = threading.Lock()

    async def channel(self, holder: str) -> Channel:
        found = self._channels.get(holder)
        if found is None:
            if time.monotonic() < self._silent.get(holder, 0.0):  # asked again before its scheduler lets it go
                raise TimeoutError(f"worker {holder} left a request unanswered for {self.timeout:.0f} s: "
                                   "paused or hung?")
            found = self._channels[holder] = await self.api.channel(holder)
        return found

    def known(self, holder: str) -> Channel | None:
        """The channel of `holder` if learnt already (from any thread)."""
        return self._channels.get(holder)

    async def fetch(self, executor, holder: str, asked: RowsAsked, place=None) -> tuple:
        """Rows `asked` of `holder`, received in a thread of `executor` by `place` (see
        `exchange`; None: into new arrays): (what `place` returned, how many rows the
        holder read from the store for them). Requests to a holder leave in the order the
        calls were made (a cold rank's earliest batch first: the worker's reads serve
        the earliest batch first among those it has). The rest as `exchange`. `Moved` for blocks it
        does not hold; the holder's error (`BlockReadError`, `ValueError` for rows outside
        their block) raised as it was; OSError when the holder is gone or does not answer."""
        channel = await self.channel(holder)
        loop = asyncio.get_running_loop()
        async with self._sending.setdefault(holder, asyncio.Lock()):  # a holder gets requests in the order made
            sent = await loop.run_in_executor(executor, self._guarded, holder, self._send, holder, channel, asked)
        return await loop.run_in_executor(executor, self._guarded, holder, self._receive, holder, sent, asked,
                                          place or into_new)

    def exchange(self, holder: str, channel: Channel, asked: RowsAsked, place=None) -> tuple:
        """Blocking: send `asked`, then `place(fields, n, receive)` with the reply, where
        `receive(into)` reads the rows (`recv_fields`), once. The connection is reused once
        a whole reply was read, closed after any other failure."""
        sent = self._guarded(holder, self._send, holder, channel, asked)
        return self._guarded(holder, self._receive, holder, sent, asked, place or into_new)

    def _guarded(self, holder: str, step, *args):
        try:
            return step(*args)
        except (TimeoutError, BlockingIOError) as exc:  # nothing for `timeout` seconds (a blocking
            # socket's deadline is EAGAIN): a paused or hung holder, lost to the caller
            self.forget(holder)
            self._cut(holder)
            raise TimeoutError(f"worker {holder} sent no rows for {self.timeout:.0f} s: paused or hung?") from exc
        except OSError:
            self.forget(holder)
            raise

    def _send(self, holder: str, channel: Channel, asked: RowsAsked) -> tuple:
        """The request sent on a connection: (the socket, its buffer)."""
        sock, buffer = self._connection(holder, channel)
        with self._lock:
            self._busy.setdefault(holder, weakref.WeakSet()).add(sock)
        try:
            send_frame(sock, {"keys": asked.keys, "n": len(asked.rows), "priority": asked.priority,
                              "wait": asked.wait}, [np.ascontiguousarray(asked.blocks, dtype=np.int32),
                                                    np.ascontiguousarray(asked.rows, dtype=np.int64)])
        except BaseException:
            sock.close()
            raise
        return sock, buffer

    def _receive(self, holder: str, sent: tuple, asked: RowsAsked, place) -> tuple:
        sock, buffer = sent
        error = None
        try:
            header = recv_header(sock)
            status = header.get("status")
            if status == "rows":
                n = len(asked.rows)
                placed = place(header["fields"], n, lambda into: recv_fields(sock, header["fields"], n, into, buffer))
                moved = recv_header(sock)["moved"]  # the trailer: rows sent before their blocks were checked
                if moved:
                    error = Moved(moved)
            elif status == "missing":
                error = Moved(header["keys"])
            elif status == "error":
                error = pickle.loads(recv_exactly(sock, header["nbytes"]))
            else:
                raise ConnectionError(f"the row channel of {holder} answered {header!r}: not a dmdask peer")
        except BaseException:
            sock.close()
            raise
        if header.get("closing"):  # a refused request: the worker closes this connection
            sock.close()
        else:
            self._give_back(holder, sock, buffer)
        if error is not None:
            raise error
        return placed, int(header.get("from_store", 0))

    def _connection(self, holder: str, channel: Channel):
        with self._lock:
            idle = self._idle.get(holder)
            if idle:
                return idle.pop()
        sock = socket.create_connection((channel.host, channel.port), timeout=CONNECT_SECONDS)
        try:
            sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
            if holder.startswith("tls://"):
                if self.ssl_context is None:
                    raise ConnectionError(f"{holder} takes TLS, and this process has no TLS security configured")
                sock = self.ssl_context.wrap_socket(sock, server_hostname=channel.host)
            if isinstance(sock, ssl.SSLSocket):
                sock.settimeout(self.timeout)
            else:  # blocking, its deadlines kept by the kernel: no poll() before each call (`recv_into`)
                sock.settimeout(None)
                deadline = struct.pack("ll", int(self.timeout), int(self.timeout % 1 * 1e6))
                sock.setsockopt(socket.SOL_SOCKET, socket.SO_RCVTIMEO, deadline)
                sock.setsockopt(socket.SOL_SOCKET, socket.SO_SNDTIMEO, deadline)
            send_frame(sock, {"secret": channel.secret})
        except BaseException:
            sock.close()
            raise
        return sock, Buffer()

    def _give_back(self, holder: str, sock, buffer) -> None:
        with self._lock:
            self._busy.get(holder, set()).discard(sock)
            self._idle.setdefault(holder, []).append((sock, buffer))

    def _cut(self, holder: str) -> None:
        """A holder that let a request wait `timeout` seconds: the other requests waiting on
        it end now (a lost worker to their callers), not each after its own `timeout`, and
        for `timeout` seconds more it is not asked again (its scheduler lets it go meanwhile,
        `dmdask.scheduler.silent`: its blocks are located on the others)."""
        with self._lock:
            busy = list(self._busy.pop(holder, ()))
            self._silent[holder] = time.monotonic() + self.timeout
        for sock in busy:
            with contextlib.suppress(OSError):
                sock.shutdown(socket.SHUT_RDWR)

    def forget(self, holder: str) -> None:
        """A holder gone: learn its channel again next time, close its idle connections."""
        with self._lock:
            self._channels.pop(holder, None)
            idle = self._idle.pop(holder, [])
        for sock, _ in idle:
            sock.close()
