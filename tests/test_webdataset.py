"""WebDataset tar shards as a source, over the counting HTTP store with real worker
processes: every sample once per epoch with the bytes that were written, and the store
traffic counted by the store itself (bytes of the .tar files it sent)."""
import io
import os
import tarfile

import dask
import distributed
import numpy as np
import pytest

import dmdask
from benchmarks.store_server import StoreServer
from dmdask.source import dataset_name, open_source
from dmdask.testing.sources import SourceTests
from dmdask.testing.datasets import tar_key, tar_member, write_tar_shards

from conftest import all_ids, run_epoch

SHARDS, PER_SHARD = 3, 40
N = SHARDS * PER_SHARD
EXTS = ("cls", "jpg", "seg.png")  # "seg.png": the key stops at the first dot
BOUND_SHARDS, BOUND_PER_SHARD = 4, 60  # the bound test's dataset: 240 samples, blocks of 4
BOUND_EXTS = ("cls", "jpg")


def write_store(root):  # the `store` fixture's datasets (conftest.py)
    write_tar_shards(str(root / "train"), SHARDS, PER_SHARD, EXTS, prefix="train-")
    write_tar_shards(str(root / "bound"), BOUND_SHARDS, BOUND_PER_SHARD, BOUND_EXTS, prefix="b-")


def pattern(server):
    return server.url + "/train/train-{000000..000002}.tar"


def check_batch(batch, exts=EXTS):
    ids = batch["index"]
    assert set(batch) == set(exts) | {"__key__", "index"}
    assert batch["__key__"].tolist() == [tar_key(int(i)) for i in ids]
    for ext in exts:
        assert [m.tobytes() for m in batch[ext]] == [tar_member(int(i), ext) for i in ids], ext


def member_bytes(n, exts):
    return sum(len(tar_member(i, e)) for i in range(n) for e in exts)


def tar_traffic(server, folder):
    """(bytes, requests) the store sent for the .tar files of `folder`."""
    paths = {p: v for p, v in server.stats()["by_path"].items() if p.startswith(folder + "/") and p.endswith(".tar")}
    return sum(v["bytes"] for v in paths.values()), sum(v["requests"] for v in paths.values())


def opening_traffic(server, spec, folder):
    """What opening the shards costs at the store (the tar headers), measured by opening
    them once here: the process that creates the dataset's blocks does the same reads."""
    server.reset_stats()
    source = open_source(spec)
    traffic = tar_traffic(server, folder)
    server.reset_stats()
    return source, traffic


def test_webdataset_reads_our_test_shards_as_we_do(store):
    """The format convention, checked against webdataset's own reader: the same samples
    (keys, extensions, bytes) in the same order."""
    import webdataset as wds  # the test extra

    _, root = store
    paths = sorted(str(p) for p in (root / "train").iterdir())
    theirs = list(wds.WebDataset(paths, shardshuffle=False))
    source = open_source(dmdask.Spec(paths, batch_size=4, block_size=16))
    ours = [source.reader(k).read() for k in range(source.info.num_blocks)]
    keys = [k for block in ours for k in block["__key__"].tolist()]
    assert [s["__key__"] for s in theirs] == keys == [tar_key(i) for i in range(N)]
    assert source.info.fields == ("__key__",) + tuple(sorted(EXTS))
    for ext in EXTS:
        mine = [m.tobytes() for block in ours for m in block[ext]]
        assert [s[ext] for s in theirs] == mine == [tar_member(i, ext) for i in range(N)]
    assert {k for s in theirs for k in s if not k.startswith("__")} == set(EXTS)


def write_tar(path, entries):
    """A tar of (name, bytes) regular members; bytes None makes a folder entry."""
    with tarfile.open(path, "w", format=tarfile.PAX_FORMAT) as tar:
        for name, data in entries:
            info = tarfile.TarInfo(name)
            if data is None:
                info.type = tarfile.DIRTYPE
                tar.addfile(info)
            else:
                info.size = len(data)
                tar.addfile(info, io.BytesIO(data))
    return path


