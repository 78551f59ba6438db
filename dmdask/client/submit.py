"""`Submission`: a dataset's block loads submitted by its claimant in chunks, so that the
dataset is ready (every rank may open it) once the first chunk is in, not once the
scheduler took in every block's task (10^5 tasks in one graph held the scheduler's event
loop 3.5-7 s, and each worker's 3-5 s as it received its half, before any rank's first
batch). The scheduler side is `DatasetsPlugin.submitted`.

Guarantees:
- every block's load is submitted once by this process, the first chunk holding the blocks
  `first` names (the claimant's own first batch) then the start of `order`; each later
  chunk the blocks ranks asked for before they were submitted (`Wanted`), then the next of
  `order`. A chunk is sent once the scheduler took in the one before, and the blocks of
  `order` only while at most `ahead` loads are unfinished (the wanted ones at once): no
  more than `ahead` plus a chunk wait on the workers.
- the readers of a chunk are made when it is sent (`Readers`): none is held for 10^6 blocks.
- with load groups (`groups`, `dmdask.plan.groups`), what is sent is whole groups, one task
  each (`GroupReaders`), in the order of the load order; a block asked for sends its group;
  chunks and `ahead` still count blocks.
- a dataset released meanwhile gets no more chunks (the scheduler answers `Busy`).
- the chunks after the first are sent by a thread with a client of its own, so closing
  the caller's client (a rank that stops after its first batches) does not stop them, and
  the process exits once they are sent (with `ahead`, once all but the last `ahead`
  loads finished: a claimant that stops after its first batches stays until then); if the
  process dies first, the scheduler creates the missing blocks at the next open
  (`DatasetsPlugin.remove_client`).
"""
from __future__ import annotations

import logging
import threading

import distributed
import numpy as np

from ..plan.groups import group_key
from ..protocol.scheduler import SchedulerAPI, Submitted, Wanted
from ..tasks import GroupReaders

logger = logging.getLogger(__name__)
CHUNK_BLOCKS = 4096  # block loads a graph; ~0.2-0.3 s of the scheduler's event loop each (measured)
AHEAD_BLOCKS = 8 * CHUNK_BLOCKS  # loads left unfinished before more are sent (`Submitted.ahead`): ~20 s of
# loading on two workers at 10^5 blocks, and none of the 10^6 blocks' worker stalls of sending them all at once


class Readers:
    """A source's block readers by index, each made when first asked for and kept until
    `take`n (a list of 10^6 readers would be built before anything is sent)."""

    def __init__(self, source, count: int):
        self.source, self.count = source, count
        self._made: dict[int, object] = {}

    def __len__(self) -> int:
        return self.count

    def made(self) -> list[int]:
        """The blocks whose readers were asked for and not taken yet."""
        return list(self._made)

    def __getitem__(self, k: int):
        if not 0 <= k < self.count:
            raise IndexError(k)
        reader = self._made.get(k)
        if reader is None:
            reader = self._made[k] = self.source.reader(k)
        return reader

    def take(self, blocks) -> list:
        """The readers of `blocks`, no longer kept here."""
        out = [self[k] for k in blocks]
        for k in blocks:
            self._made.pop(k, None)
        return out


