"""RAM and SSD tiers: placement, capacities, and reads served from each tier."""
import os

import distributed
import numpy as np

import dmdask
from dmdask.worker.holdings import Block, FileBlock, Streamed
from dmdask.testing.datasets import write_folder, write_zarr, zarr_sample
from dmdask.worker.tiers import TieredStore

from conftest import all_ids, run_epoch


def make_block(start, n, width=4):
    ids = np.arange(start, start + n)
    ragged = np.empty(n, dtype=object)
    ragged[:] = [np.full(i % 5 + 1, i, dtype=np.uint8) for i in ids]
    return Block({"x": zarr_sample(ids, (width,)), "raw": ragged}, start, start + n)


def test_placement_fastest_tier_with_room_and_never_over_capacity(tmp_path):
    one = make_block(0, 10).nbytes
    store = TieredStore(ram=2 * one, ssd=one, ssd_dir=str(tmp_path))
    placed = []
    for k in range(4):
        tier = store.reserve(one)
        placed.append(tier)
        if tier is not None:
            key = f"dmdask-block-t-{k}"
            store[key] = store.place(key, tier, make_block(10 * k, 10), one)
        assert store.ram.bytes <= store.ram.capacity and store.ssd.bytes <= store.ssd.capacity
    assert placed == ["ram", "ram", "ssd", None]
    assert isinstance(store["dmdask-block-t-2"], FileBlock) and store["dmdask-block-t-2"].tier == "ssd"
    assert store.stats()["ram"]["blocks"] == 2 and store.stats()["ssd"]["blocks"] == 1
    # a released block frees its tier and its files
    path = store["dmdask-block-t-2"].path
    del store["dmdask-block-t-2"]
    assert not os.path.exists(path) and store.ssd.bytes == 0
    assert store.reserve(one) == "ssd"


def test_ssd_block_serves_the_same_rows_as_memory(tmp_path):
    block = make_block(100, 37)
    on_disk = FileBlock.write(str(tmp_path), block, "ssd")
    rows = np.array([36, 0, 5, 5, 17])
    a, b = block.take(rows), on_disk.take(rows)
    np.testing.assert_array_equal(a["x"], b["x"])
    assert [r.tolist() for r in a["raw"]] == [r.tolist() for r in b["raw"]]
    # leaving the worker, an SSD block travels as its data
    import pickle

    again = pickle.loads(pickle.dumps(on_disk))
    assert isinstance(again, Block) and again.start == 100
    np.testing.assert_array_equal(again.arrays["x"], block.arrays["x"])


def test_ssd_reads_from_many_threads_parse_no_header(tmp_path, monkeypatch):
    """Regression: `np.load` parses `.npy` headers with `ast.literal_eval`, which raised
    `SystemError: AST constructor recursion depth mismatch` from several threads on
    CPython 3.11. SSD reads parse nothing: any call to it fails this test."""
    import ast
    import concurrent.futures

    blocks = [FileBlock.write(str(tmp_path), make_block(100 * k, 60), "ssd") for k in range(8)]

    def no_parse(*args, **kwargs):
        raise AssertionError("an SSD read parsed a file header")

    monkeypatch.setattr(ast, "literal_eval", no_parse)
    monkeypatch.setattr(np, "load", no_parse)
    rng = np.random.default_rng(0)
    jobs = [(b, rng.integers(0, 60, 40)) for _ in range(100) for b in blocks]
    with concurrent.futures.ThreadPoolExecutor(8) as pool:
        results = list(pool.map(lambda job: (job, job[0].take(job[1])), jobs))
    for (block, rows), out in results:
        np.testing.assert_array_equal(out["x"], zarr_sample(block.start + rows, (4,)))
        assert [r.tolist() for r in out["raw"]] == [[i % 256] * (i % 5 + 1) for i in (block.start + rows).tolist()]


def test_ssd_tier_keeps_numpy_strings(tmp_path):
    strings = np.array(["", "a", "päivää", "x" * 300, "z"], dtype=np.dtypes.StringDType())
    block = Block({"s": strings, "n": np.arange(5)}, 0, 5)
    on_disk = FileBlock.write(str(tmp_path), block, "ssd")
    out = on_disk.take(np.array([3, 0, 2, 2]))
    assert out["s"].dtype == np.dtypes.StringDType()
    assert out["s"].tolist() == ["x" * 300, "", "päivää", "päivää"]
    np.testing.assert_array_equal(out["n"], [3, 0, 2, 2])


