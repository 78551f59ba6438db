"""Parquet sources on real worker processes, read from a counting HTTP store: every row
once per epoch with the files' values, only the wanted column chunks leave the store,
the traffic bound, and bad files named in the error."""
import os
import shutil
import struct

import distributed
import numpy as np
import pytest

import dmdask
from dmdask.source import open_source
from dmdask.source.parquet_footer import framed
from dmdask.testing.sources import SourceTests
from dmdask.testing.datasets import parquet_columns, write_parquet, zarr_label, zarr_sample

from conftest import all_ids, run_epoch

pa = pytest.importorskip("pyarrow")
pq = pytest.importorskip("pyarrow.parquet")

ROWS = [250, 250, 100]  # 600 samples in row groups of 50: the last file's last group ends the dataset
EVEN_ROWS, EVEN_GROUP, EVEN_WIDTH = [256] * 4, 64, 64  # 16 row groups of equal size on the store


def store_bytes(paths, columns=None):
    """(bytes of the column chunks of `columns` (all when None), bytes of the footers
    with their 8-byte tails), from the files' metadata."""
    data = footers = 0
    for path in paths:
        meta = pq.read_metadata(path)
        for g in range(meta.num_row_groups):
            for c in range(meta.num_columns):
                chunk = meta.row_group(g).column(c)
                if columns is None or chunk.path_in_schema.split(".")[0] in columns:
                    data += chunk.total_compressed_size
        with open(path, "rb") as f:
            f.seek(-8, 2)
            footers += struct.unpack("<I", f.read(4))[0] + 8
    return data, footers


def sent(server, folder):
    """Bytes the store sent for the Parquet files of `folder`."""
    return sum(v["bytes"] for p, v in server.stats()["by_path"].items()
               if p.startswith(folder + "/") and p.endswith(".parquet"))


def check_values(batch):
    ids = batch["index"]
    want = parquet_columns(ids)
    np.testing.assert_array_equal(batch["x"], zarr_sample(ids, (8,)))
    np.testing.assert_array_equal(batch["label"], zarr_label(ids))
    assert batch["name"].dtype == np.dtypes.StringDType() and batch["name"].tolist() == want["name"]
    assert batch["blob"].dtype == object and [b.tobytes() for b in batch["blob"]] == want["blob"]


def write_store(root):  # the `store` fixture's datasets (conftest.py)
    write_parquet(str(root / "ds"), ROWS, row_group=50)
    write_parquet(str(root / "even"), EVEN_ROWS, row_group=EVEN_GROUP, width=EVEN_WIDTH, columns=["x", "label"],
                  compression="none", use_dictionary=False)


@pytest.fixture
def spec(store):
    return dmdask.Spec(store[0].url + "/ds/*.parquet", batch_size=32, seed=4)


class TestParquetSource(SourceTests):
    def check(self, batch):
        assert set(batch) == {"x", "label", "name", "blob", "index"}
        check_values(batch)

    def test_blocks_are_row_groups(self, spec):
        info = open_source(spec).info
        assert (info.block_len, info.num_blocks, info.fields) == (50, 12, ("blob", "label", "name", "x"))


def test_folder_and_single_file_sources(client, store):
    server, root = store
    in_order = dmdask.Spec(server.url + "/ds", batch_size=64, shuffle=False)
    per_rank = run_epoch(client, in_order, world_size=2)
    for batches in per_rank:
        for b in batches:
            check_values(b)
    assert np.array_equal(np.sort(all_ids(per_rank)), np.arange(600))
    # one file on its own: ids start at 0 in it (its rows are samples 250..499 of the folder)
    one = list(dmdask.batches(client, dmdask.Spec(str(root / "ds" / "part-00001.parquet"), batch_size=100,
                                                  shuffle=False)))
    assert np.array_equal(np.concatenate([b["index"] for b in one]), np.arange(250))
    np.testing.assert_array_equal(np.concatenate([b["label"] for b in one]), zarr_label(np.arange(250, 500)))


def test_keys_read_only_their_column_chunks(client, store):
    server, root = store
    files = sorted(str(p) for p in (root / "ds").glob("*.parquet"))
    label_bytes, footer_bytes = store_bytes(files, ["label"])
    all_bytes, _ = store_bytes(files)
    spec = dmdask.Spec(server.url + "/ds", batch_size=50, keys=["label"], seed=1)
    for s in (spec, spec.replace(keys=None)):
        dmdask.release(client, s)  # read from the store afresh
    server.reset_stats()
    batches = [b for rank in run_epoch(client, spec, world_size=2) for b in rank]
    assert set(batches[0]) == {"label", "index"}
    for b in batches:
        np.testing.assert_array_equal(b["label"], zarr_label(b["index"]))
    assert sent(server, "ds") == footer_bytes + label_bytes  # the footers once, then the label chunks only
    server.reset_stats()
    run_epoch(client, spec.replace(keys=None, seed=2), world_size=2)
    assert sent(server, "ds") == footer_bytes + all_bytes
    assert label_bytes < all_bytes / 5


