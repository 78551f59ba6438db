"""The rank that opens a cold dataset reads its first batch from the store itself and gives
the rows to the blocks' workers (`dmdask.client.first_batch`): real worker processes, a real
HTTP store; every file is counted at the store."""
import threading

import dask
import distributed
import numpy as np
import pytest

import dmdask
from benchmarks.store_server import StoreServer
from dmdask.client import datasets
from dmdask.client.first_batch import FirstBatch
from dmdask.errors import HandlerArgumentError
from dmdask.protocol.worker import GiveRows
from dmdask.testing.datasets import folder_sample, write_folder
from dmdask.worker.handover import ROWS, Handovers

from conftest import all_ids, run_epoch

N, BATCH = 120, 8


def _file_requests(server) -> dict:
    return {p: v["requests"] for p, v in server.stats()["by_path"].items() if p.endswith(".bin")}


def _check(per_rank) -> None:
    assert np.array_equal(np.sort(all_ids(per_rank)), np.arange(N))
    for batch in (b for batches in per_rank for b in batches):
        assert [bytes(d) for d in batch["data"]] == [folder_sample(i) for i in batch["index"]]


@pytest.fixture
def folder(tmp_path):
    write_folder(str(tmp_path / "files"), classes=3, per_class=40)
    with StoreServer(str(tmp_path)) as server:
        yield server, dmdask.Spec(server.url + "/files", batch_size=BATCH, block_size=10, seed=4)


def test_the_opening_rank_reads_its_first_batch_and_the_workers_keep_it(folder):
    """Cold, two ranks: the one that opens the dataset reads its first batch (8 files)
    itself; the workers keep those rows, so the epoch reads every file once, the RAM tier
    holds all 120 samples and the next epoch reads nothing."""
    server, spec = folder
    with dmdask.LocalCluster(n_workers=2, ram="16 MiB") as cluster, distributed.Client(cluster) as client:
        _check(run_epoch(client, spec, world_size=2))
        assert sorted(_file_requests(server).values()) == [1] * N
        total = dmdask.stats(client)["total"]
        assert total["shared_store"]["from_ranks"] == BATCH
        # each sample from the store once: to a rank that asked, ahead of it, or given
        assert total["stream"]["hits"] + total["shared_store"]["read_ahead"] == N
        assert total["ram"]["samples"] == N
        _check(run_epoch(client, spec, epoch=1, world_size=2))
        assert sorted(_file_requests(server).values()) == [1] * N  # nothing read again
        assert dmdask.stats(client)["total"]["stream"]["hits"] == total["stream"]["hits"]  # all from RAM


def _no_giving(monkeypatch) -> None:
    async def give_nothing(self, info):  # the rank fails between its read and the giving
        return None

    monkeypatch.setattr(FirstBatch, "_give", give_nothing)


