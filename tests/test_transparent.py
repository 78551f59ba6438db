"""Transparent mode (`dmdask::` URLs): unmodified loaders read through the cluster's
cache. Bytes are counted by the HTTP store itself (benchmarks.store_server)."""
import json
import os
import subprocess
import sys

import distributed
import fsspec
import numpy as np
import pytest

import dmdask
import dmdask.fs
from dmdask.protocol.scheduler import OpenBlocks, SchedulerAPI
from dmdask.testing.datasets import tar_key, tar_member, write_folder, write_tar_shards
from benchmarks.store_server import StoreServer

from transparent_loader import SIZES

HERE = os.path.dirname(os.path.abspath(__file__))
ROOT = os.path.dirname(HERE)
PROCESS_SECONDS = 240  # the most a rank process may take


def file_sizes(folder, root):
    """{path relative to root: size} of every file under `folder`."""
    return {os.path.relpath(os.path.join(d, f), root): os.path.getsize(os.path.join(d, f))
            for d, _, names in os.walk(folder) for f in names}


# a process whose 4 threads each read every URL of argv[2:] in one `cat`; prints each thread's digests
RACING = ("import concurrent.futures, hashlib, json, sys, fsspec\n"
          "import dmdask\n"
          "fs = fsspec.filesystem('dmdask', target_protocol='http', scheduler=sys.argv[1])\n"
          "urls = sys.argv[2:]\n"
          "def read(_):\n"
          "    got = fs.cat(urls)\n"
          "    return [hashlib.sha1(got[u]).hexdigest() for u in urls]\n"
          "with concurrent.futures.ThreadPoolExecutor(4) as pool:\n"
          "    print(json.dumps(list(pool.map(read, range(4)))))\n")


def new_files(server, root, name: str, count: int, seed: int, first: int, step: int):
    """`count` files of random bytes (`first` + `step` * i bytes) in folder `name` of the
    store: ({path: size}, their URLs in path order)."""
    folder = root / name
    folder.mkdir()
    rng = np.random.default_rng(seed)
    for i in range(count):
        (folder / f"f{i:02d}.bin").write_bytes(rng.integers(0, 256, first + step * i, dtype=np.uint8).tobytes())
    sizes = file_sizes(folder, root)
    return sizes, [f"{server.url}/{p}" for p in sorted(sizes)]


def sent(store, paths):
    by_path = store.stats()["by_path"]
    return {p: by_path.get(p, {"requests": 0, "bytes": 0}) for p in paths}


def env(**extra):
    """This process's environment for a child, with `extra` set (None: removed)."""
    out = dict(os.environ, PYTHONPATH=os.pathsep.join([ROOT, os.environ.get("PYTHONPATH", "")]))
    out.update(extra)
    return {k: v for k, v in out.items() if v is not None}


@pytest.fixture(scope="module")
def store(tmp_path_factory):
    root = tmp_path_factory.mktemp("pfs")
    write_folder(str(root / "images"), classes=3, per_class=20, **SIZES)
    write_tar_shards(str(root / "shards"), shards=4, per_shard=25)
    with StoreServer(str(root)) as server:
        yield server, root


@pytest.fixture(scope="module")
def cluster():
    with dmdask.LocalCluster(n_workers=2, ram="64 MiB", dashboard_address=None) as c:
        yield c
        dmdask.fs.close()  # this process's connections to it


