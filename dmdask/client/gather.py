"""A group of batches assembled in the training process (docs/architecture.md section 3,
step 6): rows of blocks in files on this host taken from the mapped files, the others
asked of their holders. Every row comes from the block that holds it, at its position; a
block gone while mapped raises `Moved`; nothing here writes to a worker's files.
"""
from __future__ import annotations

import asyncio
import concurrent.futures
import contextlib
import os
import threading
import time
import weakref
from collections import defaultdict
from collections.abc import Collection
from typing import NamedTuple

import numpy as np
import zict
from distributed.comm import get_address_host

from ..protocol.scheduler import Layouts
from ..protocol.rows import RowChannels, RowsAsked, asked_of, fixed_layout
from ..protocol.worker import Moved, WorkerAPI
from ..recovery import reply_seconds
from ..shm.arena import ID_FIELD, ArenaMaps
from ..shm.fileblocks import map_arrays, readable, take_rows
from ..shm.memory import empty_batch
from ..source import parse_block_key
from ..threads import ForkSafeExecutor
from .arenas import LocalArenas

HITS_TIMEOUT = 2.0  # seconds a hit report may take (a worker that left does not answer)
CONNECT_SECONDS = 5.0  # a connection to a worker that takes longer: the worker is gone
LOAD_WAIT = 2.0  # seconds a holder may wait for a block it is loading before it answers "missing"
MAPPED_BLOCKS = 4096  # blocks kept mapped per process (each costs a mapping per field)


_reports_under_way: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()  # client -> its hit reports sent
_pool = ForkSafeExecutor(2, "dmdask-gather")
peer_threads = ForkSafeExecutor(16, "dmdask-peer")  # each receives one holder's rows at a time
fetchers = ForkSafeExecutor(4, "dmdask-fetch")  # warm groups asked of other hosts with no hop through the event loop
_channels: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()  # client -> its RowChannels


def channels_of(client) -> RowChannels:
    """The process's connections to the row channels of `client`'s workers."""
    found = _channels.get(client)
    if found is None:
        context = client.security.get_connection_args("client").get("ssl_context")
        found = _channels[client] = RowChannels(WorkerAPI(client.rpc, CONNECT_SECONDS, reply_seconds()), context,
                                                reply_seconds())
    return found


def _forget_channels() -> None:
    """In a forked child (a DataLoader worker): its own connections, made when first needed."""
    _channels.clear()


os.register_at_fork(after_in_child=_forget_channels)
copier = ForkSafeExecutor(1, "dmdask-copy")  # the warm batches of every iterator of the process


class _Mapped:
    """Per process: descriptions of blocks held in files on this host and their mappings."""

    def __init__(self):
        self.described: dict[tuple[str, str], dict | None] = {}  # (holder, key) -> description or None
        self._start()
        os.register_at_fork(after_in_child=self._start)

    def _start(self) -> None:
        """Also in a forked child: the locks (the LRU's too) made anew; the child maps again."""
        self.lock = threading.Lock()
        self.maps = zict.LRU(MAPPED_BLOCKS, {})  # path -> map_arrays(...), least recently used dropped

    def arrays(self, description: dict) -> dict:
        path = description["path"]
        with self.lock:
            found = self.maps.get(path)
        if found is None:
            found = map_arrays(description)  # FileNotFoundError once released
            with self.lock:
                self.maps[path] = found
        return found

    def forget(self, holder: str, keys) -> None:
        with self.lock:
            for key in keys:
                description = self.described.pop((holder, key), None)
                if description and "path" in description:
                    self.maps.pop(description["path"], None)


_mapped = _Mapped()


class FromFile(NamedTuple):
    """Rows taken from files on this host: of one block's files, or of several blocks of one arena."""

    description: dict  # the block's layout (`dmdask_describe`), or {"arena": fields, "tier": "ram"}
    rows: np.ndarray  # rows of the files
    where: np.ndarray  # their positions in the group
    holder: str
    keys: list[str]  # the blocks they belong to
    ids: np.ndarray | None  # their sample ids, checked against an arena's labels; None for a block's files


