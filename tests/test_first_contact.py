"""First contact with data: a cold epoch hands each batch out as soon as its own rows are
read, and a new process on a warm cache takes its rows from the arenas from its first
batch on. Real worker processes, a real throttled HTTP store."""
import multiprocessing
import threading
import time

import dask
import distributed
import numpy as np
import pytest

import dmdask
from benchmarks.common import write_files
from benchmarks.store_server import StoreServer
from dmdask.testing.datasets import write_zarr

FILES, FILE_BYTES, BATCH = 512, 4096, 32


@pytest.mark.slow
def test_a_cold_batch_is_handed_out_before_the_rows_of_later_batches_are_read(tmp_path):
    """Cold, batches 0..prefetch-1 are all requested at once; batch 1 must come as soon as
    its own files are in, not with the batches behind it. The store holds every file of
    batches 2 and later until batch 1 is out (or 60 s have passed): batch 1 comes while
    they are held, with exactly the bytes of batches 0 and 1 read by then."""
    write_files(str(tmp_path / "files"), FILES, FILE_BYTES)
    later = lambda path: path.endswith(".bin") and int(path[-12:-4]) >= 2 * BATCH  # s-00000064.bin on
    with dask.config.set({"dmdask.store.read-seconds": 300}), StoreServer(str(tmp_path), latency=0.002) as store, \
            dmdask.LocalCluster(n_workers=2, ram="64 MiB") as cluster, distributed.Client(cluster) as client:
        # unshuffled, batch k is block k: files 32k .. 32k + 31
        spec = dmdask.Spec(store.url + "/files", batch_size=BATCH, block_size=BATCH, shuffle=False, prefetch=8)
        store.hold(later)
        give_up = threading.Timer(60, store.release)
        give_up.start()
        it = dmdask.batches(client, spec, progress=False)
        first_two = [next(it), next(it)]
        came_while_held = give_up.is_alive()
        give_up.cancel()
        served_then = _file_bytes(store)
        store.release()
        rest = list(it)
    assert came_while_held, "batch 1 came only once the files of later batches were served"
    assert served_then == 2 * BATCH * FILE_BYTES, f"{served_then} B read by batch 1, not batches 0 and 1's"
    assert np.array_equal(np.concatenate([b["index"] for b in first_two]), np.arange(2 * BATCH))
    ids = np.concatenate([b["index"] for b in first_two + rest])
    assert np.array_equal(np.sort(ids), np.arange(FILES))  # every sample once
    assert _file_bytes(store) == FILES * FILE_BYTES  # each file read once


def test_a_cold_rank_locates_its_first_batches_blocks_with_one_request(tmp_path):
    """Cold, a rank requests `prefetch` batches at once, each needing blocks no rank has
    located: they are located together (one `Locate` to the scheduler, not one per batch,
    each on a connection of its own), and the epoch is still every sample once. The store
    holds the files of batches 2 and later until batch 1 is out, so their blocks cannot be
    loaded (and known) before the rank asks for them."""
    from dmdask.protocol.scheduler import Locate

    write_files(str(tmp_path / "files"), 256, 1024)
    later = lambda path: path.endswith(".bin") and int(path[-12:-4]) >= 32  # batch 2 on (16 files a batch)
    with dask.config.set({"dmdask.store.read-seconds": 300}), StoreServer(str(tmp_path), latency=0.002) as store, \
            dmdask.LocalCluster(n_workers=2, ram="64 MiB") as cluster, distributed.Client(cluster) as client:
        handlers, asked = cluster.scheduler.handlers, []
        locate = handlers[Locate.op]

        async def counted(request=None, **kwargs):
            if not request.expect:  # not the opening rank giving its first batch to the workers
                asked.append(list(request.keys))
            return await locate(request, **kwargs)

        handlers[Locate.op] = counted
        spec = dmdask.Spec(store.url + "/files", batch_size=16, block_size=8, shuffle=False, prefetch=8)
        store.hold(later)
        give_up = threading.Timer(240, store.release)  # a bound, never reached unless batch 1 hangs
        give_up.start()
        try:
            it = dmdask.batches(client, spec, progress=False)
            first, second = next(it), next(it)
            came_while_held = give_up.is_alive()
            served_then = _file_bytes(store)
        finally:
            give_up.cancel()
            store.release()
        # the premise: no block of batch 2 or later could be held (and known) before the rank asked
        assert came_while_held, "batch 1 came only once the files of later batches were served"
        assert served_then == 32 * 1024, f"{served_then} B read by batch 1, not batches 0 and 1's"
        # cold: one batch a request, `prefetch` of them sent at once (batch 0 read by this
        # rank itself, 1-7 located together; 8 requested once batch 0 was handed out): 8
        # locates before
        assert 1 <= len(asked) <= 3, f"{len(asked)} locates for the first {spec.prefetch + 1} batches: {asked}"
        ids = np.concatenate([first["index"], second["index"]] + [b["index"] for b in it])
    assert np.array_equal(np.sort(ids), np.arange(256))


