"""Byte ranges read through the cluster in transparent mode: the blocks holding them, their
holders, and their rows from same-host files or over Dask's comms.

Guarantees: a read returns the bytes of the file's dataset as identified when the file was
opened (size and version). A block the cluster does not have is registered and submitted
again; a block whose load failed is retried once per dataset, then its error is raised.
Every other fault (a worker lost, a block moved, no workers, the scheduler reconnecting) is
handled by the fetch engine the iterator uses (`dmdask.client.engine`), for at most
`dmdask.client.recovery-seconds`: then `NoWorkersError` when the cluster has no workers,
otherwise a RuntimeError naming the files.
"""
from __future__ import annotations

import contextlib

import dask.config
import numpy as np

from ..client.datasets import registered, submit_blocks
from ..client.engine import Exhausted, StillLoading, fetch_rows
from ..client.gather import Moved, plan_rows
from ..protocol.scheduler import Locate, SchedulerAPI
from ..source.files import ROW_BYTES
from .inside import out_of_the_pool

HITS_SECONDS = 1.0  # how often workers hear of the rows taken from their files
FOLDER_FILES = 10_000  # other files of a folder located along with the first one a process reads


class Blocks:
    """One process's reads of byte ranges and what it knows of block holders. Thread-safe."""

    def __init__(self, session, holders: dict[str, str]):
        self.session = session
        self.holders = dict(holders)  # block key -> a holder (a forked child keeps its parent's)
        self.located: set = set()  # folders whose files' first blocks this process located
        self.submitted: set = set()  # block keys whose loads this process submitted
        self.registered: set = set()  # datasets this process found or put in the registry
        self.retried: set = set()  # datasets whose erred blocks this process had retried

    def read_ranges(self, fs, ranges: list[tuple]) -> list[bytes]:
        """The bytes of each (source `FileSource`, start, stop; 0 <= start <= stop <= size),
        with one scheduler request for the blocks new to this process."""
        self.session.check_workers()
        cuts, wanted = [], {}
        for source, start, stop in ranges:
            if stop <= start:
                cuts.append(None)
                continue
            rows = np.arange(start // ROW_BYTES, -(-stop // ROW_BYTES), dtype=np.int64)
            blocks = rows // source.info.block_len
            keys = {k: source.info.block_key(k) for k in np.unique(blocks).tolist()}
            wanted.update({key: (source, k) for k, key in keys.items()})
            cuts.append((source, start, stop, rows, blocks, rows - blocks * source.info.block_len, keys))
        have = self.session.claims.first_reads(fs, wanted)
        # the rows of every range from blocks held by workers: one gather (keys numbered across files)
        number = {key: i for i, key in enumerate(k for k in wanted if k not in have)}
        held_blocks, held_offsets = [], []
        for cut in cuts:
            if cut is not None:
                blocks, offsets, keys = cut[4:]
                for b, offset in zip(blocks.tolist(), offsets.tolist()):
                    if keys[b] in number:
                        held_blocks.append(number[keys[b]])
                        held_offsets.append(offset)
        gathered = iter(self._gather(wanted, np.array(held_blocks, dtype=np.int64),
                                     np.array(held_offsets, dtype=np.int64), {i: k for k, i in number.items()})
                        if held_blocks else ())
        out = []
        for cut in cuts:
            if cut is None:
                out.append(b"")
                continue
            source, start, stop, rows, blocks, offsets, keys = cut
            data = [have[keys[b]]["data"][offset] if keys[b] in have else next(gathered)
                    for b, offset in zip(blocks.tolist(), offsets.tolist())]
            joined = data[0] if len(data) == 1 else np.concatenate(data)
            first = start - int(rows[0]) * ROW_BYTES
            out.append(joined[first:first + stop - start].tobytes())
        gatherer = self.session.gatherer
        if gatherer.due(HITS_SECONDS):
            self.session.client.loop.add_callback(gatherer.flush_hits_every, HITS_SECONDS)
        return out

    def _gather(self, wanted: dict[str, tuple], blocks: np.ndarray, offsets: np.ndarray,
                keys: dict[int, str]) -> np.ndarray:
        """Rows (block number, offset; `keys`: number -> block key; `wanted`: key ->
        (source, index)) from the blocks' holders, as an object array: taken in this thread
        from this host's files when every holder is known and described, else fetched by the
        fetch engine (`client.engine`, the iterator's) on the client's event loop."""
        session = self.session
        client, gatherer = session.client, session.gatherer
        holders = {k: self.holders.get(k) for k in keys.values()}
        if None not in holders.values():
            plan, positions = plan_rows(blocks, offsets, keys, holders)
            with contextlib.suppress(Moved):  # the engine locates it again
                arrays = gatherer.take_local(plan, positions, len(blocks))
                if arrays is not None:
                    return arrays["data"]
        recovery = float(dask.config.get("dmdask.client.recovery-seconds"))

        async def attempt(plan, positions, loading):
            return (await gatherer.gather(plan, positions, len(blocks), loading=loading))[0]["data"]

        def forget(known: list[str]) -> None:
            for key in known:
                self.holders.pop(key, None)

        async def holders_of(known: list[str]):
            return await self._holders(wanted, known)

        # a task's read may wait for loads queued on this very worker: out of its pool meanwhile
        with out_of_the_pool():
            try:
                return client.sync(fetch_rows, session.contact, keys, blocks, offsets, holders_of, forget, attempt,
                                   recovery)
            except StillLoading as exc:
                urls = sorted({wanted[k][0].info.url for k in keys.values()})
                raise RuntimeError(f"{', '.join(urls[:3])}: {exc.explain()}") from exc.__cause__
            except Exhausted as exc:
                urls = sorted({wanted[k][0].info.url for k in keys.values()})
                raise RuntimeError(f"{', '.join(urls[:3])}: blocks still failing after {recovery:.0f} s "
                                   f"({exc.tries} tries: {exc.what_failed()}; dmdask.client.recovery-seconds); is "
                                   "the cluster losing workers?") from exc.__cause__

    async def _holders(self, wanted: dict[str, tuple], keys: list[str]) -> tuple[dict[str, str], set]:
        """(a holder of each block of `keys` known now, no key loading), the others located
        once (`wanted`: key -> (source, index)): the engine's `holders_of`."""
        unknown = [k for k in keys if k not in self.holders]
        if unknown:
            await self._locate(wanted, unknown)
        return {k: self.holders[k] for k in keys if k in self.holders}, set()

    async def _locate(self, wanted: dict[str, tuple], unknown: list[str]) -> None:
        """One locate of the blocks `unknown`: holders learnt, erred loads retried once
        (then their error raised), blocks the cluster lacks registered and submitted."""
        session = self.session
        client = session.client
        sources = {wanted[k][0].info.name: wanted[k][0] for k in unknown}
        checked = set(sources) - self.registered
        for name in checked:
            self.registered.add(name)
            await registered(client, sources[name])
        expect = [k for k in unknown if k in self.submitted]
        found = await SchedulerAPI(client).locate(unknown, session.my_host, expect=expect)
        self.submitted.difference_update(expect)  # waited for once: from now on, as any other key
        self.holders.update(found.holders)
        for key, error in found.erred.items():
            source = wanted[key][0]
            if source.info.name in self.retried:
                raise error
            self.retried.add(source.info.name)
            await registered(client, source)  # retries its erred blocks
        if found.unknown:
            for name in {wanted[k][0].info.name for k in found.unknown} - checked:
                await registered(client, sources[name])  # registered again, should it have been released
            del submit_blocks(client, [wanted[k][0].reader(wanted[k][1]) for k in found.unknown])[:]
            self.submitted.update(found.unknown)  # the next locate waits for them

    def locate_folder(self, fs, folder: str) -> None:
        """Holders of the first block of up to `FOLDER_FILES` files of the folder this
        process knows (not waiting for any), and the layout of those held in files on this
        host: later reads of the folder's files need no request."""
        session, metadata = self.session, self.session.metadata
        wanted = []
        for path in sorted(metadata.files.get(folder, ()))[:FOLDER_FILES]:
            info = metadata.infos.get(f"{fs.target_id}|{path}")
            if info and info.get("type", "file") == "file" and info.get("size"):
                wanted.append(fs.source(path, info).info.block_key(0))
        if not wanted:
            return
        api = SchedulerAPI(session.client)
        holders = session.sync(Locate.op, lambda: api.locate(wanted, session.my_host, wait=0)).holders
        self.holders.update(holders)
        by_holder: dict[str, list[str]] = {}
        for key, holder in holders.items():
            by_holder.setdefault(holder, []).append(key)
        limit = float(dask.config.get("dmdask.client.recovery-seconds"))
        session.client.sync(session.gatherer.describe, by_holder, callback_timeout=limit)
