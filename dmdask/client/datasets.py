"""A rank's side of the registry: open a dataset (creating its blocks once per cluster)
and release it. The scheduler side is `dmdask.scheduler.DatasetsPlugin`."""
from __future__ import annotations

import uuid
import weakref

import numpy as np
from distributed import Client

from ..errors import NotADmdaskWorker
from ..plan.order import EpochOrder
from ..scheduler import DatasetsPlugin
from ..source import DatasetInfo, Source, dataset_name, open_source
from ..spec import Mix
from ..worker import load_block

_registered: "weakref.WeakKeyDictionary" = weakref.WeakKeyDictionary()  # client -> scheduler address
NEED_ORDER_POSITIONS = 8  # positions per block looked at to find the order blocks are first needed


def ensure_plugin(client: Client) -> None:
    """Register the scheduler plugin unless the scheduler has it (idempotent, race-free;
    asked once per client and scheduler)."""
    if _registered.get(client) != client.scheduler.address:
        client.register_plugin(DatasetsPlugin())
        _registered[client] = client.scheduler.address


def _call(client: Client, op: str, **msg):
    """One call to the scheduler plugin, from the caller's thread."""
    return client.sync(getattr(client.scheduler, op), **msg)


def open_dataset(client: Client, spec, epoch: int) -> DatasetInfo:
    """The dataset of `spec`, created once per cluster: the first rank to ask lists the
    source and submits every block load in one graph; the others wait for it and get
    the same blocks."""
    ensure_plugin(client)
    name = dataset_name(spec)
    claimant = uuid.uuid4().hex
    while True:
        reply = _call(client, "dmdask_get_or_claim", name=name, claimant=claimant)
        if reply["status"] == "ready":
            return DatasetInfo.from_dict(reply["info"])
        try:
            _create(client, name, open_source(spec), spec, epoch, claimant)
        except BaseException:
            _call(client, "dmdask_abandon", name=name, claimant=claimant)
            raise


def _create(client: Client, name: str, source: Source, spec, epoch: int, claimant: str) -> None:
    info = source.info
    order = EpochOrder(info.num_samples, info.block_len, shuffle=spec.shuffle, seed=spec.seed, epoch=epoch,
                       shuffle_window=spec.shuffle_window)
    need = order.blocks_first_needed(limit=NEED_ORDER_POSITIONS * info.num_blocks)
    reply = _call(client, "dmdask_register", name=name, claimant=claimant, info=info.as_dict(),
                  order=np.asarray(need).tolist())
    if reply["status"] == "no-workers":
        raise NotADmdaskWorker("the cluster has no workers; start `dask worker ... --worker-class dmdask.Worker`")
    if reply["status"] != "OK":
        return  # the claim passed to another rank: ask again
    readers = [source.reader(k) for k in range(info.num_blocks)]
    futures = client.map(load_block, readers, key=[r.key for r in readers], pure=False)
    del futures  # the scheduler plugin wants the blocks from now on


def release(client: Client, spec) -> bool:
    """Drop the cluster's cache of `spec.source`: its blocks leave RAM and SSD now (an
    iterator still reading it fails with `NotADmdaskWorker`), and the next `batches`
    lists and reads the source afresh. True if the cluster held it. For a `dmdask.Mix`,
    every source of the mixture (True if the cluster held any)."""
    ensure_plugin(client)
    if isinstance(spec.source, Mix):
        held = [_call(client, "dmdask_release", name=dataset_name(s)) for s in spec.source.specs(spec)]
        return any(held)
    return _call(client, "dmdask_release", name=dataset_name(spec))