@pytest.mark.slow
def test_folder_dataset_through_dataloader_workers_leaves_the_store_once(store, cluster, tmp_path):
    """Two ranks (processes; one with fork DataLoader workers made anew each epoch, one
    with spawn workers) x 3 epochs, an ImageFolder-like Dataset over fsspec: every
    sample right, every file's bytes sent by the store once."""
    server, root = store
    sizes = file_sizes(root / "images", root)
    server.reset_stats()
    ranks = []
    for rank, method in enumerate(["fork", "spawn"]):
        out = tmp_path / f"rank{rank}.json"
        cmd = [sys.executable, os.path.join(HERE, "transparent_loader.py"), cluster.scheduler_address,
               f"dmdask::{server.url}/images", str(rank), "2", "3", method, str(out)]
        ranks.append((subprocess.Popen(cmd, env=env(DMDASK_FS_RUN="job-1")), out))
    for proc, _ in ranks:
        assert proc.wait(timeout=PROCESS_SECONDS) == 0
    results = [json.loads(out.read_text()) for _, out in ranks]
    assert all(r["wrong"] == 0 for r in results)
    for epoch in range(3):
        ids = sorted(i for r in results for i in r["ids"][epoch])
        assert ids == list(range(60))
    counts = sent(server, sizes)
    assert {p: c["bytes"] for p, c in counts.items()} == sizes  # each file's bytes once, over 2 ranks x 3 epochs
    assert all(c["requests"] == 1 for c in counts.values())
    listings = {p: v["requests"] for p, v in server.stats()["by_path"].items() if not p.endswith(".bin")}
    assert max(listings.values()) <= 2, listings  # once per run (per rank at most), not per epoch or loader
    with distributed.Client(cluster) as client:
        total = dmdask.stats(client)["total"]
    assert total["shared_store"]["requests"] == 60
    assert total["ram"]["hits"] >= 60  # rows served from RAM, counted like any other read


def test_webdataset_pipeline_through_dmdask(store, cluster):
    import webdataset  # the test extra
    server, root = store
    sizes = file_sizes(root / "shards", root)
    with distributed.Client(cluster):
        server.reset_stats()
        # one URL per shard pattern: webdataset splits a string of URLs at "::"
        url = f"dmdask://{server.url}/shards/shard-{{000000..000003}}.tar"
        for _ in range(2):
            samples = list(webdataset.WebDataset(url, shardshuffle=False, empty_check=False))
            assert [s["__key__"] for s in samples] == [tar_key(i) for i in range(100)]
            for i, s in enumerate(samples):
                assert s["jpg"] == tar_member(i, "jpg") and s["cls"] == tar_member(i, "cls")
    assert {p: c["bytes"] for p, c in sent(server, sizes).items()} == sizes


def test_zarr_array_through_dmdask(store, cluster, tmp_path):
    import zarr
    server, root = store
    data = np.arange(40 * 30, dtype="float32").reshape(40, 30)
    array = zarr.create_array(str(root / "arr.zarr"), shape=data.shape, chunks=(8, 30), dtype="float32",
                              compressors=None)
    array[:] = data
    sizes = file_sizes(root / "arr.zarr", root)
    with distributed.Client(cluster):
        server.reset_stats()
        for _ in range(2):
            opened = zarr.open_array(f"dmdask::{server.url}/arr.zarr", mode="r")
            np.testing.assert_array_equal(opened[:], data)
            np.testing.assert_array_equal(opened[9:17, 3], data[9:17, 3])
    assert {p: c["bytes"] for p, c in sent(server, sizes).items()} == sizes


def test_range_reads_of_a_large_file_read_only_the_blocks_they_touch(store, cluster):
    server, root = store
    rng = np.random.default_rng(3)
    content = rng.integers(0, 256, 10 * 2**20 + 123, dtype=np.uint8).tobytes()
    (root / "large.bin").write_bytes(content)
    block = 2**20
    with distributed.Client(cluster):
        server.reset_stats()
        fs = fsspec.filesystem("dmdask", target_protocol="http", block_size=block)
        url = f"{server.url}/large.bin"
        assert fs.cat_file(url, start=3 * block + 10, end=3 * block + 5000) == content[3 * block + 10:3 * block + 5000]
        with fs.open(url) as f:
            f.seek(7 * block - 3)
            assert f.read(6) == content[7 * block - 3:7 * block + 3]  # spans blocks 6 and 7
        assert sent(server, ["large.bin"])["large.bin"] == {"requests": 3, "bytes": 3 * block}
        with fs.open(url) as f:
            assert f.read() == content
        assert sent(server, ["large.bin"])["large.bin"]["bytes"] == len(content)


def _read_in_new_run(url, scheduler):
    code = ("import fsspec, hashlib, distributed, dmdask, sys\n"
            f"with distributed.Client({scheduler!r}):\n"
            f"    print(hashlib.sha1(fsspec.open({url!r}).open().read()).hexdigest())\n")
    out = subprocess.run([sys.executable, "-c", code], env=env(DMDASK_FS_RUN=None), capture_output=True, text=True,
                         timeout=PROCESS_SECONDS, check=True)
    return out.stdout.strip()


