"""A paused worker (SIGSTOP: a frozen node, a debugger) mid-epoch, warm and cold, on real
processes: a stock `dask scheduler`, three `dask worker --no-nanny` and two rank
processes. The rows the paused worker owes (held, or still loading) come from the others
once the scheduler treats it as lost (`dmdask.worker.silent-seconds` with no heartbeat:
its blocks planned anew and read from the store), and the ranks' requests to it end at
their reply deadline (half `dmdask.client.recovery-seconds`). Every sample comes exactly
once, and the epoch ends while the worker is still stopped: the configured deadlines
ended the wait, not the worker resuming (Dask's own `worker-ttl` is set to 5 minutes)."""
import os
import signal
import subprocess
import sys
import time

import distributed
import numpy as np
import pytest

from dmdask.source.base import is_block_key
from dmdask.testing.datasets import write_zarr

from conftest import wait_until
from framework_cases import free_port

BIN = os.path.dirname(sys.executable)
N, CHUNK, BATCH, RANKS = 3000, 50, 50, 2
SETTINGS = {"DASK_DMDASK__WORKER__SILENT_SECONDS": "5", "DASK_DMDASK__CLIENT__RECOVERY_SECONDS": "30",
            "DASK_DISTRIBUTED__SCHEDULER__WORKER_TTL": "300s", "DASK_DMDASK__WORKER__RAM": "64 MiB"}


def start_cluster(tmp_path, workers: int = 3) -> tuple[str, list]:
    """A stock scheduler (dmdask preloaded) and `workers` dmdask workers without nannies."""
    address = f"tcp://127.0.0.1:{free_port()}"
    env = dict(os.environ, **SETTINGS)
    quiet = {"stdout": subprocess.DEVNULL, "stderr": subprocess.DEVNULL, "env": env}
    procs = [subprocess.Popen([os.path.join(BIN, "dask"), "scheduler", "--host", "127.0.0.1", "--port",
                               address.rsplit(":", 1)[1], "--dashboard-address", ":0", "--preload", "dmdask"],
                              **quiet)]
    for i in range(workers):
        procs.append(subprocess.Popen([os.path.join(BIN, "dask"), "worker", address, "--worker-class", "dmdask.Worker",
                                       "--nthreads", "1", "--host", "127.0.0.1", "--no-nanny",
                                       "--local-directory", str(tmp_path / f"w{i}")], **quiet))
    return address, procs


def stop(procs) -> None:
    """Every process ended (a stopped one continued first)."""
    for p in procs:
        if p.poll() is None:
            os.kill(p.pid, signal.SIGCONT)
            p.kill()
    for p in procs:
        p.wait(30)


def start_ranks(address: str, source: str, epoch: int, out, env=None, step: float = 0.1) -> list:
    """The rank processes of one epoch (`dmdask.testing.rank_process`), each writing its ids to out/rank-R.npy."""
    env = dict(os.environ, **SETTINGS, **(env or {}))
    return [subprocess.Popen([sys.executable, "-m", "dmdask.testing.rank_process", address, source, str(r),
                              str(RANKS), str(epoch), str(BATCH), str(step), str(out / f"rank-{r}.npy")],
                             env=env, stderr=subprocess.PIPE, text=True) for r in range(RANKS)]


def delivered(out, rank: int) -> int:
    try:
        with open(out / f"rank-{rank}.npy.count") as f:
            return int(f.read() or 0)
    except FileNotFoundError:
        return 0


def state(pid: int) -> str:
    """The process's state letter (`T`: stopped)."""
    with open(f"/proc/{pid}/stat") as f:
        return f.read().rsplit(")", 1)[1].split()[0]


def finish(ranks, out) -> np.ndarray:
    """Every rank's ids, once each rank process ended (each must exit 0)."""
    for p in ranks:
        _, err = p.communicate(timeout=300)
        assert p.returncode == 0, err[-3000:]
    return np.concatenate([np.load(out / f"rank-{r}.npy") for r in range(RANKS)])


def worker_pids(client) -> dict[str, int]:
    return client.run(os.getpid)