def test_naming_edge_cases_match_webdataset(tmp_path):
    """Folders, metadata and extension-less members are skipped, extensions are
    lowercased, keys keep their folders, long (pax) names and empty members work."""
    import webdataset as wds  # the test extra

    long = "d/" + "x" * 150
    path = write_tar(str(tmp_path / "edge.tar"), [
        ("d", None), ("__meta__", b"m"), ("README", b"no extension"),
        ("d/a.JPG", b"a-jpg"), ("d/a.seg.PNG", b"a-png"), ("d/a.txt", b""),
        (long + ".jpg", b"long-jpg"), (long + ".seg.png", b"long-png"), (long + ".txt", b"t"),
        ("e/b.jpg", b"b-jpg"), ("e/b.seg.png", b""), ("e/b.txt", b"b-txt"),
    ])
    theirs = list(wds.WebDataset(path, shardshuffle=False))
    source = open_source(dmdask.Spec(path, batch_size=2, block_size=2))
    ours = [source.reader(k).read() for k in range(source.info.num_blocks)]
    keys = [k for block in ours for k in block["__key__"].tolist()]
    assert keys == [s["__key__"] for s in theirs] == ["d/a", long, "e/b"]
    assert source.info.fields == ("__key__", "jpg", "seg.png", "txt")
    for ext in ("jpg", "seg.png", "txt"):
        assert [m.tobytes() for block in ours for m in block[ext]] == [s[ext] for s in theirs]
    write_tar(path, [("a.jpg", b"1"), ("a.JPG", b"2")])
    with pytest.raises(dmdask.SourceError, match=r"edge.tar: sample 'a' has two members with extension 'jpg'"):
        open_source(dmdask.Spec(path, batch_size=2))


@pytest.fixture
def spec(store):
    """A brace pattern over HTTP; blocks of 16 samples span the shards of 40."""
    return dmdask.Spec(pattern(store[0]), batch_size=7, block_size=16, seed=4)


class TestWebDatasetSource(SourceTests):
    def check(self, batch):
        check_batch(batch)


def test_cache_holding_the_shards_reads_every_member_once(store):
    """C >= D, the folder form over HTTP: each member leaves the store once, in one
    request, over three epochs and three ranks; opening reads only the tar headers."""
    server, _ = store
    spec = dmdask.Spec(server.url + "/train", batch_size=8, block_size=12, seed=1)
    source, (header_bytes, header_requests) = opening_traffic(server, spec, "train")
    data = member_bytes(N, EXTS)
    assert source.info.nbytes == data + N * (3 * 8 + 16)
    assert header_requests <= N * len(EXTS) + 2 * SHARDS and header_bytes <= 1024 * header_requests
    with dmdask.LocalCluster(n_workers=2, ram="16 MiB") as cluster, distributed.Client(cluster) as client:
        for epoch in range(3):
            per_rank = run_epoch(client, spec, epoch=epoch, world_size=3)
            for batches in per_rank:
                for batch in batches:
                    check_batch(batch)
            assert np.array_equal(np.sort(all_ids(per_rank)), np.arange(N))
        sent, requests = tar_traffic(server, "train")
        assert sent == header_bytes + data
        assert requests == header_requests + N * len(EXTS)  # one range request per member, once
        total = dmdask.stats(client)["total"]
        # each member read once: for the rank that asked first (a stream hit), or ahead of it
        assert total["stream"]["hits"] + total["shared_store"]["read_ahead"] == N
        assert total["ram"]["hits"] + total["stream"]["hits"] == 3 * N
    print(f"\nevery byte once: D={data}, sent {sent - header_bytes} in {requests - header_requests} requests "
          f"(+{header_bytes} in {header_requests} for the headers at open)")


def test_half_capacity_meets_the_bound(store):
    """C ~ D/2, a list of shard URLs, the exact global shuffle: the members of cached
    blocks leave the store once, the others once per epoch: E*D - C*(E-1)."""
    server, _ = store
    n = BOUND_SHARDS * BOUND_PER_SHARD
    urls = [f"{server.url}/bound/b-{s:06d}.tar" for s in range(BOUND_SHARDS)]
    spec = dmdask.Spec(urls, batch_size=10, block_size=4, seed=7)
    source, (header_bytes, _) = opening_traffic(server, spec, "bound")
    data = member_bytes(n, BOUND_EXTS)
    overhead = 2 * 8 + 16  # per sample in memory: two object pointers and a key
    assert source.info.nbytes == data + n * overhead
    per_worker = source.info.nbytes // 4  # two workers: half the dataset
    epochs = 3
    with dmdask.LocalCluster(n_workers=2, ram=per_worker, stream_buffer=0) as cluster, \
            distributed.Client(cluster) as client:
        for epoch in range(epochs):
            per_rank = run_epoch(client, spec, epoch=epoch, world_size=2)
            for batches in per_rank:
                for batch in batches:
                    check_batch(batch, BOUND_EXTS)
            assert np.array_equal(np.sort(all_ids(per_rank)), np.arange(n))
        sent, _ = tar_traffic(server, "bound")
        total = dmdask.stats(client)["total"]
    cached = total["ram"]["bytes"] - overhead * total["ram"]["samples"]  # member bytes of the RAM blocks
    assert 0 < total["ram"]["samples"] < n and total["ram"]["bytes"] <= 2 * per_worker
    assert sent - header_bytes == epochs * data - (epochs - 1) * cached
    capacity = data // 2
    bound = epochs * data - (epochs - 1) * capacity
    assert abs((sent - header_bytes) - bound) <= 0.05 * bound, (sent - header_bytes, bound)
    print(f"\nbound: D={data} C={capacity} (cached {cached}) E={epochs}: sent {sent - header_bytes} "
          f"(+{header_bytes} headers at open), E*D-C*(E-1)={bound}, off by {(sent - header_bytes) / bound - 1:+.2%}")