def test_a_file_changed_between_runs_is_not_served_stale(store, cluster):
    import hashlib

    server, root = store
    path = root / "changing.bin"
    url = f"dmdask::{server.url}/changing.bin"
    digest = lambda: hashlib.sha1(path.read_bytes()).hexdigest()  # noqa: E731
    path.write_bytes(b"a" * 5000)
    assert _read_in_new_run(url, cluster.scheduler_address) == digest()
    path.write_bytes(b"b" * 6000)  # another size
    assert _read_in_new_run(url, cluster.scheduler_address) == digest()
    stat = path.stat()
    path.write_bytes(b"c" * 6000)  # the same size, another modification time
    os.utime(path, ns=(stat.st_atime_ns, stat.st_mtime_ns + 5 * 10**9))
    assert _read_in_new_run(url, cluster.scheduler_address) == digest()
    server.reset_stats()
    assert _read_in_new_run(url, cluster.scheduler_address) == digest()  # unchanged: from the cache
    assert sent(server, ["changing.bin"])["changing.bin"]["bytes"] == 0


@pytest.mark.parametrize("where", ["http", "file"])
def test_a_file_rewritten_during_a_run_is_read_in_one_version_or_named(store, cluster, where):
    """One run reads a file's first block, the file is rewritten (same size, new bytes and
    modification time), then the run reads it whole: it gets one version's bytes, never
    blocks of both (as it did: the old size made of blocks of three versions), or an
    error naming the file and saying it changed."""
    server, root = store
    path = root / f"rewritten-{where}.bin"
    path.write_bytes(b"a" * (3 * 65536))
    new = b"b" * (3 * 65536)
    url = f"dmdask::{server.url}/{path.name}" if where == "http" else f"dmdask::file://{path}"
    code = ("import fsspec, distributed, dmdask, os, pathlib\n"
            f"path = pathlib.Path({str(path)!r})\n"
            f"with distributed.Client({cluster.scheduler_address!r}):\n"
            f"    with fsspec.open({url!r}, 'rb', block_size=65536) as f:\n"
            "        assert f.read(100) == b'a' * 100\n"
            f"    st = path.stat(); path.write_bytes(b'b' * {len(new)})\n"
            "    os.utime(path, ns=(st.st_atime_ns, st.st_mtime_ns + 5 * 10**9))\n"
            "    try:\n"
            f"        data = fsspec.open({url!r}, 'rb').open().read()\n"
            "        print('READ', 'old' if data == b'a' * len(data) and len(data) == path.stat().st_size else\n"
            "              'new' if data == path.read_bytes() else 'MIXED')\n"
            "    except OSError as exc:\n"
            "        print('ERROR', exc)\n")
    out = subprocess.run([sys.executable, "-c", code], env=env(DMDASK_FS_RUN=None, DASK_DMDASK__FS__BLOCK_SIZE="64 KiB"),
                         capture_output=True, text=True, timeout=PROCESS_SECONDS)
    said = out.stdout.strip().splitlines()[-1] if out.stdout.strip() else out.stderr[-2000:]
    assert said in ("READ old", "READ new") or (said.startswith("ERROR") and path.name in said and "changed" in said), \
        said + out.stderr[-2000:]