def test_blocks_brought_by_dask_itself_are_charged_and_released():
    """A graceful retirement moves blocks with Dask's own transfer: counted in RAM."""
    store = TieredStore(ram=10**6)
    block = make_block(0, 10)
    store["dmdask-block-moved-0"] = block
    assert store.ram.bytes == block.nbytes and store.ram.blocks == 1
    del store["dmdask-block-moved-0"]
    assert store.ram.bytes == 0 and store.ram.blocks == 0 and store.ram.reserved == 0


def test_other_keys_are_kept_apart_and_uncounted():
    store = TieredStore(ram=10)
    store["some-task"] = np.zeros(1000)
    store["dmdask-block-x-1"] = Streamed(reader=None)
    assert store.ram.bytes == 0 and len(store) == 2 and set(store) == {"some-task", "dmdask-block-x-1"}
    del store["some-task"]
    assert "some-task" not in store


def test_cluster_fills_ram_then_ssd_and_serves_from_both(tmp_path):
    path = write_zarr(str(tmp_path / "d.zarr"), 1200, sample_shape=(32,), chunk=100)
    block = 100 * (32 * 4 + 8)
    with dmdask.LocalCluster(n_workers=2, ram=2 * block, ssd=3 * block, ssd_dir=str(tmp_path / "ssd")) as cluster, \
            distributed.Client(cluster) as client:
        spec = dmdask.Spec(path, batch_size=64)
        for epoch in range(2):
            per_rank = run_epoch(client, spec, epoch=epoch, world_size=2)
            assert np.array_equal(np.sort(all_ids(per_rank)), np.arange(1200))
            for batches in per_rank:
                for b in batches:
                    np.testing.assert_array_equal(b["x"], zarr_sample(b["index"], (32,)))
        stats = dmdask.stats(client)
        for worker in stats["workers"].values():
            assert worker["ram"]["bytes"] == 2 * block <= worker["ram"]["capacity"]
            assert worker["ssd"]["bytes"] == 3 * block <= worker["ssd"]["capacity"]
            assert worker["streamed_blocks"] == 1
        total = stats["total"]
        assert total["ram"]["hits"] == 2 * 400 and total["ssd"]["hits"] == 2 * 600
        assert total["stream"]["hits"] == 2 * 200
        ssd_files = [f for _, _, fs in os.walk(tmp_path / "ssd") for f in fs]
        assert len(ssd_files) == 6 * 2  # x and label of 3 blocks on each of 2 workers
    assert not [f for _, _, fs in os.walk(tmp_path / "ssd") for f in fs]  # removed with the workers


def test_folder_blocks_on_ssd_keep_variable_sizes(tmp_path):
    root = write_folder(str(tmp_path / "f"), classes=2, per_class=12)
    from dmdask.testing.datasets import folder_sample

    with dmdask.LocalCluster(n_workers=1, ram=0, ssd="10 MiB", ssd_dir=str(tmp_path / "ssd")) as cluster, \
            distributed.Client(cluster) as client:
        spec = dmdask.Spec(root, batch_size=5, block_size=6)
        for epoch in range(2):
            for b in dmdask.batches(client, spec, epoch=epoch):
                assert [d.tobytes() for d in b["data"]] == [folder_sample(int(i)) for i in b["index"]]
        total = dmdask.stats(client)["total"]
        # the first batch (5 samples) the opening rank read from the store itself
        assert total["ssd"]["blocks"] == 4 and total["ram"]["blocks"] == 0
        assert total["ssd"]["hits"] == 48 - 5 and total["stream"]["hits"] == total["shared_store"]["from_ranks"] == 5


def test_local_cluster_takes_unset_capacities_from_config():
    """`DASK_DMDASK__WORKER__RAM=...` and friends are not overridden by LocalCluster defaults."""
    import dask

    with dask.config.set({"dmdask.worker.ram": "3 MiB", "dmdask.worker.ssd": "5 MiB"}):
        with dmdask.LocalCluster(n_workers=1) as cluster, distributed.Client(cluster) as client:
            total = dmdask.stats(client)["total"]
    assert total["ram"]["capacity"] == 3 * 2**20 and total["ssd"]["capacity"] == 5 * 2**20
    with dmdask.LocalCluster(n_workers=1, ram="2 MiB") as cluster, distributed.Client(cluster) as client:
        assert dmdask.stats(client)["total"]["ram"]["capacity"] == 2 * 2**20  # a keyword wins