def test_ssd_tier_keeps_whole_blocks_in_files(store, tmp_path):
    """No RAM tier: each block is read whole into the SSD tier's files (members as
    values + offsets, keys as strings), which the ranks map; still every member once (those
    of the first batch the opening rank read itself are given to the whole reads)."""
    server, _ = store
    spec = dmdask.Spec(pattern(server), batch_size=9, block_size=20, seed=2)
    _, (header_bytes, _) = opening_traffic(server, spec, "train")
    with dmdask.LocalCluster(n_workers=2, ram=0, ssd="16 MiB", ssd_dir=str(tmp_path)) as cluster, \
            distributed.Client(cluster) as client:
        for epoch in range(2):
            per_rank = run_epoch(client, spec, epoch=epoch, world_size=2)
            for batches in per_rank:
                for batch in batches:
                    check_batch(batch)
            assert np.array_equal(np.sort(all_ids(per_rank)), np.arange(N))
        total = dmdask.stats(client)["total"]
        # the rank that opened the dataset read its first batch (9 members) from the store
        # itself: served from the store (stream hits), then given to the blocks' workers
        assert total["ssd"]["blocks"] == N // 20 and total["ssd"]["hits"] == 2 * N - 9
        assert total["stream"]["hits"] == total["shared_store"]["from_ranks"] == 9
    assert tar_traffic(server, "train")[0] == header_bytes + member_bytes(N, EXTS)


def test_keys_select_extensions_and_only_their_members_are_read(client, store):
    server, _ = store
    spec = dmdask.Spec(pattern(server), batch_size=16, keys=["jpg"], block_size=32)
    _, (header_bytes, _) = opening_traffic(server, spec, "train")
    per_rank = run_epoch(client, spec, world_size=2)
    for batches in per_rank:
        for batch in batches:
            check_batch(batch, ("jpg",))
    assert np.array_equal(np.sort(all_ids(per_rank)), np.arange(N))
    assert tar_traffic(server, "train")[0] == header_bytes + member_bytes(N, ("jpg",))
    for bad in (["JPG"], ["nope"], ["__key__"]):
        with pytest.raises(dmdask.SpecError, match=r"extensions among \['cls', 'jpg', 'seg.png'\]") as info:
            dmdask.batches(client, spec.replace(keys=bad))
        assert info.value.field == "keys"


def test_forms_of_source_read_the_same_dataset(store):
    """A brace pattern, a folder and a list, over HTTP and locally, and one .tar URL."""
    server, root = store
    local = sorted(str(p) for p in (root / "train").iterdir())
    forms = [pattern(server), server.url + "/train", server.url + "/train/", str(root / "train"), local,
             [server.url + "/train/" + os.path.basename(p) for p in local],
             str(root / "train" / "train-{000000..000002}.tar")]
    for form in forms:
        source = open_source(dmdask.Spec(form, batch_size=4, block_size=50))
        assert (source.info.num_samples, source.info.num_blocks) == (N, 3), form
        for k in range(3):
            check_batch(dict(source.reader(k).read(), index=np.arange(*source.info.block_range(k))))
    one = open_source(dmdask.Spec(server.url + "/train/train-000001.tar", batch_size=4))
    assert one.info.num_samples == PER_SHARD and one.reader(0).read()["__key__"][0] == tar_key(PER_SHARD)


def test_spec_takes_a_list_of_shards():
    from pathlib import Path

    spec = dmdask.Spec(["a.tar", Path("b.tar")], batch_size=2)
    assert spec.source == (os.path.abspath("a.tar"), os.path.abspath("b.tar"))  # resolved on the client
    assert dataset_name(spec) == dataset_name(dmdask.Spec(("a.tar", "b.tar/"), batch_size=2))
    assert dataset_name(spec) != dataset_name(dmdask.Spec(["b.tar", "a.tar"], batch_size=2))
    for bad in ([], ["a.tar", ""], ["a.tar", 3], [None]):
        with pytest.raises(dmdask.SpecError, match="list of shard or sample-file paths or URLs") as info:
            dmdask.Spec(bad, batch_size=2)
        assert info.value.field == "source"
    with pytest.raises(dmdask.SpecError, match="brace pattern") as info:
        open_source(dmdask.Spec("train-{000000..000002.tar", batch_size=2))
    assert info.value.field == "source"