def test_a_file_rewritten_within_one_timestamp_tick_is_read_in_one_version_or_named(store, cluster):
    """A file system with 1 s timestamps (emulated: each write stamped with its whole
    second) gives a file rewritten within the second of its last write the same time: the
    run settles the info of a file that recent (waits out the tick and reads it again), so
    a rewrite after the run took its version is seen. The rank gets one version's bytes or
    an error naming the change, never blocks of both (as it did in 5 of 5 tries)."""
    _, root = store
    path = root / "rewritten-in-the-same-second.bin"
    url = f"dmdask::file://{path}"
    code = ("import fsspec, distributed, dmdask, math, os, pathlib, time\n"
            f"path = pathlib.Path({str(path)!r})\n"
            "def write(content):  # stamped as a file system with 1 s timestamps would\n"
            "    path.write_bytes(content)\n"
            "    tick = math.floor(time.time()) * 10**9\n"
            "    os.utime(path, ns=(tick, tick))\n"
            f"with distributed.Client({cluster.scheduler_address!r}):\n"
            "    with fsspec.open('dmdask::file://' + str(path.parent / 'warm.bin'), 'rb') as f:\n"
            "        f.read()  # first contact made\n"
            "    time.sleep(math.ceil(time.time()) - time.time() + 0.01)  # a second begins\n"
            f"    write(b'a' * {3 * 65536})\n"
            f"    with fsspec.open({url!r}, 'rb', block_size=65536) as f:\n"
            "        assert f.read(100) == b'a' * 100\n"
            f"    write(b'b' * {3 * 65536})\n"
            "    try:\n"
            f"        data = fsspec.open({url!r}, 'rb').open().read()\n"
            "        print('READ', 'old' if data == b'a' * len(data) else\n"
            "              'new' if data == path.read_bytes() else 'MIXED')\n"
            "    except OSError as exc:\n"
            "        print('ERROR', exc)\n")
    (root / "warm.bin").write_bytes(b"w" * 100)
    small_blocks = env(DMDASK_FS_RUN=None, DASK_DMDASK__FS__BLOCK_SIZE="64 KiB")
    out = subprocess.run([sys.executable, "-c", code], env=small_blocks, capture_output=True, text=True,
                         timeout=PROCESS_SECONDS)
    said = out.stdout.strip().splitlines()[-1] if out.stdout.strip() else out.stderr[-2000:]
    assert said in ("READ old", "READ new") or (said.startswith("ERROR") and path.name in said and "changed" in said), \
        said + out.stderr[-2000:]


def test_the_protocol_is_registered_by_the_entry_point_and_by_import():
    import importlib
    import tomllib

    with open(os.path.join(ROOT, "pyproject.toml"), "rb") as f:
        target = tomllib.load(f)["project"]["entry-points"]["fsspec.specs"]["dmdask"]
    module, _, name = target.partition(":")
    cls = getattr(importlib.import_module(module), name)
    assert fsspec.get_filesystem_class("dmdask") is cls  # registered by `import dmdask` too
    fs, path = fsspec.core.url_to_fs("dmdask::http://127.0.0.1:9/a/b.bin")
    assert isinstance(fs, cls) and fs.target_protocol == "http" and path == "http://127.0.0.1:9/a/b.bin"
    fs, path = fsspec.core.url_to_fs("dmdask://http://127.0.0.1:9/a/b.bin")  # the spelling webdataset keeps whole
    assert fs.target_protocol == "http" and path == "http://127.0.0.1:9/a/b.bin"
    with pytest.raises(PermissionError):
        fs.open(path, "wb")