class Group:
    """The rows of one group of batches put in place from any thread: its arrays made when
    the first rows arrive (fixed-size fields in pooled memory, `empty_batch`). Rows of a
    holder that has the whole group, in order, are received straight into them; others
    are received, then put at their positions."""

    def __init__(self, n: int):
        self.n = n
        self.arrays: dict[str, np.ndarray] = {}
        self._lock = threading.Lock()

    def _made(self, layout: list[tuple[str, np.dtype, tuple]]) -> dict[str, np.ndarray]:
        with self._lock:
            if not self.arrays and layout:
                if all(dtype != object and dtype.kind != "T" for _, dtype, _ in layout):
                    self.arrays = empty_batch(tuple((f, d.str, s) for f, d, s in layout), self.n)
                else:
                    self.arrays = {f: np.empty((self.n,) + s, dtype=d) for f, d, s in layout}
            return self.arrays

    def put(self, where: np.ndarray, arrays: dict[str, np.ndarray]) -> None:
        out = self._made([(f, a.dtype, a.shape[1:]) for f, a in arrays.items()])
        for name, values in arrays.items():
            out[name][where] = values

    def receiving(self, asked: RowsAsked, where: np.ndarray):
        """The `place` (`RowChannels.exchange`) that receives the reply to `asked`, whose rows
        go to positions `where` of the group (ascending: the rows asked in group order)."""

        def place(fields: list, n: int, receive) -> None:
            layout = fixed_layout(fields)
            if layout is not None and n == self.n:  # the whole group, in order: straight into place
                receive(self._made([(f, np.dtype(d), s) for f, d, s in layout]))
            else:
                self.put(where, receive(None))

        return place


def in_group_order(wanted: dict[str, np.ndarray], where: np.ndarray, priority) -> tuple[RowsAsked, np.ndarray]:
    """(the request for a holder's rows `wanted` (block key -> offsets) at positions `where`
    of the group, asked in group order; those positions, ascending)."""
    asked = asked_of(wanted, priority, LOAD_WAIT)
    order = np.argsort(where, kind="stable")
    asked.blocks, asked.rows = asked.blocks[order], asked.rows[order]
    return asked, where[order]