class Submission:
    """The loads of dataset `name`'s blocks (`readers`), in `order` (None: index order),
    submitted in chunks of `chunk` by `client` for `claimant`; `submit(client, readers)`
    submits one chunk's loads and returns their futures (`datasets.submit_blocks`)."""

    def __init__(self, client, name: str, claimant: str, readers: Readers, submit, order=None,
                 chunk: int | None = None, ahead: int | None = None, groups=None, identity: str | None = None):
        self.client, self.name, self.claimant, self.readers = client, name, claimant, readers
        self.groups, self.identity = groups, identity  # load groups: what is sent is whole groups
        self.chunk = CHUNK_BLOCKS if chunk is None else chunk
        self.ahead = AHEAD_BLOCKS if ahead is None else ahead
        self.submit = submit
        n = len(readers) if groups is None else groups.count  # the loads: blocks, or groups
        self.order = (np.arange(n, dtype=np.int64) if order is None or groups is not None
                      else np.asarray(order, dtype=np.int64))
        self.sent = np.zeros(n, dtype=bool)
        self.count = 0  # blocks sent
        self._next = 0  # position in `order` of the next block to send
        self.thread: threading.Thread | None = None
        self._wanted: object = None  # the first chunk's reply
        self._room: int | None = None  # `Wanted.room` of the last reply

    @property
    def done(self) -> bool:
        return bool(self.sent.all())

    def first(self, blocks=(), then=None) -> Wanted | object:
        """Send the first chunk (`blocks`, then the start of `order`) with the caller's
        client, call `then()` (if given) once it is sent; the reply once the scheduler has
        it (the dataset is ready then)."""
        self._wanted = self._send(self.client, list(blocks), then=then)
        return self._wanted

    def rest_in_background(self) -> None:
        """Send the other chunks from a thread (not a daemon: the process waits for it)."""
        if self.done:
            return
        self.thread = threading.Thread(target=self._rest, name=f"dmdask-submit-{self.name}")
        self.thread.start()

    def _rest(self) -> None:
        wanted = self._wanted.blocks if isinstance(self._wanted, Wanted) else []
        try:
            with distributed.Client(self.client.scheduler.address, security=self.client.security,
                                    set_as_default=False, name="dmdask-submit") as own:
                reply = self._send(own, (), chunk=False)  # the submitter from now on: this client
                while isinstance(reply, Wanted) and not self.done and own.status == "running":
                    reply = self._send(own, wanted + reply.blocks, room=reply.room)
                    wanted = []
                if not self.done:  # released meanwhile (`Busy`), or the client lost its scheduler
                    logger.debug("submitting the blocks of %s stopped after %d of %d: %r", self.name, self.count,
                                 len(self.sent), reply)
        except Exception as exc:  # noqa: BLE001 - the cluster went away: its next open creates the rest
            logger.debug("submitting the blocks of %s stopped after %d of %d: %r", self.name, self.count,
                         len(self.sent), exc)

    def _send(self, client, wanted, chunk: bool = True, then=None, room: int | None = None) -> object:
        self._room = room
        readers = self._loads(self._chunk(wanted)) if chunk else []
        if readers:  # their futures dropped: the scheduler's plugin wants the blocks
            del self.submit(client, readers)[:]
        if then is not None:
            then()
        return client.sync(SchedulerAPI(client).send,
                           Submitted(self.name, self.claimant, self.count, self.done, client=client.id,
                                     ahead=self.ahead))

    def _loads(self, loads: list) -> list:
        """The arguments of these loads' tasks: blocks' readers, or groups' `GroupReaders`."""
        if self.groups is None:
            return self.readers.take(loads)
        return [GroupReaders(group_key(self.identity, g), self.readers.take(self.groups.members(g))) for g in loads]

    def _chunk(self, wanted) -> list:
        """The next chunk's loads (marked sent): those of the blocks `wanted` not sent yet,
        then `order`'s next unless the scheduler's last reply says more than `ahead` loads
        are unfinished (`Wanted.room` below 0: it waited for them in vain). Blocks are
        counted in `count`."""
        n_blocks = len(self.readers)
        wanted = [int(k) for k in wanted if 0 <= int(k) < n_blocks]
        if self.groups is not None:
            wanted = [self.groups.of(k) for k in wanted]
        out = [k for k in dict.fromkeys(wanted) if not self.sent[k]]
        self.sent[out] = True
        order, n = self.order, len(self.order)
        per_load = 1 if self.groups is None else self.groups.size
        size = len(out) if self._room is not None and self._room < 0 else max(1, self.chunk // per_load)
        while len(out) < size and self._next < n:
            take = order[self._next:self._next + size - len(out)]
            self._next += len(take)
            take = take[~self.sent[take]]
            self.sent[take] = True
            out.extend(take.tolist())
        self.count += len(out) if self.groups is None else sum(len(self.groups.members(g)) for g in out)
        return out