def test_a_cache_smaller_than_the_data_meets_the_bound_from_threads(store):
    """Two ranks as threads of one process, 3 epochs, a shuffled split of the files per
    epoch, a cache holding about half of them: the store sends at most E*D - C*(E-1)
    bytes, C the bytes of the files the cache holds."""
    import concurrent.futures

    server, root = store
    sizes = file_sizes(root / "images", root)
    urls = [f"dmdask::{server.url}/{p}" for p in sorted(sizes)]
    dataset = sum(sizes.values())
    epochs = 3
    with dmdask.LocalCluster(n_workers=2, ram=dataset // 4, stream_buffer=0, dashboard_address=None) as small, \
            distributed.Client(small) as client:
        server.reset_stats()
        for epoch in range(epochs):
            order = np.random.default_rng(epoch).permutation(len(urls))

            def rank(r):
                return [(i, fsspec.open(urls[i]).open().read()) for i in order[r::2]]

            with concurrent.futures.ThreadPoolExecutor(2) as pool:
                read = [item for part in pool.map(rank, range(2)) for item in part]
            assert sorted(i for i, _ in read) == list(range(len(urls)))
            assert all(data == (root / sorted(sizes)[i]).read_bytes() for i, data in read)
            # the epoch's end, as for loader workers that exit: what the process read and was
            # still handing to the workers is handed over, and no longer serves the next epoch
            dmdask.fs.close()
        total = dmdask.stats(client)["total"]
    cached = total["ram"]["bytes"] - 8 * total["ram"]["samples"]  # file bytes held (8 bytes a row are pointers)
    assert 0 < cached < dataset
    bound = epochs * dataset - cached * (epochs - 1)
    # at most the bound; less only by the rows a thread took from blocks the other thread read in
    # the same epoch and was still handing over (blocks of several files), a few files at most
    assert bound - dataset // 10 <= sum(c["bytes"] for c in sent(server, sizes).values()) <= bound


def test_a_file_gone_from_the_store_raises_naming_it(store, cluster):
    server, root = store
    path = root / "gone.bin"
    path.write_bytes(b"x" * 1000)
    url = f"{server.url}/gone.bin"
    with distributed.Client(cluster):
        fs = fsspec.filesystem("dmdask", target_protocol="http")
        assert fs.info(url)["size"] == 1000  # known, then removed before its first read
        path.unlink()
        with pytest.raises(OSError, match="gone.bin"):
            fs.cat_file(url)


def test_readers_racing_for_the_same_new_files_read_the_store_once(store, cluster, tmp_path):
    """Two processes of four threads each read the same 30 new files at once, each thread
    all of them in one `cat` (the first reader of a block claims it and reads the store;
    the others wait for its worker): every file's bytes leave the store once."""
    server, root = store
    sizes, urls = new_files(server, root, "race", 30, seed=5, first=3000, step=97)
    server.reset_stats()
    procs = [subprocess.Popen([sys.executable, "-c", RACING, cluster.scheduler_address, *urls], env=env(),
                              stdout=subprocess.PIPE, text=True) for _ in range(2)]
    outs = [p.communicate(timeout=PROCESS_SECONDS)[0] for p in procs]
    assert [p.returncode for p in procs] == [0, 0]
    import hashlib

    expected = [hashlib.sha1((root / p).read_bytes()).hexdigest() for p in sorted(sizes)]
    assert all(digests == expected for out in outs for digests in json.loads(out))
    counts = sent(server, sizes)
    assert {p: c["bytes"] for p, c in counts.items()} == sizes
    assert all(c["requests"] == 1 for c in counts.values())


def test_reads_ahead_race_other_readers_and_still_read_each_file_once(store, cluster, tmp_path):
    """One process opens a new file reading 12 others of its folder ahead (as the mount's
    lookups do: one claim request, concurrent GETs), one of them missing, while another
    process reads the 11 that exist at once, 4 threads each all of them: every byte leaves
    the store once, both read the right bytes, and the missing file's claim is released
    (its one GET answered 404). The second process starts once the first has claimed (had it
    started first, the first would find its file read and read nothing ahead)."""
    server, root = store
    sizes, urls = new_files(server, root, "ahead", 12, seed=7, first=2000, step=131)
    ahead = ("import hashlib, json, sys, fsspec\n"
             "import dmdask\n"
             "fs = fsspec.filesystem('dmdask', target_protocol='http', scheduler=sys.argv[1])\n"
             "urls = sys.argv[2:]\n"
             "assert fs.open_info(urls[0], urls[1:], 12)['size'] > 0\n"
             "print('claimed', flush=True)\n"
             "got = fs.cat(urls[:-1])\n"
             "print(json.dumps([hashlib.sha1(got[u]).hexdigest() for u in urls[:-1]]))\n")
    server.reset_stats()
    missing = f"{server.url}/ahead/missing.bin"
    procs = [subprocess.Popen([sys.executable, "-c", ahead, cluster.scheduler_address, *urls, missing], env=env(),
                              stdout=subprocess.PIPE, text=True)]
    assert procs[0].stdout.readline() == "claimed\n"
    procs.append(subprocess.Popen([sys.executable, "-c", RACING, cluster.scheduler_address, *urls], env=env(),
                                  stdout=subprocess.PIPE, text=True))
    outs = [procs[0].stdout.read(), procs[1].communicate(timeout=PROCESS_SECONDS)[0]]  # the first's rest: buffered
    assert [p.wait(timeout=PROCESS_SECONDS) for p in procs] == [0, 0]
    import hashlib

    expected = [hashlib.sha1((root / p).read_bytes()).hexdigest() for p in sorted(sizes)]
    assert json.loads(outs[0]) == expected and json.loads(outs[1]) == [expected] * 4
    counts = sent(server, [*sizes, "ahead/missing.bin"])
    assert {p: c["bytes"] for p, c in counts.items() if p in sizes} == sizes
    assert all(c["requests"] == 1 for c in counts.values()), {p: c for p, c in counts.items() if c["requests"] != 1}
    with distributed.Client(cluster.scheduler_address, set_as_default=False) as client:
        assert client.run_on_scheduler(_claims_standing) == []


def test_a_reader_that_leaves_with_claimed_blocks_holds_no_one_up(store, cluster):
    """A client claims a new file's block (as a first reader does) and never hands it
    over: another reader waits for it while that client lives, then, once it has left,
    reads the file (from the store, once) with the right bytes."""
    import threading

    server, root = store
    (root / "claimed.bin").write_bytes(b"z" * 7000)
    url = f"{server.url}/claimed.bin"
    fs = fsspec.filesystem("dmdask", target_protocol="http", scheduler=cluster.scheduler_address)
    source = fs.source(url, fs.info(url))
    key = source.info.block_key(0)
    server.reset_stats()
    claimant = distributed.Client(cluster.scheduler_address, set_as_default=False)
    reply = claimant.sync(SchedulerAPI(claimant).send, OpenBlocks([source.info], [key], claimant.id))
    assert list(reply.mine) == [key] and reply.mine[key] in cluster.scheduler_info["workers"]
    got = []
    reader = threading.Thread(target=lambda: got.append(fs.cat_file(url)))
    reader.start()
    reader.join(3)
    assert reader.is_alive() and not got  # waiting for the claimed block
    claimant.close()
    reader.join(PROCESS_SECONDS)
    assert got == [b"z" * 7000]
    assert sent(server, ["claimed.bin"])["claimed.bin"] == {"requests": 1, "bytes": 7000}


def test_handovers_are_bounded_taken_once_with_their_claim_and_expire():
    from dmdask.worker.handover import Handovers

    kept = Handovers(capacity=10, seconds=60)
    assert kept.put("a", "mine", b"123456", 6) and not kept.put("b", "mine", b"12345", 5)  # no room for b
    assert kept.take("a", "theirs") is None and kept.take("a", None) is None  # only with its claim
    assert kept.take("a", "mine") == b"123456" and kept.take("a", "mine") is None and kept.bytes == 0
    old = Handovers(capacity=10, seconds=0)
    assert old.put("a", "mine", b"1", 1)
    old.put("b", "mine", b"2", 1, seconds=60)  # a has expired by now
    assert old.take("a", "mine") is None and old.take("b", "mine") == b"2"


def _claims_standing(dask_scheduler) -> list:
    """The file-info claims the scheduler holds (run, path), all folders."""
    return [key for folder in dask_scheduler.plugins["dmdask"].files.folders.values() for key in folder.probing]


def test_a_missing_file_answers_in_one_store_request_every_time(store, cluster):
    """Reading a file the store lacks raises FileNotFoundError after one store request,
    every time, in this process and in another process of the run: its claim is released
    with the error, so no later read waits for it to lapse."""
    server, root = store
    url = f"{server.url}/images/missing.bin"
    code = ("import sys, fsspec\n"
            "import dmdask\n"
            "fs = fsspec.filesystem('dmdask', target_protocol='http', scheduler=sys.argv[1])\n"
            "for _ in range(2):\n"
            "    try:\n"
            "        fs.cat_file(sys.argv[2])\n"
            "    except FileNotFoundError:\n"
            "        print('missing')\n")
    with distributed.Client(cluster) as client:
        server.reset_stats()
        fs = fsspec.filesystem("dmdask", target_protocol="http")
        for n in range(1, 4):
            with pytest.raises(FileNotFoundError):
                fs.cat_file(url)
            with pytest.raises(FileNotFoundError):
                fsspec.open(f"dmdask::{url}").open()
            assert sent(server, ["images/missing.bin"])["images/missing.bin"]["requests"] == 2 * n
            assert client.run_on_scheduler(_claims_standing) == []
        out = subprocess.run([sys.executable, "-c", code, cluster.scheduler_address, url], env=env(), text=True,
                             capture_output=True, timeout=PROCESS_SECONDS)
        assert out.stdout.split() == ["missing", "missing"], out.stderr
        assert sent(server, ["images/missing.bin"])["images/missing.bin"]["requests"] == 8
        assert client.run_on_scheduler(_claims_standing) == []


def test_opening_a_zarr_group_again_costs_no_more_than_the_direct_read(store, cluster):
    """zarr probes metadata files the store lacks at every open: through dmdask, 10
    opens cost no more store requests than 10 direct opens."""
    import zarr
    server, root = store
    group = zarr.open_group(str(root / "grp.zarr"), mode="w")
    group.create_array("a", data=np.arange(100, dtype="int32"), chunks=(50,))

    def requests():
        return sum(v["requests"] for p, v in server.stats()["by_path"].items() if p.startswith("grp.zarr"))

    with distributed.Client(cluster):
        server.reset_stats()
        for _ in range(10):
            np.testing.assert_array_equal(zarr.open_group(f"{server.url}/grp.zarr", mode="r")["a"][:], np.arange(100))
        direct = requests()
        server.reset_stats()
        for _ in range(10):
            opened = zarr.open_group(f"dmdask::{server.url}/grp.zarr", mode="r")
            np.testing.assert_array_equal(opened["a"][:], np.arange(100))
        assert 0 < requests() <= direct


def _blocks_on_scheduler(keys, dask_scheduler=None):
    """key -> (state, whether it has a task to run, its holders) of the blocks `keys`."""
    tasks = dask_scheduler.tasks
    return {k: (tasks[k].state, tasks[k].run_spec is not None, sorted(ws.address for ws in tasks[k].who_has))
            for k in keys if k in tasks}


@pytest.mark.slow
def test_first_reads_are_held_without_load_tasks_and_read_again_once_their_worker_is_lost(store, tmp_path):
    """A process's first reads of 12 new files are kept by their planned workers without a
    load task each (the reader hands the bytes over, the workers keep them as Dask keeps
    scattered data): every block is held and has no task; a new process reads them all from
    the cache (no store request); once a worker holding some is killed, the next reads load
    those again from the store, once each, and every read has the right bytes."""
    import hashlib
    import signal
    import time

    server, root = store
    sizes, urls = new_files(server, root, "placed", 12, seed=11, first=1500, step=61)
    expected = [hashlib.sha1((root / p).read_bytes()).hexdigest() for p in sorted(sizes)]

    def read_all():
        proc = subprocess.run([sys.executable, "-c", RACING, c.scheduler_address, *urls], env=env(),
                              capture_output=True, text=True, timeout=PROCESS_SECONDS)
        assert proc.returncode == 0, proc.stderr[-3000:]
        assert json.loads(proc.stdout) == [expected] * 4

    with dmdask.LocalCluster(n_workers=2, ram="64 MiB", dashboard_address=None) as c, \
            distributed.Client(c, set_as_default=False) as client:
        server.reset_stats()
        read_all()
        assert sent(server, sizes) == {p: {"requests": 1, "bytes": n} for p, n in sizes.items()}
        fs = fsspec.filesystem("dmdask", target_protocol="http", scheduler=c.scheduler_address)
        keys = [fs.source(fs.target_path(u), fs.info(u)).info.block_key(0) for u in urls]  # the run's infos: no HEAD
        blocks = client.run_on_scheduler(_blocks_on_scheduler, keys)
        assert sorted(blocks) == sorted(keys)
        assert {state for state, _, _ in blocks.values()} == {"memory"}
        assert not any(has_task for _, has_task, _ in blocks.values())
        workers = sorted({w for _, _, holders in blocks.values() for w in holders})
        assert len(workers) == 2  # planned round-robin
        read_all()
        assert sum(n["requests"] for n in sent(server, sizes).values()) == 12  # all from the cache
        lost = workers[0]
        on_lost = {p for p, u, k in zip(sorted(sizes), urls, keys) if blocks[k][2] == [lost]}
        os.kill(client.run(os.getpid, workers=[lost])[lost], signal.SIGKILL)
        for _ in range(600):  # until the scheduler has seen it go (its nanny starts another)
            if lost not in client.scheduler_info()["workers"]:
                break
            time.sleep(0.1)
        assert lost not in client.scheduler_info()["workers"]
        read_all()
        dmdask.fs.close()
    assert on_lost
    assert sent(server, sizes) == {p: {"requests": 1 + (p in on_lost), "bytes": n * (1 + (p in on_lost))}
                                   for p, n in sizes.items()}
