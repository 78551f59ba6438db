"""A training process assembles its batches itself: rows of blocks held in files on its
own host (shared memory for the RAM tier, the SSD) are taken by indexing the mapped
files, with no request, pickle or worker event loop (one indexing per field and worker
for the RAM blocks of a dataset, which share an arena); only rows held on other hosts, or
in no file (blocks filling or streamed), are asked for, one request per holder per
group of batches.

Guarantees: every row comes from the block that holds it, placed at its position in
the group; a block released (or whose worker went away) while mapped raises `Moved`,
so the caller locates it again; nothing here ever writes to a worker's files.
"""
from __future__ import annotations

import asyncio
import concurrent.futures
import threading
import time
from collections import OrderedDict, defaultdict
from typing import Dict, List, Optional, Tuple

import numpy as np
from distributed.protocol.serialize import to_serialize

from ..source import parse_block_key
from ..worker.arena import ArenaMaps
from ..worker.holdings import map_arrays, take_rows

MAPPED_BLOCKS = 4096  # blocks kept mapped per process (each costs a mapping per field)
_pool = concurrent.futures.ThreadPoolExecutor(2, thread_name_prefix="dmdask-gather")


class Moved(Exception):
    """Blocks are no longer where they were located (released, recomputed elsewhere)."""

    def __init__(self, keys):
        self.keys = list(keys)
        super().__init__(f"blocks moved: {self.keys[:3]}")


class _Mapped:
    """Per process: descriptions of blocks held in files on this host and their mappings."""

    def __init__(self):
        self.lock = threading.Lock()
        self.described: Dict[Tuple[str, str], Optional[dict]] = {}  # (holder, key) -> description or None
        self.maps: "OrderedDict[str, dict]" = OrderedDict()  # path -> map_arrays(...)

    def arrays(self, description: dict) -> dict:
        path = description["path"]
        with self.lock:
            found = self.maps.get(path)
            if found is not None:
                self.maps.move_to_end(path)
                return found
        mapped = map_arrays(description)  # FileNotFoundError once released
        with self.lock:
            self.maps[path] = mapped
            while len(self.maps) > MAPPED_BLOCKS:
                self.maps.popitem(last=False)
        return mapped

    def forget(self, holder: str, keys) -> None:
        with self.lock:
            for key in keys:
                description = self.described.pop((holder, key), None)
                if description:
                    self.maps.pop(description["path"], None)


_mapped = _Mapped()


