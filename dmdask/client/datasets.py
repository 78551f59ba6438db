"""A rank's side of the registry: open a dataset (creating its blocks once per cluster)
and release it. The scheduler side is `dmdask.scheduler.DatasetsPlugin`."""
from __future__ import annotations

import asyncio
import concurrent.futures
import contextlib
import gc
import uuid
import weakref
from collections.abc import Callable

import numpy as np
from distributed import Client

from ..errors import DatasetHeldError, NotADmdaskWorker
from ..plan.groups import Groups, group_size
from ..plan.order import load_order
from ..protocol.scheduler import (
    Abandon,
    GetOrClaim,
    GetOrRegister,
    Held,
    NoWorkers,
    Ready,
    Register,
    Registered,
    Release,
    SchedulerAPI,
)
from ..scheduler import DatasetsPlugin
from ..source import DatasetInfo, Source, dataset_name, open_source
from ..spec import Mix
from ..tasks import GroupReaders, load_block, load_group
from .submit import Readers, Submission

_registered: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()  # client -> scheduler address
OPEN_THREADS = 8  # a mixture's sources opened at once (`open_datasets`)
NEED_ORDER_POSITIONS = 8  # positions per block looked at to find the order blocks are first needed
NO_WORKERS = "the cluster has no workers; start `dask worker ... --worker-class dmdask.Worker`"


def ensure_plugin(client: Client) -> None:
    """Register the scheduler plugin, once per client and scheduler (idempotent, race-free)."""
    if _registered.get(client) != client.scheduler.address:
        client.register_plugin(DatasetsPlugin())
        _registered[client] = client.scheduler.address


def _call(client: Client, request):
    """One request to the scheduler plugin, from the caller's thread; `NoWorkers` raised."""
    reply = client.sync(SchedulerAPI(client).send, request)
    if isinstance(reply, NoWorkers):
        raise NotADmdaskWorker(NO_WORKERS)
    return reply


def open_dataset(client: Client, spec, epoch: int, host: str | None = None, first_read=None) -> Ready:
    """The dataset of `spec` (`get_or_create`), its blocks submitted in the order its epoch
    needs them; `host`: see `GetOrClaim`; `first_read`: see `get_or_create`."""

    def order(info: DatasetInfo):
        return np.asarray(load_order(info, spec, epoch, limit=NEED_ORDER_POSITIONS * info.num_blocks)).tolist()

    return get_or_create(client, dataset_name(spec), lambda: open_source(spec), order, host, first_read)


def open_datasets(client: Client, specs: list, epoch: int, host: str | None = None) -> list[Ready]:
    """`open_dataset` of each spec (a mixture's sources), in their order, up to OPEN_THREADS
    at once: a cold blend waits for its slowest source's first chunk of loads, not for the
    sum of them. Every open is waited for; then the first error (in the specs' order) is raised."""
    if len(specs) == 1:
        return [open_dataset(client, specs[0], epoch, host)]
    ensure_plugin(client)  # once, before the threads ask
    with concurrent.futures.ThreadPoolExecutor(min(OPEN_THREADS, len(specs)), "dmdask-open") as pool:
        futures = [pool.submit(open_dataset, client, spec, epoch, host) for spec in specs]
    return [future.result() for future in futures]


def get_or_create(client: Client, name: str, opener: Callable[[], Source],
                  order: Callable[[DatasetInfo], list] | None = None, host: str | None = None,
                  first_read: Callable[[DatasetInfo, list], Callable[[], None] | None] | None = None) -> Ready:
    """The registry's dataset `name`, created once per cluster from `opener()` by the first
    process to ask (the others wait), its block loads submitted in chunks in the order
    `order(info)` (None: index order), ready once the first chunk is in (`dmdask.client.submit`:
    the others follow from a thread); `host`: see `GetOrClaim`. Registers the plugin if
    the scheduler lacks it. In the process that creates it, `first_read(info, readers)` is
    called once the dataset is registered, before the loads are submitted: it may name rows
    it will read itself in their blocks' readers (`FirstBatch.plan`; those blocks go in the
    first chunk), and return the function that starts those reads, called right after the
    first chunk is submitted."""
    claimant = uuid.uuid4().hex
    ensure_plugin(client)  # a scheduler without the preload logs a KeyError for a request it has no handler for
    while True:
        reply = _call(client, GetOrClaim(name, claimant, host, client.id))
        if reply is None:
            raise RuntimeError(f"the scheduler at {client.scheduler.address} has no dmdask handlers after "
                               "registering dmdask's plugin; is its dmdask the same version as this one?")
        if isinstance(reply, Ready) and reply.info.name != name:
            raise RuntimeError(f"the scheduler answered dataset {name} with {reply.info.name}: is its dmdask the "
                               "same version as this one?")
        if isinstance(reply, Ready):
            return reply
        try:  # then ask again: ready once the scheduler has the blocks, which later calls rely on
            with _collection_deferred():
                _create(client, name, opener(), order, claimant, first_read)
        except BaseException:
            _call(client, Abandon(name, claimant))
            raise