def pause_mid_epoch(out, pid: int, batches: int) -> None:
    """SIGSTOP `pid` once every rank delivered `batches` batches, before any is done."""
    wait_until(lambda: all(delivered(out, r) >= batches for r in range(RANKS)), 120, "every rank is under way")
    os.kill(pid, signal.SIGSTOP)
    assert all(delivered(out, r) < N // BATCH // RANKS for r in range(RANKS))  # mid-epoch


def ended_while_paused(client, ranks, out, victim: str, pid: int) -> None:
    """The ranks ended with every sample once while `victim` (process `pid`) was still
    stopped (the deadlines ended the wait), and the scheduler treated it as lost."""
    ids = finish(ranks, out)
    assert state(pid) == "T"
    assert len(ids) == N and np.array_equal(np.sort(ids), np.arange(N))
    wait_until(lambda: evicted(client, victim), 60, "the scheduler treated the silent worker as lost")


def evicted(client, victim: str) -> bool:
    events = [msg for _, msg in client.get_events("dmdask") if msg.get("action") == "silent-workers"]
    return any(victim in msg["workers"] for msg in events) and victim not in client.scheduler_info()["workers"]


@pytest.mark.parametrize("elsewhere", [True, False])
def test_a_worker_paused_in_a_warm_epoch_costs_a_bounded_wait_and_nothing_else(tmp_path, elsewhere):
    """Warm: the ranks' rows cross the row channel (`elsewhere`: ranks on a host with no
    worker) or come from the mapped files of this host (whose paused worker's files stay
    readable); either way the epoch ends, exactly once, with the worker still stopped."""
    path = write_zarr(str(tmp_path / "d.zarr"), N, chunk=CHUNK)
    address, procs = start_cluster(tmp_path)
    try:
        with distributed.Client(address, timeout=60) as client:
            client.wait_for_workers(3, timeout=60)
            out0 = tmp_path / "epoch0"
            out0.mkdir()
            assert np.array_equal(np.sort(finish(start_ranks(address, path, 0, out0, step=0), out0)), np.arange(N))
            pids = worker_pids(client)
            victim = sorted(pids)[1]
            out = tmp_path / "epoch1"
            out.mkdir()
            env = {"DASK_DMDASK__CLIENT__HOST": "127.0.0.9"} if elsewhere else {}
            ranks = start_ranks(address, path, 1, out, env)
            procs += ranks  # stopped at the end, whatever happens
            pause_mid_epoch(out, pids[victim], 3)
            ended_while_paused(client, ranks, out, victim, pids[victim])
    finally:
        stop(procs)


def test_a_worker_paused_while_it_loads_a_cold_epoch_has_its_blocks_loaded_by_the_others(tmp_path):
    """Cold: the store holds its answers for every chunk until each worker has block loads
    running or queued, then the worker with the most is paused and the store answers; the
    others load its blocks once the scheduler treats it as lost, and the ranks' requests
    to it end at their deadline. (Holding the answers makes the loads provably in flight
    when the worker stops, whatever the machine's speed; the ranks meet the paused worker
    before their first connection to it, whose handshake Dask does not bound.)"""
    from benchmarks.store_server import StoreServer

    write_zarr(str(tmp_path / "d.zarr"), N, chunk=CHUNK)
    chunks = lambda path: not os.path.basename(path).startswith(("zarr.json", ".z"))
    address, procs = start_cluster(tmp_path)
    try:
        with StoreServer(str(tmp_path), latency=0.01) as store, distributed.Client(address, timeout=60) as client:
            client.wait_for_workers(3, timeout=60)
            pids = worker_pids(client)
            out = tmp_path / "epoch0"
            out.mkdir()
            store.hold(chunks)
            try:
                ranks = start_ranks(address, store.url + "/d.zarr", 0, out, step=0.05)
                procs += ranks
                wait_until(lambda: len(block_loads(client)) == 3, 120, "every worker has block loads")
                loading = block_loads(client)
                victim = max(loading, key=lambda w: len(loading[w]))
                os.kill(pids[victim], signal.SIGSTOP)
                assert all(delivered(out, r) == 0 for r in range(RANKS))  # nothing could be read yet
            finally:
                store.release()
            ended_while_paused(client, ranks, out, victim, pids[victim])
    finally:
        stop(procs)


def block_loads(client) -> dict[str, list]:
    """Each worker's block loads the scheduler has it running or queued (none: not listed)."""
    loads = {w: [k for k in keys if is_block_key(k)] for w, keys in client.processing().items()}
    return {w: keys for w, keys in loads.items() if keys}


def test_a_paused_scheduler_treats_no_worker_as_silent(tmp_path):
    """The scheduler itself SIGSTOPped for longer than `silent-seconds`: once it runs again,
    every worker's last heartbeat is old, alike; none is treated as silent (silence is
    measured against the other workers, not the clock), and the cluster serves an epoch."""
    path = write_zarr(str(tmp_path / "d.zarr"), 600, chunk=CHUNK)
    address, procs = start_cluster(tmp_path)
    try:
        with distributed.Client(address, timeout=60) as client:
            client.wait_for_workers(3, timeout=60)
            workers = set(client.scheduler_info()["workers"])
            os.kill(procs[0].pid, signal.SIGSTOP)
            try:
                time.sleep(3 * float(SETTINGS["DASK_DMDASK__WORKER__SILENT_SECONDS"]))
            finally:
                os.kill(procs[0].pid, signal.SIGCONT)
            out = tmp_path / "epoch0"
            out.mkdir()
            ids = finish(start_ranks(address, path, 0, out, step=0), out)  # the scheduler's checks ran meanwhile
            assert np.array_equal(np.sort(ids), np.arange(600))
            assert not [msg for _, msg in client.get_events("dmdask") if msg.get("action") == "silent-workers"]
            assert set(client.scheduler_info()["workers"]) == workers
    finally:
        stop(procs)
