"""Byte ranges read through the cluster in transparent mode: the blocks holding them, their
holders, and their rows from same-host files or over Dask's comms.

Guarantees: a read returns the bytes of the file's dataset as identified when the file was
opened (size and version). A block the cluster does not have is registered and submitted
again; a block whose load failed is retried once per dataset, then its error is raised.
A worker lost or a block moved is located again, for at most
`dmdask.client.recovery-seconds`: then `NoWorkersError` when the cluster has no workers,
otherwise a RuntimeError naming the files.
"""
from __future__ import annotations

import contextlib

import dask.config
import numpy as np
from distributed.comm.core import CommClosedError

from ..client.datasets import get_or_register, submit_blocks
from ..client.gather import Moved, plan_rows
from ..errors import BlockReadError, NoWorkersError
from ..protocol.scheduler import Locate, SchedulerAPI
from ..recovery import Deadline, Tries
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
        deadline = Deadline(float(dask.config.get("dmdask.client.recovery-seconds")))
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
                                     np.array(held_offsets, dtype=np.int64), {i: k for k, i in number.items()},
                                     deadline) if held_blocks else ())
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

    def _gather(self, wanted: dict[str, tuple], blocks: np.ndarray, offsets: np.ndarray, keys: dict[int, str],
                deadline: Deadline) -> np.ndarray:
        """Rows (block number, offset; `keys`: number -> block key; `wanted`: key ->
        (source, index)) from the blocks' holders, as an object array."""
        client, gatherer = self.session.client, self.session.gatherer
        for _ in Tries(deadline, pause=lambda attempt: min(1.0, 0.05 * attempt)):
            holders = self._holders(wanted, list(keys.values()), deadline)
            plan, positions = plan_rows(blocks, offsets, keys, holders)
            try:
                arrays = gatherer.take_local(plan, positions, len(blocks))
                if arrays is None:  # a block held elsewhere, or not described yet
                    arrays, _ = client.sync(gatherer.gather, plan, positions, len(blocks),
                                            callback_timeout=max(1.0, deadline.left()))
                return arrays["data"]
            except BlockReadError:
                raise
            except (Moved, OSError, CommClosedError) as exc:  # released, moved, or a worker left: locate again
                error = exc
                for key in keys.values():
                    self.holders.pop(key, None)
        urls = sorted({wanted[k][0].info.url for k in keys.values()})
        raise RuntimeError(f"{', '.join(urls[:3])} still failing after dmdask.client.recovery-seconds") from error

    def _holders(self, wanted: dict[str, tuple], keys: list[str], deadline: Deadline) -> dict[str, str]:
        """A holder of each block (`wanted`: key -> (source, index)), waiting for blocks
        loading or read by another process, submitting those the cluster does not have."""
        client = self.session.client
        api = SchedulerAPI(client)
        with contextlib.ExitStack() as waiting:
            for attempt, _ in enumerate(Tries(deadline)):  # no pause: each locate waits on the scheduler
                unknown = [k for k in keys if k not in self.holders]
                if not unknown:
                    return {k: self.holders[k] for k in keys}
                if attempt == 1:  # waiting for loads, which may be queued on this very worker (a task's read)
                    waiting.enter_context(out_of_the_pool())
                self._locate(wanted, unknown, client, api)
        url = wanted[unknown[0]][0].info.url
        if not client.scheduler_info().get("workers"):
            raise NoWorkersError(f"the cluster has no workers to read {url} through")
        raise RuntimeError(f"blocks of {url} still not loaded after dmdask.client.recovery-seconds; is the cluster "
                           "losing workers?")

    def _locate(self, wanted: dict[str, tuple], unknown: list[str], client, api) -> None:
        """One locate of the blocks `unknown`: holders learnt, erred loads retried once
        (then their error raised), blocks the cluster lacks registered and submitted."""
        session = self.session
        sources = {wanted[k][0].info.name: wanted[k][0] for k in unknown}
        checked = set(sources) - self.registered
        for name in checked:
            self.registered.add(name)
            get_or_register(client, sources[name])
        expect = [k for k in unknown if k in self.submitted]
        found = session.sync(Locate.op, lambda: api.locate(unknown, session.my_host, expect=expect))
        self.submitted.difference_update(expect)  # waited for once: from now on, as any other key
        self.holders.update(found.holders)
        for key, error in found.erred.items():
            source = wanted[key][0]
            if source.info.name in self.retried:
                raise error
            self.retried.add(source.info.name)
            get_or_register(client, source)  # retries its erred blocks
        if found.unknown:
            for name in {wanted[k][0].info.name for k in found.unknown} - checked:
                get_or_register(client, sources[name])  # registered again, should it have been released
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