def even_block_bytes(root):
    """Bytes of one block on the store (one row group, every group the same size), and D."""
    files = sorted(str(p) for p in (root / "even").glob("*.parquet"))
    data, footers = store_bytes(files)
    per_group = {sum(meta.row_group(g).column(c).total_compressed_size for c in range(meta.num_columns))
                 for meta in map(pq.read_metadata, files) for g in range(meta.num_row_groups)}
    assert len(per_group) == 1  # uniform row groups
    return data // 16, data, footers


def test_cache_holding_the_dataset_reads_every_row_group_once(store):
    server, root = store
    _, dataset, footers = even_block_bytes(root)
    with dmdask.LocalCluster(n_workers=2, ram="16 MiB") as cluster, distributed.Client(cluster) as client:
        server.reset_stats()
        spec = dmdask.Spec(server.url + "/even", batch_size=32, seed=5)
        for epoch in range(3):
            ids = all_ids(run_epoch(client, spec, epoch=epoch, world_size=2))
            assert np.array_equal(np.sort(ids), np.arange(1024))
        assert sent(server, "even") - footers == dataset  # the bound at C >= D: E*D - D*(E-1) = D
        assert dmdask.stats(client)["total"]["ram"]["blocks"] == 16


def test_half_capacity_meets_the_bound(store):
    server, root = store
    block_store, dataset, footers = even_block_bytes(root)
    block = EVEN_GROUP * (EVEN_WIDTH * 4 + 8)  # decoded: x float32 rows and an int64 label
    epochs = 3
    with dmdask.LocalCluster(n_workers=2, ram=4 * block, stream_buffer=4 * block) as cluster, \
            distributed.Client(cluster) as client:
        server.reset_stats()
        spec = dmdask.Spec(server.url + "/even", batch_size=16, seed=2, shuffle_window=2, prefetch=2)
        for epoch in range(epochs):
            per_rank = run_epoch(client, spec, epoch=epoch, world_size=2)
            for batches in per_rank:
                for b in batches:
                    np.testing.assert_array_equal(b["x"], zarr_sample(b["index"], (EVEN_WIDTH,)))
            assert np.array_equal(np.sort(all_ids(per_rank)), np.arange(1024))
        total = dmdask.stats(client)["total"]
        assert total["ram"]["blocks"] == 8 and total["streamed_blocks"] == 8  # C = D/2
        cached = 8 * block_store
        bound = epochs * dataset - cached * (epochs - 1)
        data = sent(server, "even") - footers
        print(f"parquet C=D/2: {data} bytes from the store, bound {bound} ({data / bound:.4f})")
        assert bound <= data <= 1.05 * bound


def copy_ds(root, name):
    shutil.copytree(root / "ds", root / name)
    return root / name


def test_corrupt_footer_names_the_file_and_its_samples(client, store):
    server, root = store
    folder = copy_ds(root, "bad-footer")
    path = folder / "part-00001.parquet"
    raw = bytearray(path.read_bytes())
    length = struct.unpack("<I", raw[-8:-4])[0]
    raw[-8 - length:-8] = b"\xff" * length
    path.write_bytes(bytes(raw))
    with pytest.raises(dmdask.SourceError) as info:
        dmdask.batches(client, dmdask.Spec(server.url + "/bad-footer", batch_size=8))
    message = str(info.value)
    assert "bad-footer/part-00001.parquet" in message and "samples from 250 on" in message


def test_truncated_file_names_the_file_and_its_samples(client, store):
    server, root = store
    folder = copy_ds(root, "truncated")
    path = folder / "part-00002.parquet"
    path.write_bytes(path.read_bytes()[:-100])
    with pytest.raises(dmdask.SourceError, match="PAR1") as info:
        dmdask.batches(client, dmdask.Spec(server.url + "/truncated/*.parquet", batch_size=8))
    message = str(info.value)
    assert "truncated/part-00002.parquet" in message and "samples from 500 on" in message