@contextlib.contextmanager
def _collection_deferred():
    """Python's garbage collector paused meanwhile (as it was after): every rank of the
    cluster waits for the claimant, and a training process's first full collection (0.1-0.3 s
    after importing a framework, measured) comes with its first allocations."""
    enabled = gc.isenabled()
    gc.disable()
    try:
        yield
    finally:
        if enabled:
            gc.enable()


def get_or_register(client: Client, source: Source) -> bool:
    """Register `source`'s dataset lazily unless the registry has it: no block is loaded
    until submitted (`submit_blocks`). True when registered now (none of its blocks exists)."""
    ensure_plugin(client)
    return client.sync(registered, client, source)


async def registered(client: Client, source: Source) -> bool:
    """`get_or_register` on the client's event loop, for a client whose plugin is registered."""
    while True:
        reply = await SchedulerAPI(client).send(GetOrRegister(source.info))
        if isinstance(reply, NoWorkers):
            raise NotADmdaskWorker(NO_WORKERS)
        if isinstance(reply, (Ready, Registered)):
            return isinstance(reply, Registered)
        await asyncio.sleep(0.05)  # being created by a get_or_create: ready in a moment


def _create(client: Client, name: str, source: Source, order, claimant: str, first_read=None) -> None:
    info = source.info
    blocks_order = None if order is None else order(info)
    reply = _call(client, Register(name, claimant, info, blocks_order))
    if not isinstance(reply, Registered):
        return  # the claim passed to another rank: ask again
    readers = Readers(source, info.num_blocks)
    size = group_size(info.num_blocks)  # as the scheduler plugin plans it (`dmdask.plan.groups`)
    groups = Groups(info.num_blocks, blocks_order, size) if size > 1 else None
    # not with load groups: a group's worker cannot be given one block's rows before the group is
    # loaded, and a whole read would wait for them (`Handovers`): the rank fetches its first batch
    begin = None if first_read is None or groups is not None else first_read(info, readers)
    submission = Submission(client, name, claimant, readers, submit_blocks, blocks_order, groups=groups,
                            identity=info.identity)
    # the reads begin once the first chunk is sent (the workers get their loads first); ready once it is in
    submission.first(readers.made(), then=begin)
    submission.rest_in_background()


def submit_blocks(client: Client, readers) -> list:
    """Submit the loads of these blocks (their readers), or of these load groups (their
    `GroupReaders`), in one graph (a block the cluster has is left as it is); their futures,
    which the caller may drop (the scheduler plugin wants the blocks)."""
    task = load_group if readers and isinstance(readers[0], GroupReaders) else load_block
    return client.map(task, readers, key=[r.key for r in readers], pure=False)


def release(client: Client, spec) -> bool:
    """Drop the cluster's cache of `spec.source` (every source of a `dmdask.Mix`): its blocks
    leave RAM and SSD now (an iterator still reading it fails with `NotADmdaskWorker`), and
    the next `batches` reads the source afresh. True if the cluster held it (or any).
    `DatasetHeldError` (nothing released) when other connected clients hold it and `client`
    does not: release it from a client that opened it, or once the others have left."""
    ensure_plugin(client)
    specs = spec.source.specs(spec) if isinstance(spec.source, Mix) else [spec]
    replies = [_call(client, Release(dataset_name(s), client.id)) for s in specs]
    held = [s.source for s, reply in zip(specs, replies) if isinstance(reply, Held)]
    if held:
        raise DatasetHeldError(f"not released: {held[0]} is read by other clients connected to the cluster "
                               "(release it from a client that opened it, or once they have disconnected)")
    return any(replies)
