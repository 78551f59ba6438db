"""A worker sized from its job (`dmdask.worker.sizing`): one test per source of a limit
(Slurm's variables, cgroup v2 `memory.max`, a small /dev/shm), explicit settings winning,
and `dmdask.stats()` naming each tier's folder and where its size came from."""
from __future__ import annotations

import os

import dask
import distributed
import pytest

import dmdask
from dmdask.worker import sizing

MIB = 2**20
HEADROOM = 512 * MIB


def _cgroup(tmp_path, limits: dict, own="/job/step"):
    """A fake cgroup v2 tree: `limits` maps a cgroup path to its memory.max text."""
    root = tmp_path / "cgroup"
    for path, text in limits.items():
        folder = root / path.lstrip("/")
        folder.mkdir(parents=True, exist_ok=True)
        (folder / "memory.max").write_text(text + "\n")
    (root / own.lstrip("/")).mkdir(parents=True, exist_ok=True)
    proc = tmp_path / "proc-cgroup"
    proc.write_text(f"0::{own}\n")
    return str(proc), str(root)


def test_slurm_mem_per_node_sizes_the_ram_tier():
    got = sizing.ram_size({"SLURM_MEM_PER_NODE": "1500"}, None, HEADROOM, 0.5, proc_cgroup="/nonexistent")
    assert got.bytes == (1500 - 512) * MIB // 2
    assert "SLURM_MEM_PER_NODE=1500" in got.source


def test_slurm_mem_per_cpu_counts_the_cpus_on_the_node():
    env = {"SLURM_MEM_PER_CPU": "1000", "SLURM_CPUS_ON_NODE": "3"}
    assert sizing.slurm_memory(env) == sizing.Sized(3000 * MIB, "SLURM_MEM_PER_CPU=1000 x 3 CPUs")
    env = {"SLURM_MEM_PER_CPU": "1G", "SLURM_JOB_CPUS_PER_NODE": "2(x3)"}
    assert sizing.slurm_memory(env).bytes == 2 * 2**30


def test_slurm_whole_node_and_bad_values():
    assert sizing.slurm_memory({"SLURM_MEM_PER_NODE": "0"}) is None  # --mem=0: the whole node, no limit
    assert sizing.slurm_memory({}) is None
    with pytest.raises(ValueError, match="SLURM_MEM_PER_NODE='lots'"):
        sizing.slurm_memory({"SLURM_MEM_PER_NODE": "lots"})


def test_cgroup_v2_memory_max_of_the_process_and_its_parents(tmp_path):
    proc, root = _cgroup(tmp_path, {"/job": "1073741824", "/job/step": "max"})
    got = sizing.cgroup_memory(proc, root)
    assert got.bytes == 2**30 and got.source.endswith(os.path.join("job", "memory.max"))
    got = sizing.ram_size({}, None, HEADROOM, 0.5, proc_cgroup=proc, cgroup_root=root)
    assert got.bytes == (1024 - 512) * MIB // 2 and "cgroup" in got.source


def test_cgroup_without_limit_is_no_limit(tmp_path):
    proc, root = _cgroup(tmp_path, {"/job/step": "max"})
    assert sizing.cgroup_memory(proc, root) is None
    v1 = tmp_path / "v1"
    v1.write_text("4:memory:/something\n")
    assert sizing.cgroup_memory(str(v1), root) is None  # no such cgroup folder
    (tmp_path / "cgroup" / "memory" / "something").mkdir(parents=True)
    (tmp_path / "cgroup" / "memory" / "something" / "memory.limit_in_bytes").write_text("9223372036854771712\n")
    assert sizing.cgroup_memory(str(v1), root) is None  # cgroup v1's "no limit"
    assert sizing.cgroup_memory(str(tmp_path / "missing"), root) is None


