"""The RAM tier in shared memory, read by training processes on the same host without
asking the workers: content, exactly-once from several processes at once, hit counts,
and no segment left behind by a killed worker or trainer."""
import mmap
import os
import signal
import subprocess
import sys
import threading
import time

import distributed
import numpy as np
import pytest

import dmdask
from dmdask.testing.datasets import zarr_label, zarr_sample

from conftest import wait_until

N = 2503  # divisible by neither the chunk nor the batch size
RANK_SCRIPT = """
import sys, numpy as np, distributed, dmdask
address, path, rank, world, out = sys.argv[1:6]
with distributed.Client(address) as client:
    spec = dmdask.Spec(path, batch_size=40, seed=5, rank=int(rank), world_size=int(world))
    ids = []
    for b in dmdask.batches(client, spec, epoch=1, progress=False):
        from dmdask.testing.datasets import zarr_sample
        assert np.array_equal(b["x"], zarr_sample(b["index"], (16,))), "wrong rows"
        ids.append(b["index"])
    np.save(out, np.concatenate(ids))
    dmdask.stats(client)  # which waits for this process's last hit reports (the client's close does not)
"""


ZARR = dict(n=N, sample_shape=(16,), chunk=100)  # the `zarr_path` fixture's dataset (conftest.py)


def _folders(shm):
    return sorted(name for name in os.listdir(shm) if name.startswith("dmdask-"))


def test_ranks_in_other_processes_read_shared_memory_at_once(zarr_path, tmp_path):
    shm = tmp_path / "shm"
    with dmdask.LocalCluster(n_workers=2, ram="64 MiB", shm_dir=str(shm)) as cluster, \
            distributed.Client(cluster) as client:
        spec = dmdask.Spec(zarr_path, batch_size=40, seed=5)
        warm = list(dmdask.batches(client, spec))  # epoch 0 loads every block into shared memory
        np.testing.assert_array_equal(warm[0]["label"], zarr_label(warm[0]["index"]))
        assert len(_folders(shm)) == 2  # one per worker process
        before = dmdask.stats(client)["total"]
        procs = [subprocess.Popen([sys.executable, "-c", RANK_SCRIPT, cluster.scheduler_address, zarr_path,
                                   str(r), "3", str(tmp_path / f"r{r}.npy")]) for r in range(3)]
        assert [p.wait(120) for p in procs] == [0, 0, 0]
        ids = np.concatenate([np.load(tmp_path / f"r{r}.npy") for r in range(3)])
        assert np.array_equal(np.sort(ids), np.arange(N))
        after = dmdask.stats(client)["total"]
        # every row came from the mapped files: counted as RAM hits, nothing crossed a socket
        assert after["ram"]["hits"] - before["ram"]["hits"] == N
        assert after["peer"]["bytes_out"] == before["peer"]["bytes_out"]
        assert after["shared_store"]["requests"] == before["shared_store"]["requests"] == 26
    assert _folders(shm) == []  # the workers removed their folders when they closed