class Gatherer:
    """Assembles groups of batches for one iterator, counting the rows taken from workers' files."""

    def __init__(self, client, my_host: str | None, arenas: dict[str, LocalArenas]):
        self.client = client
        self.workers = WorkerAPI(client.rpc, CONNECT_SECONDS)
        self._describer = WorkerAPI(client.rpc, CONNECT_SECONDS, reply_seconds())  # a paused holder: an OSError
        self.my_host = my_host
        self.arenas = arenas  # dataset identity -> its blocks in arenas on this host (a mixture has several)
        self.hits: dict[str, dict[str, list[int]]] = _counters()
        self._hits_lock = threading.Lock()
        self._last_flush = time.monotonic()

    def count(self, holder: str, tier: str, samples: int, nbytes: int) -> None:
        with self._hits_lock:
            counts = self.hits[holder][tier]
            counts[0] += samples
            counts[1] += nbytes

    def _remember(self, holder: str, key: str, description: dict) -> None:
        parsed = parse_block_key(key)
        local = self.arenas.get(parsed[0]) if parsed is not None else None
        if local is not None:
            local.remember(holder, description["arena"], [parsed[1]], [description["first_row"]])

    async def gather(self, plan: dict[str, dict[str, np.ndarray]], positions: dict[str, np.ndarray],
                     n: int, priority: int | None = None,
                     loading: Collection[str] = ()) -> tuple[dict[str, np.ndarray], int]:
        """(the group's rows, field by field, in group order; how many the holders read from the
        store for it). `plan`, `positions`: `plan_rows`; `priority`: the group's first batch's
        position (holders serve lower ones first); `loading`: keys asked for rows, not described."""
        local = self._local_holders(plan)
        await asyncio.gather(*(self._describe(h, [k for k in plan[h] if k not in loading]) for h in local))
        from_files, remote = self._sort(plan, positions, local)
        group = Group(n)
        loop = asyncio.get_running_loop()
        channels = channels_of(self.client)
        asked = {holder: in_group_order(wanted, where, priority) for holder, (wanted, where) in remote.items()}
        fetched = [channels.fetch(peer_threads, holder, request, group.receiving(request, where))
                   for holder, (request, where) in asked.items()]  # holders wait for blocks loading
        if from_files:  # rows of this host's files, in a thread while the holders answer
            fetched.append(loop.run_in_executor(_pool, self._take_files, from_files, group))
        replies = await asyncio.gather(*fetched)
        return group.arrays, sum(from_store for _, from_store in replies[:len(remote)])

    def _sort(self, plan, positions, local) -> tuple[list[FromFile], dict[str, tuple[dict, np.ndarray]]]:
        """(rows taken from files on this host: one take per arena, not per block; holder ->
        (block key -> rows, their positions) of the rows to ask of their holders)."""
        from_files: list[FromFile] = []
        from_arenas: dict[tuple, FromFile] = {}  # (holder, arena) -> its rows, one take per arena, not per block
        remote: dict[str, tuple[dict[str, np.ndarray], list[np.ndarray]]] = {}
        for holder, wanted in plan.items():
            offset = 0
            for key, rows in wanted.items():
                where = positions[holder][offset:offset + len(rows)]
                offset += len(rows)
                description = _mapped.described.get((holder, key)) if holder in local else None
                if description is not None and "arena" in description:
                    taken = from_arenas.setdefault((holder, description["arena"][ID_FIELD][0]), FromFile(
                        {"arena": description["arena"], "tier": "ram"}, [], [], holder, [], []))
                    taken.rows.append(description["first_row"] + rows)
                    taken.ids.append(description["start"] + rows)
                    taken.where.append(where)
                    taken.keys.append(key)
                    self._remember(holder, key, description)
                elif description is not None:
                    from_files.append(FromFile(description, rows, where, holder, [key], None))
                else:
                    asked, places = remote.setdefault(holder, ({}, []))
                    asked[key] = rows
                    places.append(where)
        from_files += [taken._replace(rows=np.concatenate(taken.rows), where=np.concatenate(taken.where),
                                      ids=np.concatenate(taken.ids)) for taken in from_arenas.values()]
        return from_files, {h: (asked, np.concatenate(places)) for h, (asked, places) in remote.items()}

    def gather_known(self, keys: list[str], holders: list[str], blocks: np.ndarray, offsets: np.ndarray,
                     priority: int | None = None) -> dict[str, np.ndarray] | None:
        """`gather` in the caller's thread, with no hop through the event loop, when the
        layouts of the blocks held on this host and the row channels of the other holders
        are known already: a group's rows are `keys[blocks[i]]`'s row `offsets[i]`, held by
        `holders[blocks[i]]`; each holder is asked for its rows in group order, with no
        per-block work. Rows of this host's files are taken in this thread (else one
        holder's rows received in it), the holders' received in `peer_threads` meanwhile.
        None when something is not known; raises what `gather` raises (the caller then
        fetches the group through `gather`, which recovers)."""
        n = len(blocks)
        index_of = {h: i for i, h in enumerate(dict.fromkeys(holders))}  # holder -> its number, in order met
        names = list(index_of)
        holder_of_block = np.fromiter(map(index_of.__getitem__, holders), dtype=np.int32, count=len(holders)) \
            if len(names) > 1 else None
        local = set(self._local_holders(names))
        channels = channels_of(self.client)
        from_files: list[FromFile] = []
        exchanges = []
        group = Group(n)
        for i, holder in enumerate(names):
            if holder_of_block is None:
                mine, rows = np.arange(len(keys)), np.arange(n)
            else:
                mine, rows = np.flatnonzero(holder_of_block == i), np.flatnonzero(holder_of_block[blocks] == i)
            if holder in local:  # taken from this host's files: their layouts must be known
                if any((holder, keys[b]) not in _mapped.described for b in mine.tolist()):
                    return None
                plan, positions = plan_rows(blocks[rows], offsets[rows], {b: keys[b] for b in mine.tolist()},
                                            dict.fromkeys((keys[b] for b in mine.tolist()), holder))
                taken, asked_of_holder = self._sort(plan, {holder: rows[positions[holder]]}, [holder])
                if asked_of_holder:  # blocks of this host not mapped here (another user's worker)
                    return None
                from_files += taken
                continue
            channel = channels.known(holder)
            if channel is None:
                return None
            index = np.zeros(len(keys), dtype=np.int32)
            index[mine] = np.arange(len(mine), dtype=np.int32)
            asked = RowsAsked(keys if holder_of_block is None else list(map(keys.__getitem__, mine.tolist())),
                              index[blocks[rows]], offsets[rows], priority, LOAD_WAIT)
            exchanges.append((holder, channel, asked, group.receiving(asked, rows)))
        here = None if from_files else exchanges.pop(0)  # one holder's rows received in this thread
        others = [peer_threads.submit(channels.exchange, *args) for args in exchanges]
        try:
            if from_files:
                self._take_files(from_files, group)
            else:
                channels.exchange(*here)
        finally:
            if others:
                for other in concurrent.futures.as_completed(others):
                    other.result()  # the first error is raised (once every exchange ended)
        return group.arrays

    def take_local(self, plan: dict[str, dict[str, np.ndarray]], positions: dict[str, np.ndarray],
                   n: int) -> dict[str, np.ndarray] | None:
        """`gather` in the caller's thread, with no request, when every block of `plan` is in
        files on this host described already; None otherwise. Raises `Moved` like `gather`."""
        from_files = []
        for holder, wanted in plan.items():
            if get_address_host(holder) != self.my_host:
                return None
            offset = 0
            for key, rows in wanted.items():
                description = _mapped.described.get((holder, key))
                if description is None or "path" not in description:
                    return None
                from_files.append(FromFile(description, rows, positions[holder][offset:offset + len(rows)], holder,
                                           [key], None))
                offset += len(rows)
        group = Group(n)
        self._take_files(from_files, group)
        return group.arrays

    def _local_holders(self, holders) -> list[str]:
        return [h for h in holders if get_address_host(h) == self.my_host]

    def learn(self, identity: str, layouts: dict[str, Layouts]) -> None:
        """Blocks of the dataset `identity` on this host as their holders described them
        (`Ready.layouts`): those in arenas remembered (`LocalArenas`), the others kept."""
        local = self.arenas.get(identity)
        for holder in self._local_holders(layouts):
            self._keep(holder, layouts[holder].files)
            for taken in layouts[holder].arenas if local is not None else ():
                local.remember(holder, taken.arena, taken.blocks, taken.first_rows)

    async def describe(self, keys: dict[str, list[str]]) -> None:
        """Learn the file layout of blocks (holder -> keys) held on this host."""
        await asyncio.gather(*(self._describe(h, keys[h]) for h in self._local_holders(keys)))

    async def _describe(self, holder: str, keys: list[str]) -> None:
        unknown = [k for k in keys if (holder, k) not in _mapped.described]
        if unknown:
            self._keep(holder, await self._describer.describe(holder, unknown))

    @staticmethod
    def _keep(holder: str, described: dict[str, dict | None]) -> None:
        """Descriptions of blocks held (a block not held yet, still loading, is asked of again next time)."""
        with _mapped.lock:
            for key, found in described.items():  # a worker of another user's: its rows come by request
                _mapped.described[(holder, key)] = found if readable(found) else None

    def _take_files(self, from_files: list[FromFile], group: Group) -> None:
        """Runs in a thread: take the rows of mapped blocks and put them in place."""
        for description, rows, where, holder, keys, ids in from_files:
            try:
                if "arena" in description:
                    arrays = ArenaMaps.shared.take_rows(description["arena"], rows, ids)
                else:
                    arrays = take_rows(_mapped.arrays(description), rows)
            except FileNotFoundError:  # released, moved, or its worker is gone
                _mapped.forget(holder, keys)
                if "arena" in description:
                    for path, _, _ in description["arena"].values():
                        ArenaMaps.shared.forget(path)
                    for local in self.arenas.values():
                        local.forget()
                raise Moved(keys) from None
            group.put(where, arrays)
            self.count(holder, description["tier"], len(rows),
                       sum(a.nbytes for a in arrays.values() if a.dtype != object))

    def has_hits(self) -> bool:
        return bool(self.hits)

    def due(self, seconds: float) -> bool:
        """Whether hits wait to be reported and the last report is `seconds` old."""
        return bool(self.hits) and time.monotonic() - self._last_flush >= seconds

    def flush_hits_every(self, seconds: float) -> None:
        """On the event loop: report the hits in the background, at most every `seconds`."""
        if self.due(seconds):
            self._last_flush = time.monotonic()
            asyncio.ensure_future(self.flush_hits())

    def report_hits(self) -> None:
        """From any thread: report the hits not yet reported, without waiting for the workers
        (`wait_reported` waits for them)."""
        loop = self.client.loop.asyncio_loop
        if not self.hits or loop.is_closed():  # counters only: a closed client's are dropped
            return
        future = asyncio.run_coroutine_threadsafe(self.flush_hits(), loop)
        under_way = _reports_under_way.setdefault(self.client, set())
        under_way.add(future)
        future.add_done_callback(under_way.discard)

    async def flush_hits(self) -> None:
        """Report the rows taken from workers' files to those workers (best effort)."""
        with self._hits_lock:
            hits, self.hits = self.hits, _counters()

        async def report(holder, tiers):
            with contextlib.suppress(Exception):  # counters only; never wait long for a worker that left
                await asyncio.wait_for(self.workers.count_hits(holder, {t: list(c) for t, c in tiers.items()}),
                                       HITS_TIMEOUT)

        await asyncio.gather(*(report(holder, tiers) for holder, tiers in hits.items()))