# -- bad shards ------------------------------------------------------------------------------

def bad_store(tmp_path, **kwargs):
    write_tar_shards(str(tmp_path / "bad"), shards=2, per_shard=10, exts=("cls", "jpg"), prefix="bad-", **kwargs)
    return StoreServer(str(tmp_path))


def members(path):
    with tarfile.open(path) as tar:
        return tar.getmembers()


def test_sample_missing_a_member_names_shard_and_key(client, tmp_path):
    with bad_store(tmp_path, skip={(13, "jpg")}) as server:
        spec = dmdask.Spec(server.url + "/bad/bad-{000000..000001}.tar", batch_size=4)
        with pytest.raises(dmdask.SourceError) as info:
            dmdask.batches(client, spec)
        message = str(info.value)
        assert f"{server.url}/bad/bad-000001.tar" in message and tar_key(13) in message and "jpg" in message
        # naming the extensions every sample has is the way out
        ids = all_ids(run_epoch(client, spec.replace(keys=["cls"]), world_size=1))
        assert np.array_equal(np.sort(ids), np.arange(20))


@pytest.mark.parametrize("cut", ["member", "header"])
def test_truncated_shard_names_the_shard(client, tmp_path, cut):
    with bad_store(tmp_path) as server:
        path = str(tmp_path / "bad" / "bad-000001.tar")
        last = members(path)[-3]  # a member with two after it
        size = last.offset_data + last.size // 2 if cut == "member" else last.offset + 100
        with open(path, "r+b") as f:
            f.truncate(size)
        with pytest.raises(dmdask.SourceError, match="truncated") as info:
            dmdask.batches(client, dmdask.Spec(server.url + "/bad", batch_size=4))
        assert f"{server.url}/bad/bad-000001.tar" in str(info.value)
        if cut == "member":
            assert last.name.split(".")[0] in str(info.value)


def test_unreachable_or_unreadable_shards(client, tmp_path):
    with bad_store(tmp_path) as server:
        with pytest.raises(dmdask.SourceNotFoundError) as info:
            dmdask.batches(client, dmdask.Spec(server.url + "/bad/bad-{000000..000002}.tar", batch_size=4))
        assert f"{server.url}/bad/bad-000002.tar does not exist" in str(info.value)
        with open(tmp_path / "bad" / "bad-000001.tar", "wb") as f:
            f.write(os.urandom(3000))
        with pytest.raises(dmdask.SourceError, match="bad-000001.tar is not a readable tar file"):
            dmdask.batches(client, dmdask.Spec(server.url + "/bad", batch_size=4))
        os.makedirs(tmp_path / "bad" / "sub")
        with pytest.raises(dmdask.SourceError, match="both .tar files and subfolders"):
            dmdask.batches(client, dmdask.Spec(server.url + "/bad", batch_size=4))
    refused = r"after \d+ tries .* cannot reach WebDataset shard http://127.0.0.1:1/x-0.tar"  # retried, then named
    with dask.config.set({"dmdask.store.retry-seconds": 0.5}), pytest.raises(dmdask.SourceNotFoundError, match=refused):
        dmdask.batches(client, dmdask.Spec("http://127.0.0.1:1/x-{0..1}.tar", batch_size=4))


def test_shard_damaged_after_opening_fails_only_its_blocks(tmp_path):
    """No cache room: members are read when a batch wants them, so a shard truncated
    after opening fails the blocks reading it, with the shard URL and the samples."""
    with bad_store(tmp_path) as server:
        spec = dmdask.Spec(server.url + "/bad", batch_size=5, block_size=5, shuffle=False, prefetch=1)
        with dmdask.LocalCluster(n_workers=1, ram=0) as cluster, distributed.Client(cluster) as client:
            it = dmdask.batches(client, spec)
            os.truncate(tmp_path / "bad" / "bad-000001.tar", 2048)
            assert np.array_equal(next(it)["index"], np.arange(5))
            assert np.array_equal(next(it)["index"], np.arange(5, 10))
            with pytest.raises(dmdask.BlockReadError) as info:
                next(it)
        message = str(info.value)
        assert "samples 10..14" in message and f"{server.url}/bad/bad-000001.tar" in message