def _file_bytes(store) -> int:
    return sum(v["bytes"] for p, v in store.stats()["by_path"].items() if p.endswith(".bin"))


def _new_process_epoch(address, path, queue):
    with distributed.Client(address) as client:
        spec = dmdask.Spec(path, batch_size=64, seed=0)
        it = dmdask.batches(client, spec, epoch=1, progress=False)
        ids = np.concatenate([b["index"] for b in it])
        queue.put({"requests": it.requests, "batches": len(it), "ids": ids.tolist()})


def _epoch_in_new_process(address, path) -> dict:
    ctx = multiprocessing.get_context("spawn")
    queue = ctx.Queue()
    proc = ctx.Process(target=_new_process_epoch, args=(address, path, queue))
    proc.start()
    try:
        return queue.get(timeout=120)
    finally:
        proc.join(timeout=60)
        if proc.is_alive():
            proc.terminate()


@pytest.mark.slow
def test_a_new_process_on_a_warm_cache_takes_its_rows_from_the_arenas(tmp_path, monkeypatch):
    """Another process loaded the cache; a new one sends no request for rows at all: it
    learns where every block is before its first batch and maps their arenas. One that
    counts another host as its own (`dmdask.client.host`) asks the workers for every
    group instead, and gets the same samples."""
    path = write_zarr(str(tmp_path / "ds.zarr"), 4000, chunk=100)
    with dmdask.LocalCluster(n_workers=2, ram="64 MiB") as cluster, distributed.Client(cluster) as client:
        list(dmdask.batches(client, dmdask.Spec(path, batch_size=64), progress=False))  # loads every block
        report = _epoch_in_new_process(cluster.scheduler_address, path)
        monkeypatch.setenv("DASK_DMDASK__CLIENT__HOST", "192.0.2.1")  # a host of no worker (TEST-NET-1)
        elsewhere = _epoch_in_new_process(cluster.scheduler_address, path)
    assert report["batches"] > 10
    assert report["requests"] == 0, f"{report['requests']} of {report['batches']} batches asked workers for rows"
    assert sorted(report["ids"]) == list(range(4000))
    assert elsewhere["requests"] > 0 and sorted(elsewhere["ids"]) == list(range(4000))


def _other_rank_epoch(address, path, rank, world, batch, queue):
    """Rank `rank`, started once another rank holds the dataset's claim: its whole epoch,
    and the blocks the registry counted loaded when its first batch came."""
    from dmdask.protocol.scheduler import Datasets, SchedulerAPI

    with distributed.Client(address) as client:
        spec = dmdask.Spec(path, batch_size=batch, rank=rank, world_size=world, seed=3)

        def registry():
            return {d.name: d for d in client.sync(SchedulerAPI(client).send, Datasets())}

        name = None
        while name is None:  # until the claimant registered the plugin and claimed the dataset
            try:
                name = next(iter(registry()), None)
            except Exception:  # noqa: BLE001 - the scheduler has no dmdask handlers yet
                pass
        it = dmdask.batches(client, spec, progress=False)
        first = next(it)
        loaded = registry()[name].loaded
        ids = np.concatenate([first["index"]] + [b["index"] for b in it])
        queue.put({"loaded_at_first": loaded, "ids": ids.tolist()})