def wait_reported(client, timeout: float = HITS_TIMEOUT) -> None:
    """Wait until the hit reports this process sent through `client` are received (each is
    given up after `HITS_TIMEOUT`)."""
    concurrent.futures.wait(_reports_under_way.get(client, set()).copy(), timeout)


def plan_rows(blocks: np.ndarray, offsets: np.ndarray, keys: dict[int, str], holders: dict[str, str]):
    """What `Gatherer.gather` takes: holder -> block key -> rows (`offsets` in their
    blocks), and holder -> the rows' positions in the group, in the same order."""
    by_block = np.argsort(blocks, kind="stable")
    uniq, starts = np.unique(blocks[by_block], return_index=True)
    groups = np.split(by_block, starts[1:])
    plan: dict[str, dict[str, np.ndarray]] = {}
    positions: dict[str, list[np.ndarray]] = {}
    for k, members in zip(uniq.tolist(), groups):
        key = keys[k]
        holder = holders[key]
        plan.setdefault(holder, {})[key] = offsets[members]
        positions.setdefault(holder, []).append(members)
    return plan, {h: np.concatenate(p) for h, p in positions.items()}


def _counters():
    return defaultdict(lambda: defaultdict(lambda: [0, 0]))  # holder -> tier -> [samples, bytes]

