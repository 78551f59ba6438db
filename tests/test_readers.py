"""Transparent mode under the readers people hold their data with (the `readers` extra):
DuckDB and Hugging Face `datasets`, each through `dmdask://URL` against the counting
HTTP store: the same rows as the direct read, and the store sends each byte once
(<= 1.02x the dataset over 3 passes)."""
import distributed
import fsspec
import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq
import pytest

import dmdask
import dmdask.fs
from benchmarks.store_server import StoreServer

PARTS = 4
ROWS = 2500  # per part, in row groups of 500: a reader's ranged reads span several blocks
BLOCK = 16 << 10  # a part is several blocks of this size
PASSES = 3


FOLDERS = ["duckdb", "hf-stream", "hf-download", "hf-loader"]  # one per test: each starts with nothing cached


def write_store(root):
    for name in FOLDERS:
        folder = root / name
        folder.mkdir()
        rng = np.random.default_rng(3)
        for i in range(PARTS):
            ids = np.arange(i * ROWS, (i + 1) * ROWS)
            table = pa.table({"id": ids, "x": rng.normal(size=ROWS), "label": [f"s{j}" for j in ids]})
            pq.write_table(table, str(folder / f"part-{i:03d}.parquet"), row_group_size=500)


@pytest.fixture(scope="module")
def store(tmp_path_factory):
    root = tmp_path_factory.mktemp("pfs")
    write_store(root)
    with StoreServer(str(root)) as server:
        yield server, root


@pytest.fixture(scope="module")
def client():
    with dmdask.LocalCluster(n_workers=2, ram="64 MiB", dashboard_address=None) as cluster, \
            distributed.Client(cluster) as c, dask_config(BLOCK):
        yield c
        dmdask.fs.close()


def dask_config(block):
    import dask.config
    return dask.config.set({"dmdask.fs.block-size": block})


def direct_rows(folder) -> list[tuple]:
    """The rows of every part of `folder`, read from local disk with pyarrow, sorted."""
    table = pa.concat_tables(pq.read_table(str(p)) for p in sorted(folder.iterdir()))
    return sorted(zip(table["id"].to_pylist(), table["x"].to_pylist(), table["label"].to_pylist()))


def sent_ratio(server, folder) -> float:
    """Bytes the store sent for the parts of `folder`, as a multiple of their size."""
    by_path = server.stats()["by_path"]
    sizes = {f"{folder.name}/{p.name}": p.stat().st_size for p in folder.iterdir()}
    return sum(by_path.get(p, {"bytes": 0})["bytes"] for p in sizes) / sum(sizes.values())


def test_duckdb_reads_parquet_through_dmdask(store, client):
    import duckdb
    server, root = store
    folder = root / "duckdb"
    con = duckdb.connect()
    con.register_filesystem(fsspec.filesystem("dmdask"))  # any target: each URL names its own
    for _ in range(PASSES):
        got = con.sql(f"SELECT id, x, label FROM read_parquet('dmdask://{server.url}/duckdb/*.parquet')").fetchall()
        assert sorted(got) == direct_rows(folder)
    local = con.sql(f"SELECT count(*) FROM read_parquet('dmdask://{folder}/*.parquet')").fetchall()  # local files too
    assert local == [(len(direct_rows(folder)),)]
    assert 0.99 <= sent_ratio(server, folder) <= 1.02
    with pytest.raises(ValueError, match="target_protocol='http'"):  # a filesystem over local files names the fix
        fsspec.filesystem("dmdask", target_protocol="file").ls(f"dmdask://{server.url}/duckdb/")


@pytest.mark.parametrize("streaming", [True, False])
def test_hugging_face_datasets_read_dmdask_data_files(store, client, streaming, tmp_path):
    import datasets
    server, root = store
    folder = root / ("hf-stream" if streaming else "hf-download")
    files = [f"dmdask://{server.url}/{folder.name}/part-{i:03d}.parquet" for i in range(PARTS)]
    for n, patterns in enumerate([files, [f"dmdask://{server.url}/{folder.name}/*.parquet"], files]):
        loaded = datasets.load_dataset("parquet", data_files=patterns, split="train", streaming=streaming,
                                       cache_dir=str(tmp_path / f"hf-{n}"))  # a new cache: each pass reads the files
        assert sorted((r["id"], r["x"], r["label"]) for r in loaded) == direct_rows(folder)
    assert 0.99 <= sent_ratio(server, folder) <= 1.02


def test_hugging_face_shuffled_stream_under_a_dataloader(store, client, tmp_path):
    """IterableDataset.shuffle(seed) under a torch DataLoader with 2 worker processes, 3
    epochs: the same ids in the same order as the same pipeline over the local files,
    each byte from the store once."""
    import datasets
    import torch.utils.data
    server, root = store
    folder = root / "hf-loader"

    def orders(pattern):
        stream = datasets.load_dataset("parquet", data_files=[pattern], split="train", streaming=True,
                                       cache_dir=str(tmp_path))
        stream = stream.shuffle(seed=7, buffer_size=1000)
        out = []
        for epoch in range(PASSES):
            stream.set_epoch(epoch)
            loader = torch.utils.data.DataLoader(stream.with_format("torch"), batch_size=500, num_workers=2)
            out.append([int(i) for batch in loader for i in batch["id"]])
        return out

    want = orders(str(folder / "*.parquet"))
    assert sorted(want[0]) == [row[0] for row in direct_rows(folder)]
    assert orders(f"dmdask://{server.url}/hf-loader/*.parquet") == want
    assert 0.99 <= sent_ratio(server, folder) <= 1.02