def test_column_missing_in_one_file(client, store):
    server, root = store
    folder = root / "mismatch"
    write_parquet(str(folder), ROWS[:1], row_group=50)
    os.rename(write_parquet(str(folder / "tmp"), ROWS, row_group=50, columns=["x", "label"])[1],
              folder / "part-00001.parquet")
    shutil.rmtree(folder / "tmp")
    with pytest.raises(dmdask.SourceError) as info:
        dmdask.batches(client, dmdask.Spec(server.url + "/mismatch", batch_size=8))
    message = str(info.value)
    assert "mismatch/part-00001.parquet (samples 250..499)" in message and "'blob'" in message
    assert "keys" in message
    # naming the columns every file has is the way out
    spec = dmdask.Spec(server.url + "/mismatch", batch_size=100, keys=["label", "x"], shuffle=False)
    ids = all_ids(run_epoch(client, spec, world_size=2))
    assert np.array_equal(np.sort(ids), np.arange(500))


def test_corrupt_column_chunk_names_the_file_and_the_samples(client, store):
    server, root = store
    folder = copy_ds(root, "bad-chunk")
    path = folder / "part-00001.parquet"
    chunk = pq.read_metadata(str(path)).row_group(1).column(0)  # samples 300..349
    raw = bytearray(path.read_bytes())
    raw[chunk.data_page_offset:chunk.data_page_offset + 16] = b"\xff" * 16  # its page header
    path.write_bytes(bytes(raw))
    delivered = []
    with pytest.raises(dmdask.BlockReadError) as info:
        for b in dmdask.batches(client, dmdask.Spec(server.url + "/bad-chunk", batch_size=25, shuffle=False)):
            delivered.append(b["index"])
    assert np.array_equal(np.concatenate(delivered), np.arange(300))  # every batch before the bad row group
    message = str(info.value)
    assert "samples 300..349" in message and "bad-chunk/part-00001.parquet (its rows 50..99)" in message


def test_block_size_must_keep_row_groups_whole(client, store, tmp_path):
    server, root = store
    with pytest.raises(dmdask.SpecError, match="row-group boundaries.*such as 50") as info:
        dmdask.batches(client, dmdask.Spec(server.url + "/ds", batch_size=8, block_size=75))
    assert info.value.field == "block_size"
    assert open_source(dmdask.Spec(server.url + "/ds", batch_size=8, block_size=100)).info.block_len == 100
    # files of 120 rows in groups of 50 (50, 50, 20): the smallest whole-group block is a file
    write_parquet(str(tmp_path / "ragged"), [120, 120, 120], row_group=50)
    info = open_source(dmdask.Spec(str(tmp_path / "ragged"), batch_size=8)).info
    assert (info.block_len, info.num_blocks) == (120, 3)
    # blocks of 20 row groups: each reader carries a footer of its own 20 groups
    (path,) = write_parquet(str(tmp_path / "many"), [200], row_group=5)
    source = open_source(dmdask.Spec(path, batch_size=8, block_size=100))
    for k in (0, 1):
        reader = source.reader(k)
        assert pq.read_metadata(pa.BufferReader(framed(reader.parts[0].footer))).num_row_groups == 20
        np.testing.assert_array_equal(reader.read()["label"], zarr_label(np.arange(100 * k, 100 * k + 100)))


def test_without_pyarrow_the_error_names_the_extra(monkeypatch, store):
    server, _ = store
    import sys

    monkeypatch.setitem(sys.modules, "pyarrow", None)
    monkeypatch.setitem(sys.modules, "pyarrow.parquet", None)
    with pytest.raises(ImportError, match=r"dmdask\[formats\]"):
        open_source(dmdask.Spec(server.url + "/ds", batch_size=8))



def test_columns_dmdask_cannot_batch(tmp_path):
    """Variable-length lists are left out with a warning, named in an error when keys
    ask for them; null values fail the block that holds them."""
    path = str(tmp_path / "odd.parquet")
    pq.write_table(pa.table({"label": pa.array([1, 2, None, 4], pa.int64()), "tags": [[1], [], [2, 3], [4]]}), path)
    with pytest.warns(UserWarning, match=r"\{'tags': 'list<element: int64>'\}.*not read"):
        source = open_source(dmdask.Spec(path, batch_size=2))
    assert source.info.fields == ("label",)
    with pytest.raises(dmdask.SpecError, match="tags") as info:
        open_source(dmdask.Spec(path, batch_size=2, keys=["tags"]))
    assert info.value.field == "keys"
    with pytest.raises(dmdask.BlockReadError) as error:
        source.reader(0).read()
    assert "samples 0..3" in str(error.value) and "odd.parquet (its rows 0..3)" in str(error.value)
    assert "'label' holds 1 null values" in str(error.value)