class Gatherer:
    """Assembles groups of batches for one iterator; counts the rows it took from
    workers' files itself and reports them to those workers (`flush_hits`)."""

    def __init__(self, client, my_host: Optional[str], num_blocks: int):
        self.client = client
        self.my_host = my_host
        # The steady state: blocks held in arenas on this host, found without a per-block step.
        self._arena_of = np.full(num_blocks, -1, dtype=np.int32)  # block -> index into self._arenas
        self._first_row = np.zeros(num_blocks, dtype=np.int64)  # block -> its first row in the arena
        self._arenas: List[Tuple[str, dict]] = []  # (holder, description without first_row)
        self._arena_index: Dict[tuple, int] = {}
        self.hits: Dict[str, Dict[str, List[int]]] = _counters()
        self._hits_lock = threading.Lock()
        self._last_flush = time.monotonic()

    def knows(self, blocks: np.ndarray) -> bool:
        """Whether every block is in a known arena on this host (`gather_known` applies)."""
        return bool(len(blocks)) and bool((self._arena_of[blocks] >= 0).all())

    async def gather_known(self, blocks: np.ndarray, offsets: np.ndarray) -> Dict[str, np.ndarray]:
        """The group's rows when `knows(blocks)`: one take per field and arena."""
        arena = self._arena_of[blocks]
        rows = self._first_row[blocks] + offsets
        return await asyncio.get_running_loop().run_in_executor(_pool, self._assemble_known, arena, rows)

    def _assemble_known(self, arena: np.ndarray, rows: np.ndarray) -> Dict[str, np.ndarray]:
        out: Dict[str, np.ndarray] = {}
        arenas = np.unique(arena).tolist()
        if len(arenas) == 1:  # one worker holds them all (one worker per node): one copy, into place
            holder, description = self._arenas[arenas[0]]
            try:
                out = ArenaMaps.shared.take(description, rows)
            except FileNotFoundError:
                self.forget_arenas()
                raise Moved([holder]) from None
            with self._hits_lock:
                count = self.hits[holder]["ram"]
                count[0] += len(rows)
                count[1] += sum(a.nbytes for a in out.values())
            return out
        for a in arenas:
            where = np.flatnonzero(arena == a)
            holder, description = self._arenas[a]
            try:
                arrays = ArenaMaps.shared.take(description, rows[where])
            except FileNotFoundError:
                self.forget_arenas()
                raise Moved([holder]) from None
            for name, values in arrays.items():
                if name not in out:
                    out[name] = np.empty((len(rows),) + values.shape[1:], dtype=values.dtype)
                out[name][where] = values
            with self._hits_lock:
                count = self.hits[holder]["ram"]
                count[0] += len(where)
                count[1] += sum(a.nbytes for a in arrays.values())
        return out

    def forget_arenas(self) -> None:
        """After a move: find every block's place again."""
        for _, description in self._arenas:
            for path, _, _ in description["arena"].values():
                ArenaMaps.shared.forget(path)
        self._arena_of[:] = -1
        self._arenas.clear()
        self._arena_index.clear()

    def _remember(self, holder: str, key: str, description: dict) -> None:
        parsed = parse_block_key(key)
        if parsed is None or parsed[1] >= len(self._arena_of):
            return
        arena = {**description, "first_row": 0}
        ident = (holder, next(iter(description["arena"].values()))[0])
        if ident not in self._arena_index:
            self._arena_index[ident] = len(self._arenas)
            self._arenas.append((holder, arena))
        self._arena_of[parsed[1]] = self._arena_index[ident]
        self._first_row[parsed[1]] = description["first_row"]

    async def gather(self, plan: Dict[str, Dict[str, np.ndarray]], positions: Dict[str, np.ndarray],
                     n: int) -> Dict[str, np.ndarray]:
        """The group's rows, field by field, in group order. `plan`: holder -> block key ->
        rows; `positions`: holder -> where those rows go (in the same order)."""
        local = [h for h in plan if _host(h) == self.my_host]
        await asyncio.gather(*(self._describe(h, list(plan[h])) for h in local))
        from_files: List[tuple] = []  # (description, rows, positions, holder, key)
        from_arenas: Dict[tuple, tuple] = {}  # (holder, arena) -> (description, [rows], [positions], [keys])
        remote: Dict[str, Tuple[Dict[str, np.ndarray], List[np.ndarray]]] = {}
        for holder, wanted in plan.items():
            offset = 0
            for key, rows in wanted.items():
                where = positions[holder][offset:offset + len(rows)]
                offset += len(rows)
                description = _mapped.described.get((holder, key)) if holder in local else None
                if description is not None and "arena" in description:  # one take per arena, not per block
                    arena = (holder, next(iter(description["arena"].values()))[0])
                    _, arena_rows, places, arena_keys = from_arenas.setdefault(arena, (description, [], [], []))
                    arena_rows.append(description["first_row"] + rows)
                    places.append(where)
                    arena_keys.append(key)
                    self._remember(holder, key, description)
                elif description is not None:
                    from_files.append((description, rows, where, holder, key))
                else:
                    asked, places = remote.setdefault(holder, ({}, []))
                    asked[key] = rows
                    places.append(where)
        replies = await asyncio.gather(*(self._rows(h, asked) for h, (asked, _) in remote.items()))
        parts = [(np.concatenate(places), rows) for (_, places), rows in zip(remote.values(), replies)]
        loop = asyncio.get_running_loop()
        for (holder, _), (description, arena_rows, places, arena_keys) in from_arenas.items():
            from_files.append(({**description, "first_row": 0}, np.concatenate(arena_rows), np.concatenate(places),
                               holder, arena_keys))
        return await loop.run_in_executor(_pool, self._assemble, from_files, parts, n)

    async def _describe(self, holder: str, keys: List[str]) -> None:
        unknown = [k for k in keys if (holder, k) not in _mapped.described]
        if unknown:
            reply = await self.client.rpc(holder).dmdask_describe(keys=unknown)
            with _mapped.lock:
                for key in unknown:
                    _mapped.described[(holder, key)] = reply.get(key)

    async def _rows(self, holder: str, wanted: Dict[str, np.ndarray]) -> Dict[str, np.ndarray]:
        reply = await self.client.rpc(holder).dmdask_rows(msg=to_serialize(wanted))
        if reply["status"] == "missing":
            raise Moved(reply["keys"])
        return reply["rows"]

    def _assemble(self, from_files, parts, n: int) -> Dict[str, np.ndarray]:
        """Runs in a thread: take the rows of mapped blocks and put every row in place."""
        for description, rows, where, holder, keys in from_files:
            try:
                if "arena" in description:
                    arrays = ArenaMaps.shared.take(description, rows)
                else:
                    arrays = take_rows(_mapped.arrays(description), rows)
            except FileNotFoundError:
                keys = keys if isinstance(keys, list) else [keys]
                _mapped.forget(holder, keys)
                for path, _, _ in (description.get("arena") or {}).values():
                    ArenaMaps.shared.forget(path)
                raise Moved(keys) from None
            parts.append((where, arrays))
            with self._hits_lock:
                count = self.hits[holder][description["tier"]]
                count[0] += len(rows)
                count[1] += sum(a.nbytes for a in arrays.values() if a.dtype != object)
        out: Dict[str, np.ndarray] = {}
        for where, arrays in parts:
            for name, values in arrays.items():
                if name not in out:
                    out[name] = np.empty((n,) + values.shape[1:], dtype=values.dtype)
                out[name][where] = values
        return out

    def has_hits(self) -> bool:
        return bool(self.hits)

    def flush_hits_every(self, seconds: float) -> None:
        """On the event loop: report the hits in the background, at most every `seconds`."""
        if self.hits and time.monotonic() - self._last_flush >= seconds:
            self._last_flush = time.monotonic()
            asyncio.ensure_future(self.flush_hits())

    async def flush_hits(self) -> None:
        """Report the rows taken from workers' files to those workers (best effort)."""
        with self._hits_lock:
            hits, self.hits = self.hits, _counters()
        for holder, tiers in hits.items():
            try:
                await self.client.rpc(holder).dmdask_count_hits(hits={t: list(c) for t, c in tiers.items()})
            except Exception:  # noqa: BLE001 - a worker that left has nothing to count
                pass


def _counters():
    return defaultdict(lambda: defaultdict(lambda: [0, 0]))  # holder -> tier -> [samples, bytes]


def _host(address: str) -> str:
    return address.split("://", 1)[-1].rsplit(":", 1)[0].strip("[]")