def test_cgroup_v1_memory_limit_of_the_process_and_its_parents(tmp_path):
    """cgroup v1: the memory controller's line of /proc/self/cgroup, its hierarchy under
    root/memory, `memory.limit_in_bytes` (a worker in a 300 MiB v1 cgroup once got the 1 GiB
    default RAM tier and was OOM-killed)."""
    root = tmp_path / "cgroup"
    for path, limit in (("job", 300 * MIB), ("job/step", 2**40)):
        (root / "memory" / path).mkdir(parents=True)
        (root / "memory" / path / "memory.limit_in_bytes").write_text(f"{limit}\n")
    proc = tmp_path / "proc-cgroup"
    proc.write_text("12:pids:/job/step\n4:cpuacct,memory:/job/step\n1:name=systemd:/job\n")
    got = sizing.cgroup_memory(str(proc), str(root))
    assert got.bytes == 300 * MIB and got.source.endswith(os.path.join("memory", "job", "memory.limit_in_bytes"))


V1_MEMORY = "/sys/fs/cgroup/memory"


def test_a_worker_in_a_cgroup_v1_sizes_its_ram_tier_from_its_limit(tmp_path):
    """A `dask worker` process started in a real cgroup v1 with a 1 GiB memory limit: its
    RAM tier is (1 GiB - headroom) x share, and says so."""
    import subprocess
    import sys
    import uuid

    folder = os.path.join(V1_MEMORY, f"dmdask-test-{uuid.uuid4().hex[:8]}")
    try:
        os.mkdir(folder)
        with open(os.path.join(folder, "memory.limit_in_bytes"), "w") as f:
            f.write(str(2**30))
    except OSError as exc:
        pytest.skip(f"this machine lets this process make no cgroup v1 memory limit: {exc}")
    dask_bin = os.path.join(os.path.dirname(sys.executable), "dask")
    worker = None
    try:
        with dmdask.LocalCluster(n_workers=0, dashboard_address=None) as cluster, \
                distributed.Client(cluster) as client:
            command = (f"echo $$ > {folder}/cgroup.procs && exec {dask_bin} worker {cluster.scheduler_address} "
                       f"--worker-class dmdask.Worker --nthreads 1 --no-nanny --local-directory {tmp_path}")
            worker = subprocess.Popen(["sh", "-c", command], stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
            client.wait_for_workers(1, timeout=60)
            ram = next(iter(dmdask.stats(client)["workers"].values()))["ram"]
            assert ram["capacity"] == (2**30 - HEADROOM) // 2
            assert ram["source"].startswith(f"cgroup {folder}/memory.limit_in_bytes (1.00 GiB)"), ram["source"]
    finally:
        if worker is not None:
            worker.kill()
            worker.wait(30)
        os.rmdir(folder)


def test_the_smaller_of_slurm_and_cgroup_wins(tmp_path):
    proc, root = _cgroup(tmp_path, {"/job/step": str(800 * MIB)})
    got = sizing.job_memory({"SLURM_MEM_PER_NODE": "1500"}, proc, root)
    assert got.bytes == 800 * MIB and "cgroup" in got.source
    got = sizing.job_memory({"SLURM_MEM_PER_NODE": "700"}, proc, root)
    assert got.bytes == 700 * MIB and "SLURM" in got.source


def test_a_small_dev_shm_caps_the_ram_tier(tmp_path, monkeypatch):
    shm = tmp_path / "shm"
    shm.mkdir()
    monkeypatch.setattr(sizing, "free_bytes", lambda folder: 64 * MIB if folder == str(shm) else None)
    got = sizing.ram_size({"SLURM_MEM_PER_NODE": "8000"}, str(shm), HEADROOM, 0.5, proc_cgroup="/nonexistent")
    assert got.bytes == 64 * MIB
    assert f"capped at the free room of {shm}" in got.source
    got = sizing.ram_size({}, str(shm), HEADROOM, 0.5, proc_cgroup="/nonexistent")  # the 1 GiB default too
    assert got.bytes == 64 * MIB


def test_no_limit_means_the_old_default():
    got = sizing.ram_size({}, None, HEADROOM, 0.5, proc_cgroup="/nonexistent")
    assert got == sizing.Sized(2**30, "default (no job memory limit found)")


def test_ssd_folder_order():
    assert sizing.ssd_folder({"SLURM_TMPDIR": "/a", "SLURM_JOB_ID": "1", "TMPDIR": "/b"}, "/c") == \
        ("/c", "dmdask.worker.ssd-dir")
    assert sizing.ssd_folder({"SLURM_TMPDIR": "/a", "SLURM_JOB_ID": "1", "TMPDIR": "/b"}, None)[0] == "/a"
    assert sizing.ssd_folder({"SLURM_JOB_ID": "1", "TMPDIR": "/b"}, None)[0] == "/b"
    assert sizing.ssd_folder({"TMPDIR": "/b"}, None)[0] is None  # a login shell's TMPDIR is not a job's


def test_ssd_size_from_free_space_only_inside_a_job(tmp_path):
    free = sizing.free_bytes(str(tmp_path / "not" / "made" / "yet"))  # its nearest existing parent
    assert free and free > 0
    got = sizing.ssd_size({"SLURM_JOB_ID": "7"}, str(tmp_path), 0.9)
    assert 0 < got.bytes <= sizing.free_bytes(str(tmp_path)) and str(tmp_path) in got.source
    assert sizing.ssd_size({}, str(tmp_path), 0.9).bytes == 0


def _tiers(dask_worker):
    return {tier: dask_worker.data.stats()[tier] for tier in ("ram", "ssd")}


@pytest.fixture
def job_env(monkeypatch, tmp_path):
    """This process inside a fake Slurm job: 1500 MiB, a temp dir of its own."""
    job_tmp = tmp_path / "job-tmp"
    job_tmp.mkdir()
    monkeypatch.setenv("SLURM_JOB_ID", "42")
    monkeypatch.setenv("SLURM_MEM_PER_NODE", "1500")
    monkeypatch.setenv("SLURM_TMPDIR", str(job_tmp))
    monkeypatch.setattr(sizing, "cgroup_memory", lambda *a, **k: None)
    return job_tmp


def test_a_worker_in_a_job_is_sized_from_it_and_stats_say_so(job_env, tmp_path):
    with dask.config.set({"dmdask.worker.shm-dir": str(tmp_path / "shm")}), \
            dmdask.LocalCluster(n_workers=1, processes=False) as cluster, distributed.Client(cluster) as client:
        stats = dmdask.stats(client)
        (worker,) = stats["workers"].values()
        assert worker["ram"]["capacity"] == (1500 - 512) * MIB // 2
        assert "SLURM_MEM_PER_NODE=1500" in worker["ram"]["source"]
        assert worker["ram"]["dir"] == str(tmp_path / "shm")
        assert worker["ssd"]["capacity"] > 0 and "$SLURM_TMPDIR" in worker["ssd"]["source"]
        assert os.path.dirname(worker["ssd"]["dir"]) == str(job_env)
        assert stats["total"]["ram"]["capacity"] == worker["ram"]["capacity"]


def test_explicit_settings_win_over_the_job(job_env, tmp_path):
    ssd_dir = tmp_path / "mine"
    with dmdask.LocalCluster(n_workers=1, processes=False, ram="3 MiB", ssd="5 MiB", ssd_dir=str(ssd_dir)) \
            as cluster, distributed.Client(cluster) as client:
        (worker,) = client.run(_tiers).values()
        assert worker["ram"]["capacity"] == 3 * MIB and worker["ram"]["source"] == "dmdask.worker.ram"
        assert worker["ssd"]["capacity"] == 5 * MIB and worker["ssd"]["source"].startswith("dmdask.worker.ssd")
        assert os.path.dirname(worker["ssd"]["dir"]) == str(ssd_dir)
    with dask.config.set({"dmdask.worker.ram": "4 MiB", "dmdask.worker.ssd": 0}), \
            dmdask.LocalCluster(n_workers=1, processes=False) as cluster, distributed.Client(cluster) as client:
        (worker,) = client.run(_tiers).values()
        assert worker["ram"]["capacity"] == 4 * MIB and worker["ssd"]["capacity"] == 0


def test_status_prints_each_tiers_folder_and_size_source():
    from dmdask.cli import format_tiers

    tier = {"dir": "/job/tmp/dmdask-ssd-1-x", "source": "0.9 x free space of /job/tmp (1 TiB)"}
    stats = {"workers": {"tcp://a:1": {"ram": {"dir": None, "source": "dmdask.worker.ram"}, "ssd": tier}}}
    assert format_tiers(stats) == [
        "tcp://a:1 ram: the worker's memory; size from dmdask.worker.ram",
        "tcp://a:1 ssd: /job/tmp/dmdask-ssd-1-x; size from 0.9 x free space of /job/tmp (1 TiB)",
    ]


def _v1_cgroup(limit: int) -> str:
    """A new cgroup v1 memory cgroup of `limit` bytes (skipped where this machine allows none)."""
    import uuid

    folder = os.path.join(V1_MEMORY, f"dmdask-test-{uuid.uuid4().hex[:8]}")
    try:
        os.mkdir(folder)
        with open(os.path.join(folder, "memory.limit_in_bytes"), "w") as f:
            f.write(str(limit))
    except OSError as exc:
        pytest.skip(f"this machine lets this process make no cgroup v1 memory limit: {exc}")
    return folder


def test_a_worker_killed_out_of_memory_while_loading_is_named(tmp_path):
    """A worker (and its nanny) in a real 400 MiB cgroup v1, with a RAM tier of 1 GiB set by
    hand, loads a block that decodes to 512 MiB: the kernel kills it. The rank gets
    `WorkerKilledError` naming the block and out of memory (it got Dask's bare
    `KilledWorker`), and, once the restarted worker reported its cgroup's count, the count."""
    import subprocess
    import sys

    import zarr

    from conftest import wait_until

    group = zarr.open_group(str(tmp_path / "big.zarr"), mode="w")  # no chunk written: it reads as its fill value
    group.create_array("x", shape=(64, 2**21), chunks=(64, 2**21), dtype="float32", fill_value=0.0)
    zarr.consolidate_metadata(str(tmp_path / "big.zarr"))
    folder = _v1_cgroup(400 * MIB)
    dask_bin = os.path.join(os.path.dirname(sys.executable), "dask")
    worker = None
    try:
        with dask.config.set({"distributed.scheduler.allowed-failures": 0}):
            cluster = dmdask.LocalCluster(n_workers=0, dashboard_address=None)
        with cluster, distributed.Client(cluster) as client, \
                dask.config.set({"dmdask.client.read-first-batch": False}):
            command = (f"echo $$ > {folder}/cgroup.procs && exec {dask_bin} worker {cluster.scheduler_address} "
                       f"--worker-class dmdask.Worker --nthreads 1 --local-directory {tmp_path}")
            env = dict(os.environ, DASK_DMDASK__WORKER__RAM="1 GiB")
            worker = subprocess.Popen(["sh", "-c", command], env=env, stdout=subprocess.DEVNULL,
                                      stderr=subprocess.DEVNULL)
            client.wait_for_workers(1, timeout=60)
            spec = dmdask.Spec(str(tmp_path / "big.zarr"), batch_size=64)
            with pytest.raises(dmdask.WorkerKilledError) as first:
                list(dmdask.batches(client, spec))
            assert "block 0 (samples 0..63) of" in str(first.value) and "out of memory" in str(first.value)

            def reported():
                return any(w["metrics"].get("dmdask", {}).get("oom_kills", 0)
                           for w in client.scheduler_info()["workers"].values())

            wait_until(reported, 120, "the restarted worker reported its cgroup's out-of-memory kills")
            with pytest.raises(dmdask.WorkerKilledError, match=r"out of memory: the memory cgroup of worker .* "
                                                               r"counted \d+ out-of-memory kill"):
                list(dmdask.batches(client, spec))
    finally:
        _empty(folder, worker)


def _empty(folder: str, started) -> None:
    """Kill the processes this test started in cgroup `folder` (the nanny and its worker), then remove it."""
    import signal

    from conftest import wait_until

    if started is not None:
        started.kill()
        started.wait(30)

    def pids():
        with open(os.path.join(folder, "cgroup.procs")) as f:
            return [int(p) for p in f.read().split()]

    for pid in pids():
        os.kill(pid, signal.SIGKILL)
    wait_until(lambda: not pids(), 30, "the test's cgroup empty")
    os.rmdir(folder)