@pytest.mark.slow
def test_a_rank_that_is_not_the_claimant_gets_its_first_batch_ahead_of_the_other_loads(tmp_path):
    """A cold dataset of 2,000 blocks on a slow store, 64 ranks: the first batches of all
    ranks touch most blocks, and the blocks of rank 37's are spread over the first ~60% of
    the load order. Rank 37 (its own process, not the claimant) asks the workers for them:
    their loads run next, ahead of those no rank asked for yet, so its first batch comes
    while most blocks are still unloaded (it waited for every block before them, before
    issue 41). Its epoch holds exactly its share, and every chunk left the store once."""
    from dmdask.plan.order import EpochOrder, RankShare
    from test_traffic import chunk_files

    blocks, chunk, world, batch, other = 2000, 10, 64, 32, 37
    write_zarr(str(tmp_path / "d.zarr"), blocks * chunk, chunk=chunk)
    files = chunk_files(str(tmp_path / "d.zarr"))
    ctx = multiprocessing.get_context("spawn")
    queue = ctx.Queue()
    with StoreServer(str(tmp_path), latency=0.01) as store, \
            dmdask.LocalCluster(n_workers=2, ram="64 MiB") as cluster, distributed.Client(cluster) as client:
        path = store.url + "/d.zarr"
        proc = ctx.Process(target=_other_rank_epoch, args=(cluster.scheduler_address, path, other, world, batch, queue))
        proc.start()
        try:
            spec = dmdask.Spec(path, batch_size=batch, rank=0, world_size=world, seed=3)
            it = dmdask.batches(client, spec, progress=False)  # the claimant: creates the blocks
            next(it)
            theirs = queue.get(timeout=300)
        finally:
            proc.join(timeout=60)
            if proc.is_alive():
                proc.terminate()
        it.close()
        order = EpochOrder.of(it.info, spec, 0)
        share = RankShare(order, other, world, batch, spec.drop_last)
        load_order = order.blocks_first_needed(8 * blocks)
        ahead = np.flatnonzero(np.isin(load_order, np.unique(share.batch(0) // chunk))).max()  # last block it needs
        while dmdask.stats(client)["datasets"][0]["loaded"] < blocks:
            time.sleep(0.2)
        served = {p: v for p, v in store.stats()["by_path"].items() if "/c/" in p}
    assert ahead > 0.4 * blocks  # without jumping the queue, its first batch waits for this many loads
    assert theirs["loaded_at_first"] < ahead / 2, (theirs["loaded_at_first"], ahead)
    expected = np.concatenate(share.batches(0, len(share)))
    assert len(theirs["ids"]) == len(set(theirs["ids"])) == len(expected)  # each of its samples once
    assert sorted(theirs["ids"]) == sorted(expected.tolist())
    assert sum(v["bytes"] for v in served.values()) == sum(files.values())  # each chunk from the store once
    assert all(v["requests"] == 1 for v in served.values()) and len(served) == len(files)


def _block_tasks(dask_scheduler) -> int:
    from dmdask.source.base import parse_block_key

    return sum(1 for key in dask_scheduler.tasks if isinstance(key, str) and parse_block_key(key) is not None)


def _rank_reporting_its_first_batch(address, path, rank, world, batch, queue):
    """Rank `rank`, started once another rank holds the dataset's claim: the block tasks the
    scheduler had when its first batch came, that batch, then its whole epoch."""
    with distributed.Client(address) as client:
        while not dmdask.stats(client).get("datasets"):  # until the claimant registered it
            time.sleep(0.05)
        it = dmdask.batches(client, dmdask.Spec(path, batch_size=batch, rank=rank, world_size=world, seed=3),
                            progress=False)
        first = next(it)
        queue.put({"tasks_at_first": client.run_on_scheduler(_block_tasks), "first": first["index"].tolist()})
        queue.put({"ids": np.concatenate([first["index"]] + [b["index"] for b in it]).tolist()})


@pytest.mark.slow
def test_a_rank_opens_the_dataset_before_every_block_is_submitted(tmp_path, monkeypatch):
    """The claimant submits the loads of a 2,000-block dataset in chunks of 100, and only the
    blocks ranks ask for after its first chunk until the test lets it go on: another rank
    (its own process) opens the dataset and gets its first batch, exactly its own samples,
    while the scheduler has under half of the blocks' tasks (it had all 2,000 before any
    rank's open returned before). Then every rank's epoch is exactly its share, every block
    is loaded, and every chunk left the store once."""
    from dmdask.client import submit
    from dmdask.plan.order import EpochOrder, RankShare
    from test_traffic import chunk_files

    blocks, chunk, world, batch, other = 2000, 10, 64, 32, 37
    write_zarr(str(tmp_path / "d.zarr"), blocks * chunk, chunk=chunk)
    files = chunk_files(str(tmp_path / "d.zarr"))
    go_on = threading.Event()
    chunk_of = submit.Submission._chunk

    def held(self, wanted):  # after the first chunk, until go_on: only the blocks ranks asked for
        if not self.count or go_on.is_set():
            return chunk_of(self, wanted)
        out = [k for k in dict.fromkeys(int(k) for k in wanted) if not self.sent[k]]
        self.sent[out] = True
        self.count += len(out)
        if not out:
            time.sleep(0.02)
        return out

    monkeypatch.setattr(submit, "CHUNK_BLOCKS", 100)
    monkeypatch.setattr(submit.Submission, "_chunk", held)
    ctx = multiprocessing.get_context("spawn")
    queue = ctx.Queue()
    with StoreServer(str(tmp_path), latency=0.002) as store, \
            dmdask.LocalCluster(n_workers=2, ram="64 MiB") as cluster, distributed.Client(cluster) as client:
        path = store.url + "/d.zarr"
        proc = ctx.Process(target=_rank_reporting_its_first_batch,
                           args=(cluster.scheduler_address, path, other, world, batch, queue))
        proc.start()
        try:
            spec = dmdask.Spec(path, batch_size=batch, rank=0, world_size=world, seed=3)
            it = dmdask.batches(client, spec, progress=False)  # the claimant: submits the blocks
            mine = [next(it)]
            theirs = queue.get(timeout=120)
            go_on.set()
            mine += list(it)
            theirs.update(queue.get(timeout=300))
        finally:
            go_on.set()
            proc.join(timeout=60)
            if proc.is_alive():
                proc.terminate()
        while dmdask.stats(client)["datasets"][0]["loaded"] < blocks:
            time.sleep(0.2)
        served = {p: v for p, v in store.stats()["by_path"].items() if "/c/" in p}
    order = EpochOrder.of(it.info, spec, 0)
    assert theirs["tasks_at_first"] < blocks / 2, theirs["tasks_at_first"]
    assert theirs["first"] == RankShare(order, other, world, batch, spec.drop_last).batch(0).tolist()
    for rank, ids in ((0, np.concatenate([b["index"] for b in mine])), (other, np.array(theirs["ids"]))):
        share = RankShare(order, rank, world, batch, spec.drop_last)
        expected = np.concatenate(share.batches(0, len(share)))
        assert len(ids) == len(set(ids.tolist())) and sorted(ids.tolist()) == sorted(expected.tolist())
    assert sum(v["bytes"] for v in served.values()) == sum(files.values())  # each chunk from the store once
    assert all(v["requests"] == 1 for v in served.values()) and len(served) == len(files)


def _claimant_that_leaves_after_its_first_batch(address, path, queue):
    """Rank 0 creates the dataset in chunks of 100 blocks, each after the first 0.2 s late
    (a slow submitter: 4 s for the whole dataset), takes its first batch and closes its
    client at once; its process then ends."""
    from dmdask.client import submit

    submit.CHUNK_BLOCKS = 100
    chunk_of = submit.Submission._chunk

    def slow(self, wanted):
        if self.count:
            time.sleep(0.2)
        return chunk_of(self, wanted)

    submit.Submission._chunk = slow
    with distributed.Client(address) as client:
        it = dmdask.batches(client, dmdask.Spec(path, batch_size=32, rank=0, world_size=64, seed=3), progress=False)
        queue.put(next(it)["index"].tolist())
        it.close()


@pytest.mark.slow
def test_the_blocks_are_all_submitted_when_the_claimant_stops_after_its_first_batch(tmp_path):
    """A claimant that closes its client right after its first batch, with most of a
    2,000-block dataset's loads not submitted yet: its process submits the rest before it
    exits, and the cluster loads every block, each chunk from the store once."""
    from test_traffic import chunk_files

    blocks = 2000
    write_zarr(str(tmp_path / "d.zarr"), blocks * 10, chunk=10)
    files = chunk_files(str(tmp_path / "d.zarr"))
    ctx = multiprocessing.get_context("spawn")
    queue = ctx.Queue()
    with StoreServer(str(tmp_path), latency=0.002) as store, \
            dmdask.LocalCluster(n_workers=2, ram="64 MiB") as cluster, distributed.Client(cluster) as client:
        proc = ctx.Process(target=_claimant_that_leaves_after_its_first_batch,
                           args=(cluster.scheduler_address, store.url + "/d.zarr", queue))
        proc.start()
        try:
            first = queue.get(timeout=120)
            proc.join(timeout=120)
        finally:
            if proc.is_alive():
                proc.terminate()
        deadline = time.monotonic() + 120
        while dmdask.stats(client)["datasets"][0]["loaded"] < blocks and time.monotonic() < deadline:
            time.sleep(0.2)
        loaded = dmdask.stats(client)["datasets"][0]["loaded"]
        served = {p: v for p, v in store.stats()["by_path"].items() if "/c/" in p}
    assert len(first) == 32 and proc.exitcode == 0
    assert loaded == blocks
    assert sum(v["bytes"] for v in served.values()) == sum(files.values())  # each chunk from the store once
    assert all(v["requests"] == 1 for v in served.values()) and len(served) == len(files)


@pytest.mark.slow
def test_a_dataset_released_while_its_blocks_are_submitted_gets_no_more_of_them(tmp_path, monkeypatch):
    """Released after its first chunk of 100 (of 2,000 blocks): the claimant's process sends
    no further chunk, and the scheduler keeps no task of the dataset."""
    from dmdask.client import submit

    write_zarr(str(tmp_path / "d.zarr"), 20000, chunk=10)
    go_on, made = threading.Event(), []
    chunk_of, rest = submit.Submission._chunk, submit.Submission.rest_in_background

    def held(self, wanted):  # after the first chunk: nothing until go_on
        if self.count:
            go_on.wait(60)
        return chunk_of(self, wanted)

    def kept(self):
        made.append(self)
        rest(self)

    monkeypatch.setattr(submit, "CHUNK_BLOCKS", 100)
    monkeypatch.setattr(submit.Submission, "_chunk", held)
    monkeypatch.setattr(submit.Submission, "rest_in_background", kept)
    with dmdask.LocalCluster(n_workers=2, ram="64 MiB") as cluster, distributed.Client(cluster) as client:
        spec = dmdask.Spec(str(tmp_path / "d.zarr"), batch_size=32, seed=3, prefetch=1)
        it = dmdask.batches(client, spec, progress=False)
        next(it)
        it.close()
        assert dmdask.release(client, spec)
        go_on.set()
        made[0].thread.join(60)
        time.sleep(0.5)
        left = client.run_on_scheduler(_block_tasks)
    assert not made[0].thread.is_alive()
    assert made[0].count <= 200, made[0].count  # the first chunk, and the one held when it was released
    assert left == 0