def test_a_killed_worker_leaves_no_segment_once_restarted(zarr_path, tmp_path):
    shm = tmp_path / "shm"
    with dmdask.LocalCluster(n_workers=2, ram="64 MiB", shm_dir=str(shm)) as cluster, \
            distributed.Client(cluster) as client:
        spec = dmdask.Spec(zarr_path, batch_size=40)
        assert len(list(dmdask.batches(client, spec))) == -(-N // 40)
        pids = client.run(os.getpid)
        victim = pids[sorted(pids)[0]]
        assert any(f"-{victim}-" in name for name in _folders(shm))
        os.kill(victim, signal.SIGKILL)

        def replaced():
            try:
                live = set(client.run(os.getpid).values())
            except OSError:  # the dead worker is still listed for a moment
                return False
            return len(live) == 2 and victim not in live

        wait_until(replaced, 60, "the nanny replaced the killed worker", pause=0.2)
        assert not any(f"-{victim}-" in name for name in _folders(shm))  # the new worker removed it
        ids = np.concatenate([b["index"] for b in dmdask.batches(client, spec, epoch=1)])
        assert np.array_equal(np.sort(ids), np.arange(N))
    assert _folders(shm) == []


def test_a_killed_trainer_leaves_nothing_and_the_others_go_on(zarr_path, tmp_path):
    shm = tmp_path / "shm"
    with dmdask.LocalCluster(n_workers=2, ram="64 MiB", shm_dir=str(shm)) as cluster, \
            distributed.Client(cluster) as client:
        spec = dmdask.Spec(zarr_path, batch_size=40)
        list(dmdask.batches(client, spec))
        folders = _folders(shm)
        started = tmp_path / "started"
        slow = RANK_SCRIPT.replace('ids.append(b["index"])',
                                   f'ids.append(b["index"]); open({str(started)!r}, "w").close(); '
                                   '__import__("time").sleep(0.5)')
        trainer = subprocess.Popen([sys.executable, "-c", slow, cluster.scheduler_address, zarr_path, "0", "1",
                                    str(tmp_path / "never.npy")])
        wait_until(lambda: started.exists() or trainer.poll() is not None, 120, "the trainer's first batch")
        assert trainer.poll() is None, "the trainer exited"  # killed mid-epoch: after its first batch
        trainer.kill()
        trainer.wait(30)
        assert _folders(shm) == folders  # trainers map the workers' files; they create none
        again = np.concatenate([b["index"] for b in dmdask.batches(client, spec, epoch=1)])
        assert np.array_equal(np.sort(again), np.arange(N))
        for b in dmdask.batches(client, spec.replace(batch_size=500), epoch=2):
            np.testing.assert_array_equal(b["x"], zarr_sample(b["index"], (16,)))


def scaled(batch):
    return dict(batch, x=batch["x"].astype(np.float64) * 3, pid=np.full(len(batch["index"]), os.getpid()))


def _mapped_pages(arr) -> bool:
    """Whether `arr` is a view of a memory map (not of a buffer received from a socket)."""
    base = arr
    while isinstance(base, np.ndarray):
        base = base.base
    return isinstance(getattr(base, "obj", base), mmap.mmap)


def test_transformed_batches_come_back_through_shared_memory(zarr_path, tmp_path):
    """A transform runs on the node's workers; its batches reach the trainer as views of
    a shared-memory file that is gone once mapped, with the same rows as ever."""
    shm = tmp_path / "shm"
    with dmdask.LocalCluster(n_workers=2, ram="64 MiB", shm_dir=str(shm)) as cluster, \
            distributed.Client(cluster) as client:
        spec = dmdask.Spec(zarr_path, batch_size=40, seed=2, transform=scaled)
        batches = list(dmdask.batches(client, spec))
        assert np.array_equal(np.sort(np.concatenate([b["index"] for b in batches])), np.arange(N))
        worker_pids = set(client.run(os.getpid).values())
        for b in batches:
            np.testing.assert_array_equal(b["x"], 3 * zarr_sample(b["index"], (16,)))
            assert set(b["pid"].tolist()) <= worker_pids
            assert _mapped_pages(b["x"]) and _mapped_pages(b["index"])
        b["x"][0] = -1  # the trainer's own copy-on-write pages: writable, the worker's file untouched
        results = [f for folder in _folders(shm) for f in os.listdir(shm / folder) if f.startswith("result-")]
        assert results == []  # each result file was unlinked as soon as the trainer mapped it


def test_stale_result_files_are_swept(tmp_path):
    """A trainer that died between a worker's write and its own mapping leaves a file:
    the worker's next write removes it once older than STALE_SECONDS."""
    from dmdask.shm import results

    batch = {"x": np.arange(6, dtype=np.float32).reshape(2, 3), "index": np.arange(2)}
    (tmp_path / "dead").mkdir()
    (tmp_path / "live").mkdir()  # a folder no write has swept yet (a sweep is every STALE_SECONDS / 10)
    orphan = str(tmp_path / "live" / "result-orphan")
    os.rename(results.write_batches(str(tmp_path / "dead"), [batch])["path"], orphan)
    old = time.time() - results.STALE_SECONDS - 1
    os.utime(orphan, (old, old))
    fresh = results.write_batches(str(tmp_path / "live"), [batch, batch])
    assert not os.path.exists(orphan) and os.path.exists(fresh["path"])
    mapped = results.map_batches(fresh)
    assert not os.path.exists(fresh["path"])
    for b in mapped:
        np.testing.assert_array_equal(b["x"], batch["x"])
        np.testing.assert_array_equal(b["index"], batch["index"])


def test_warm_batches_keep_the_epoch_order_with_two_arenas(zarr_path):
    """Warm batches come from both workers' arenas through one window, in the epoch's
    exact order (as planned by `RankShare`), the same as the cold epoch's batches."""
    from dmdask.plan.order import EpochOrder, RankShare

    with dmdask.LocalCluster(n_workers=2, ram="64 MiB") as cluster, distributed.Client(cluster) as client:
        spec = dmdask.Spec(zarr_path, batch_size=40, seed=3, rank=1, world_size=2)
        cold = list(dmdask.batches(client, spec, epoch=2))
        hits = {address: s["ram"]["hits"] for address, s in dmdask.stats(client)["workers"].items()}
        it = dmdask.batches(client, spec, epoch=2)
        warm = list(it)
        assert it.requests == 0  # the warm path: every row from an arena on this host

        def both_arenas():  # the rows came from two arenas: each holder counts hits (reported <= 1 s late)
            return all(s["ram"]["hits"] > hits[a] for a, s in dmdask.stats(client)["workers"].items())

        wait_until(both_arenas, 30, "rows taken from both workers' arenas")
        planned = RankShare(EpochOrder(N, 100, shuffle=True, seed=3, epoch=2), 1, 2, 40, False)
        assert len(warm) == len(cold) == len(planned)
        for i, (a, b) in enumerate(zip(cold, warm)):
            np.testing.assert_array_equal(a["index"], planned.batch(i))
            np.testing.assert_array_equal(b["index"], planned.batch(i))
            np.testing.assert_array_equal(b["x"], zarr_sample(b["index"], (16,)))
            np.testing.assert_array_equal(b["label"], zarr_label(b["index"]))


def test_a_reused_slot_is_never_read_as_the_block_it_held(tmp_path):
    """The window's knowledge goes stale when a worker frees a slot and writes another
    block there: the take notices from the row labels and raises Moved, never returning
    the other block's rows."""
    from dmdask.client.arenas import LocalArenas, Moved
    from dmdask.shm.arena import Arena
    from dmdask.worker.holdings import ArenaBlock, Block

    def block(k):
        ids = np.arange(10 * k, 10 * k + 10)
        return Block({"x": np.repeat(ids[:, None], 4, axis=1).astype(np.float32)}, 10 * k, 10 * k + 10)

    arena = Arena(str(tmp_path), "ds", 10, block(0))
    held = ArenaBlock(arena, arena.write(block(0)), 0, 10, 160)
    local = LocalArenas(num_samples=30, block_len=10)
    described = held.describe()
    local.remember("tcp://w:1", described["arena"], [0], [described["first_row"]])
    hits = []
    batches = local.take([np.array([3, 1, 7]), np.array([2])], lambda *a: hits.append(a))
    np.testing.assert_array_equal(batches[0]["x"][:, 0], [3, 1, 7])
    np.testing.assert_array_equal(batches[0]["index"], [3, 1, 7])
    np.testing.assert_array_equal(batches[1]["x"][:, 0], [2])
    assert hits == [("tcp://w:1", "ram", 4, 64)]
    arena.free(held.slot)
    assert arena.write(block(2)) == held.slot  # block 2 now lives where block 0 was
    with pytest.raises(Moved):
        local.take([np.array([3])], lambda *a: None)
    assert not local.knows(np.array([0]))  # forgotten: the next take locates it again
    arena.close()


def test_windows_of_a_reused_slot_are_never_read_as_the_block_it_held(tmp_path, monkeypatch):
    """`LocalArenas.take_windows`: windows are the rows they start at, across two blocks
    too; the labels are each row's sample id (-1 past a short block's end, written a few
    rows at a time here), all -1 once the slot is freed; and a window of a slot reused by
    another block raises Moved, never that block's rows."""
    from dmdask.client.arenas import LocalArenas, Moved
    from dmdask.shm import arena as arenas
    from dmdask.shm.arena import ID_FIELD, Arena
    from dmdask.worker.holdings import ArenaBlock, Block

    monkeypatch.setattr(arenas, "LABEL_ROWS", 3)  # a slot of 10 rows labelled in 4 writes

    def block(k, n=10):
        ids = np.arange(10 * k, 10 * k + n)
        return Block({"x": np.repeat(ids[:, None], 4, axis=1).astype(np.float32)}, 10 * k, 10 * k + n)

    def labels():
        return np.fromfile(arena.fields[ID_FIELD][0], dtype=np.int64)

    arena = Arena(str(tmp_path), "ds", 10, block(0))
    held = [ArenaBlock(arena, arena.write(block(k, 10 if k < 2 else 6)), 10 * k, 10 * k + 10, 160) for k in range(3)]
    assert labels().tolist() == list(range(26)) + [-1] * 4
    local = LocalArenas(num_samples=26, block_len=10)
    for k, h in enumerate(held):
        described = h.describe()
        local.remember("tcp://w:1", described["arena"], [k], [described["first_row"]])
    hits = []
    windows = local.take_windows(np.array([0, 5, 8, 19, 22]), 4, lambda *a: hits.append(a))
    np.testing.assert_array_equal(windows["x"][:, :, 0], [np.arange(s, s + 4) for s in (0, 5, 8, 19, 22)])
    assert hits == [("tcp://w:1", "ram", 20, 320)]
    arena.free(held[0].slot)
    assert labels()[:10].tolist() == [-1] * 10
    assert arena.write(block(5)) == held[0].slot  # block 5 now lives where block 0 was
    assert labels()[:10].tolist() == list(range(50, 60))
    with pytest.raises(Moved):
        local.take_windows(np.array([8]), 4, lambda *a: None)  # a window across it and block 1
    assert not local.knows(np.array([0]))  # forgotten: the next take locates it again
    arena.close()


def test_windows_into_a_block_placed_elsewhere_are_their_rows_and_hits_count_each_arena(tmp_path):
    """`LocalArenas.take_windows` over blocks written out of order into two arenas: a window
    into the next block is one slice only where that block follows in the same arena
    (block 1 after block 0 in its slots); else (block 2 before block 1, block 3 in the
    other arena) it is taken row by row: every window equals the rows it starts at, and
    the hits count each window under its first row's arena."""
    from dmdask.client.arenas import LocalArenas
    from dmdask.shm.arena import Arena
    from dmdask.worker.holdings import ArenaBlock, Block

    def block(k):
        ids = np.arange(10 * k, 10 * k + 10)
        return Block({"x": np.repeat(ids[:, None], 3, axis=1).astype(np.int32)}, 10 * k, 10 * k + 10)

    for folder in ("a", "b"):
        (tmp_path / folder).mkdir()
    arenas = [Arena(str(tmp_path / f), "ds", 10, block(0)) for f in ("a", "b")]
    local = LocalArenas(num_samples=40, block_len=10)
    placed = {}
    for k, a in ((2, 0), (0, 0), (1, 0), (3, 1)):  # slots of arena a: block 2, block 0, block 1
        placed[k] = (a, ArenaBlock(arenas[a], arenas[a].write(block(k)), 10 * k, 10 * k + 10, 120))
    for k, (a, held) in placed.items():
        described = held.describe()
        local.remember(f"tcp://w:{a}", described["arena"], [k], [described["first_row"]])
    starts = np.array([0, 6, 8, 15, 18, 24, 28, 30])  # 6, 8: 0 -> 1 (adjacent); 15, 18: 1 -> 2; 28: 2 -> 3
    hits = []
    windows = local.take_windows(starts, 5, lambda *h: hits.append(h))
    np.testing.assert_array_equal(windows["x"][:, :, 0], [np.arange(s, s + 5) for s in starts])
    assert sorted(hits) == [("tcp://w:0", "ram", 35, 35 * 12), ("tcp://w:1", "ram", 5, 5 * 12)]
    for a in arenas:
        a.close()


def test_pooled_batch_memory_is_reused_only_after_the_batch_is_dropped():
    from dmdask.shm.memory import empty_batch

    layout = (("x", "<f4", (3,)), ("y", "<i8", ()))
    kept = empty_batch(layout, 5)
    kept["x"][:] = 1.5
    kept["y"][:] = 7
    address = kept["x"].__array_interface__["data"][0]
    others = [empty_batch(layout, 5) for _ in range(20)]  # more than a slab's worth while `kept` lives
    assert address not in {o["x"].__array_interface__["data"][0] for o in others}
    assert (kept["x"] == 1.5).all() and (kept["y"] == 7).all()
    assert kept["x"].shape == (5, 3) and kept["y"].shape == (5,) and kept["x"].flags.writeable
    del others
    x = kept["x"]
    del kept  # one array of the batch still alive: its memory stays taken
    assert all(empty_batch(layout, 5)["x"].__array_interface__["data"][0] != address for _ in range(20))
    del x
    assert any(empty_batch(layout, 5)["x"].__array_interface__["data"][0] == address for _ in range(20))


def test_a_batch_collected_while_its_pool_hands_out_a_chunk_does_not_deadlock():
    """A chunk goes back to its pool when the collector frees its batch, which may happen
    inside the pool's own `take` (an allocation there runs the collector, which frees a
    batch in a reference cycle): that thread must not wait on a lock it holds itself (it
    did: four ranks of one process hung in `next()`). The collector is run there on purpose."""
    import gc

    from dmdask.shm.memory import SLAB_CHUNKS, _Pool

    pool = _Pool(4096)
    cycle = [pool.take()]
    cycle.append(cycle)  # the chunk's holder freed only by the collector
    del cycle

    class CollectingList(list):
        def pop(self, *args):
            gc.collect()  # as an allocation inside `take` may: the first chunk's finalizer runs here
            return super().pop(*args)

    pool._free = CollectingList(pool._free)
    result = []
    thread = threading.Thread(target=lambda: result.append(pool.take()), daemon=True)
    thread.start()
    thread.join(30)
    assert not thread.is_alive(), "take() deadlocked on its own lock"
    assert result[0] is not None
    again = pool.take()  # the first chunk is back: of the slab's chunks, two are out
    assert again is not None and len(pool._slabs) == 1 and len(pool._free) == SLAB_CHUNKS - 2


SENTINEL = 0x5EED_F0CC_C0DE_BEEF  # what the forked child writes


def test_pooled_batch_memory_is_private_to_a_forked_child():
    """A DataLoader worker forked from the trainer takes batches from its own copy of
    the pool: what it writes there never shows in the parent's batches. (The child writes
    a value no earlier test leaves in pooled memory: the parent's chunks are uninitialised
    and once held 9 in a CI run, an earlier batch's sample id.)"""
    from dmdask.shm.memory import empty_batch

    layout = (("x", "<i8", ()),)
    kept = empty_batch(layout, 4)
    kept["x"][:] = 1
    del kept  # the chunk is free in the parent and, after the fork, in the child
    parent = empty_batch(layout, 4)
    parent["x"][:] = 2
    pid = os.fork()
    if pid == 0:  # the child writes over every chunk its pool hands out, the parent's included
        try:
            batches = [empty_batch(layout, 4) for _ in range(16)]
            for b in batches:
                b["x"][:] = SENTINEL
            parent["x"][:] = SENTINEL
        finally:
            os._exit(0)
    try:  # a child stuck on a lock held at the fork fails the test, not hangs the run
        wait_until(lambda: os.waitpid(pid, os.WNOHANG) != (0, 0), 60, "the forked child's exit", pause=0.01)
    except AssertionError:
        os.kill(pid, signal.SIGKILL)
        os.waitpid(pid, 0)
        raise
    assert parent["x"].tolist() == [2, 2, 2, 2]
    assert all((empty_batch(layout, 4)["x"] != SENTINEL).all() for _ in range(4))


def _resident_fraction(array: np.ndarray) -> float:
    """The fraction of the pages under `array` that are in memory (mincore)."""
    import ctypes

    start = array.__array_interface__["data"][0]
    first = start - start % mmap.PAGESIZE
    pages = -(-(start + array.nbytes - first) // mmap.PAGESIZE)
    vec = (ctypes.c_ubyte * pages)()
    libc = ctypes.CDLL(None, use_errno=True)
    assert libc.mincore(ctypes.c_void_p(first), ctypes.c_size_t(pages * mmap.PAGESIZE), vec) == 0
    return sum(v & 1 for v in vec) / pages


def test_pooled_batch_memory_is_faulted_in_ahead_of_its_first_use():
    """The chunks next in line are made resident by another thread while the first is in
    use (`shm.memory.AHEAD`), so copying a batch into fresh memory does not wait for its
    page faults."""
    from dmdask.shm import memory
    from dmdask.shm.libc import populate_soon

    layout = (("x", "|u1", (9 << 19,)),)  # a pool of its own, chunks of 4.5 MiB: more than a huge page
    kept = [memory.empty_batch(layout, 1)]  # each kept: the next is another chunk
    for _ in range(3):
        populate_soon(0, 0).result(timeout=60)  # after the faults queued before it
        kept.append(memory.empty_batch(layout, 1))  # faulted in when the one before it was taken
        assert _resident_fraction(kept[-1]["x"]) == 1.0
    assert len({b["x"].__array_interface__["data"][0] for b in kept}) == 4


def _pmd_mapped_kib() -> int:
    """KiB of file pages this process maps with huge-page (PMD) entries."""
    with open("/proc/self/smaps_rollup") as f:
        return sum(int(line.split()[1]) for line in f if line.startswith(("FilePmdMapped:", "ShmemPmdMapped:")))


def test_arena_files_are_read_through_huge_pages_where_the_kernel_allows():
    """Whole 2 MiB extents of an arena file become transparent huge pages once written
    (`dmdask.shm.hugepages`), and a training process's window maps them with huge-page
    entries: its first pass takes a fraction of the page faults. The rows read are the
    rows written, whatever backs them. The mappings are faulted in ahead of the first take."""
    import tempfile

    from dmdask.client.arenas import LocalArenas
    from dmdask.shm import hugepages
    from dmdask.shm.arena import Arena
    from dmdask.shm.libc import populate_soon
    from dmdask.worker.holdings import ArenaBlock, Block

    with tempfile.TemporaryDirectory(dir="/dev/shm") as folder:
        probe = os.path.join(folder, "probe")
        fd = os.open(probe, os.O_RDWR | os.O_CREAT, 0o600)
        os.pwrite(fd, b"\1" * hugepages.HUGE, 0)
        if not hugepages.collapse(fd, 0, hugepages.HUGE):
            os.close(fd)
            pytest.skip("this kernel refuses MADV_COLLAPSE of shared memory (Linux < 6.1, or "
                        "/sys/kernel/mm/transparent_hugepage/shmem_enabled is deny)")
        os.close(fd)
        block_len, row = 1024, 3072  # 3 MiB blocks

        def block(k):
            ids = np.arange(block_len * k, block_len * (k + 1))
            x = (ids[:, None] * 7 + np.arange(row)[None, :]).astype(np.uint8)
            return Block({"x": x}, int(ids[0]), int(ids[-1]) + 1)

        arena = Arena(folder, "ds", block_len, block(0))
        local = LocalArenas(num_samples=4 * block_len, block_len=block_len)
        before = _pmd_mapped_kib()
        for k in range(4):
            held = ArenaBlock(arena, arena.write(block(k)), block_len * k, block_len * (k + 1), block_len * row)
            described = held.describe()
            local.remember("tcp://w:1", described["arena"], [k], [described["first_row"]])
        populate_soon(0, 0).result(timeout=60)  # after the window's mappings faulted in ahead of the first take
        assert _pmd_mapped_kib() - before >= 4 * 1024  # at least two huge pages of the 12 MiB mapped as such
        ids = np.random.default_rng(0).permutation(4 * block_len)
        batch = local.take([ids], lambda *a: None)[0]
        np.testing.assert_array_equal(batch["x"], (ids[:, None] * 7 + np.arange(row)[None, :]).astype(np.uint8))
        local.forget()
        arena.close()


def test_a_row_server_maps_arena_files_on_huge_page_boundaries_and_unmaps_them_when_dropped(tmp_path):
    """`ArenaMaps` maps an arena file at a 2 MiB-aligned address (else the kernel's own
    choice is 4 KiB-aligned and no huge page of the file can be mapped whole), reads the
    file's bytes there, and gives the address space back once no array uses the mapping."""
    import gc

    from dmdask.shm.arena import ArenaMaps
    from dmdask.shm.hugepages import HUGE

    path = f"/dev/shm/dmdask-test-{os.getpid()}.x"
    data = np.random.default_rng(0).integers(0, 256, (3 * HUGE) // 64 * 64, dtype=np.uint8)
    data.tofile(path)
    try:
        rows = ArenaMaps().rows(path, "<u1", (64,), 10)
        assert rows.ctypes.data % HUGE == 0
        assert np.array_equal(rows.reshape(-1), data)
        assert path in open("/proc/self/maps").read()
        del rows
        gc.collect()
        assert path not in open("/proc/self/maps").read()
    finally:
        os.unlink(path)