def test_the_loads_are_submitted_before_the_opening_rank_starts_reading(folder, monkeypatch):
    """The workers get their loads first: the rank submits every block's load, then starts
    reading its first batch (no file read before)."""
    server, spec = folder
    events = []
    plan, submit = FirstBatch.plan, datasets.submit_blocks

    def watched_plan(self, info, readers):
        begin = plan(self, info, readers)

        def start():
            events.append(("read", sum(_file_requests(server).values())))
            begin()
        return start

    def watched_submit(client, readers):
        events.append(("submit", len(readers)))
        return submit(client, readers)

    monkeypatch.setattr(FirstBatch, "plan", watched_plan)
    monkeypatch.setattr(datasets, "submit_blocks", watched_submit)
    with dmdask.LocalCluster(n_workers=2, ram="16 MiB") as cluster, distributed.Client(cluster) as client:
        _check(run_epoch(client, spec, world_size=2))
    assert events == [("submit", N // 10), ("read", 0)]
    assert sorted(_file_requests(server).values()) == [1] * N


def test_a_first_read_that_cannot_start_leaves_batch_0_to_the_workers(folder, monkeypatch):
    """No thread to read with (the loads are submitted by then): nothing is abandoned, batch 0
    is fetched, and every file is read once, by the workers."""
    server, spec = folder

    def no_threads(self, k):  # called as each read is submitted to the read threads
        raise RuntimeError("can't start new thread")

    monkeypatch.setattr(FirstBatch, "_counter", no_threads)
    with dmdask.LocalCluster(n_workers=2, ram="16 MiB") as cluster, distributed.Client(cluster) as client:
        _check(run_epoch(client, spec, world_size=2))
        assert dmdask.stats(client)["total"]["shared_store"]["from_ranks"] == 0
    assert sorted(_file_requests(server).values()) == [1] * N


def test_rows_never_given_are_read_by_the_workers_when_asked(folder, monkeypatch):
    """The opening rank never gives its first batch: no worker reads those rows ahead (the
    rank was to give them), so they are read when a rank next asks, once; nothing is lost."""
    server, spec = folder
    _no_giving(monkeypatch)
    with dmdask.LocalCluster(n_workers=2, ram="16 MiB") as cluster, distributed.Client(cluster) as client:
        _check(run_epoch(client, spec, world_size=2))
        assert sorted(_file_requests(server).values()) == [1] * N
        assert dmdask.stats(client)["total"]["ram"]["samples"] == N - BATCH
        _check(run_epoch(client, spec, epoch=1, world_size=2))
        assert sorted(_file_requests(server).values()) == [1] * (N - BATCH) + [2] * BATCH
        assert dmdask.stats(client)["total"]["ram"]["samples"] == N


def test_a_block_read_whole_waits_for_the_given_rows_then_reads_them(folder, monkeypatch):
    """No RAM tier, so blocks are read whole into the SSD tier, skipping the rows the
    opening rank reads: given, they are taken (every file once); never given, the load
    reads them itself after waiting `GIVEN_SECONDS` (nothing waits longer, nothing lost)."""
    server, spec = folder
    counted = {}
    for first_batch in (False, True):
        server.reset_stats()
        with dask.config.set({"dmdask.client.read-first-batch": first_batch}), \
                dmdask.LocalCluster(n_workers=2, ram=0, ssd="16 MiB") as cluster, distributed.Client(cluster) as client:
            _check(run_epoch(client, spec, world_size=2))
            assert sorted(_file_requests(server).values()) == [1] * N
            total = dmdask.stats(client)["total"]
            assert total["ssd"]["samples"] == N
            counted[first_batch] = total["shared_store"]["bytes"]
    assert counted[True] == counted[False]  # the given rows counted once, as the whole reads count theirs
    server.reset_stats()
    _no_giving(monkeypatch)
    with dmdask.LocalCluster(n_workers=2, ram=0, ssd="16 MiB") as cluster, distributed.Client(cluster) as client:
        _check(run_epoch(client, spec, world_size=2))
        assert sorted(_file_requests(server).values()) == [1] * (N - BATCH) + [2] * BATCH


def test_rows_given_with_another_claim_are_not_kept(folder, monkeypatch):
    """Only the rows the blocks' readers name, with their secret claim, are kept: rows given
    under another claim (another client forging them) are let go and read again."""
    server, spec = folder
    plan = FirstBatch.plan

    def forged(self, info, readers):
        begin = plan(self, info, readers)
        self.claim = "forged"  # the readers carry the real one
        return begin

    monkeypatch.setattr(FirstBatch, "plan", forged)
    with dmdask.LocalCluster(n_workers=2, ram="16 MiB") as cluster, distributed.Client(cluster) as client:
        _check(run_epoch(client, spec, world_size=2))
        assert dmdask.stats(client)["total"]["ram"]["samples"] == N - BATCH
        _check(run_epoch(client, spec, epoch=1, world_size=2))
        assert sorted(_file_requests(server).values()) == [1] * (N - BATCH) + [2] * BATCH


def test_give_rows_refuses_arrays_that_do_not_match_their_rows():
    good = GiveRows({"k": np.array([0, 3])}, {"k": {"data": np.zeros(2)}}, "claim")
    good.check("dmdask_give_rows")
    for bad in (GiveRows({"k": np.array([0, 3])}, {"k": {"data": np.zeros(3)}}, "claim"),
                GiveRows({"k": np.array([0.5])}, {"k": {"data": np.zeros(1)}}, "claim"),
                GiveRows({"k": np.array([0])}, {}, "claim"),
                GiveRows({"k": np.array([0])}, {"k": {"data": np.zeros(1)}}, "")):
        with pytest.raises(HandlerArgumentError, match="dmdask_give_rows"):
            bad.check("dmdask_give_rows")


def test_given_rows_are_taken_once_with_their_claim_and_waited_for():
    given = Handovers(capacity=1000, seconds=60)
    rows, arrays = np.array([1, 4]), {"data": np.array([10, 40])}
    assert given.put("b", "c", (rows, arrays), 32, kind=ROWS)
    assert given.take("b", "other", kind=ROWS) is None and given.take("b", "c") is None  # another claim, kind
    got = given.take("b", "c", kind=ROWS)
    assert np.array_equal(got[0], rows) and got[1] is arrays
    assert given.take("b", "c", kind=ROWS) is None and given.bytes == 0  # once
    assert given.take("b", "c", timeout=0.05, kind=ROWS) is None  # not given: not waited for longer
    later = threading.Timer(0.1, given.put, ("b", "c", (rows, arrays), 32), {"kind": ROWS})
    later.start()
    assert given.take("b", "c", timeout=30, kind=ROWS) is not None  # waited for, and woken when given
    later.join()
    # given rows and handed-over bytes share one bound
    assert given.put("k", "c", b"x" * 900, 900) and not given.put("r", "c", (rows, arrays), 200, kind=ROWS)
    # one secret per reading process, two kinds: a block's bytes are never taken as its rows
    assert given.put("k", "c", (rows, arrays), 32, kind=ROWS)
    assert given.take("k", "c", kind=ROWS)[1] is arrays and given.take("k", "c") == b"x" * 900
