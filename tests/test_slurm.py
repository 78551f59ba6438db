"""dmdask under a real Slurm on this machine (Debian's slurm-wlm and munge, started by
scripts/slurm-start.sh, stopped by scripts/slurm-stop.sh): the recipes of docs/hpc.md run
as written.

- docs/hpc.md (a), `train.sbatch` with `--mem=1500M` and no dmdask sizes: its worker's RAM
  tier is <= 1500 MiB (sized from SLURM_MEM_PER_NODE) and its SSD folder is inside the
  job's temp dir; the `srun -n 2` training ranks read an epoch exactly once.
- docs/hpc.md (b), the notebook: `dmdask.jobqueue.SLURMCluster(...).scale(jobs=2)` gives two
  dmdask workers sized from their jobs' grant, and 2 ranks read 2 epochs exactly once.

Slurm is installed by scripts/install-slurm.sh (`make test-main` runs it). The tests skip
only when Slurm is not installed or cannot start here, and say why.
"""
from __future__ import annotations

import json
import os
import re
import shutil
import socket
import subprocess
import sys

import pytest

from dmdask.testing.datasets import write_blobs

from conftest import wait_until

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
SCRIPTS = os.path.join(ROOT, "scripts")
HPC_DOC = os.path.join(ROOT, "docs", "hpc.md")
SAMPLES = 1200
MIB = 2**20
pytestmark = pytest.mark.slow
_SBIN = os.pathsep.join(["/usr/sbin", "/sbin"])


def doc_files(path: str = HPC_DOC) -> dict:
    """The file blocks of docs/hpc.md: fenced blocks whose first lines name them
    (`# file: NAME`), as {NAME: text}, exactly as written there."""
    with open(path) as f:
        text = f.read()
    files = {}
    for block in re.findall(r"```[a-z]*\n(.*?)```", text, flags=re.S):
        match = re.search(r"^# file: (\S+)$", "\n".join(block.splitlines()[:2]), flags=re.M)
        if match:
            files[match.group(1)] = block
    return files


@pytest.fixture(scope="session")
def slurm(tmp_path_factory):
    """A one-node Slurm cluster of this machine, stopped at the end: the environment
    its commands need (SLURM_CONF; this interpreter's bin first on PATH, this checkout on
    PYTHONPATH, both inherited by the jobs)."""
    path = os.pathsep.join([os.environ.get("PATH", ""), _SBIN])
    missing = [t for t in ("slurmctld", "slurmd", "munged", "sbatch") if shutil.which(t, path=path) is None]
    if missing:
        pytest.skip(f"Slurm is not installed ({', '.join(missing)} not found): run scripts/install-slurm.sh")
    state = str(tmp_path_factory.mktemp("slurm"))
    started = subprocess.run(["bash", os.path.join(SCRIPTS, "slurm-start.sh"), state], capture_output=True,
                             text=True, timeout=120, env=dict(os.environ, DMDASK_SLURM_PORT=str(_free_port_pair())))
    if started.returncode != 0:
        subprocess.run(["bash", os.path.join(SCRIPTS, "slurm-stop.sh"), state], capture_output=True, timeout=120)
        pytest.skip(f"Slurm cannot start on this machine: {started.stdout[-1500:]} {started.stderr[-1500:]}")
    env = dict(os.environ, SLURM_CONF=os.path.join(state, "slurm.conf"),
               PATH=os.pathsep.join([os.path.dirname(sys.executable), path]),
               PYTHONPATH=os.pathsep.join(p for p in (ROOT, os.environ.get("PYTHONPATH")) if p))
    for name in [n for n in env if n.startswith(("SLURM_", "DASK_DMDASK__"))]:
        if name != "SLURM_CONF":
            env.pop(name)
    try:
        yield {"env": env, "state": state}
    finally:
        subprocess.run(["bash", os.path.join(SCRIPTS, "slurm-stop.sh"), state], capture_output=True, timeout=120)
        for name in ("slurmctld", "slurmd", "munge/munged"):
            assert not os.path.exists(os.path.join(state, f"{name}.pid")), f"{name} was not stopped"


def _free_port_pair() -> int:
    """A port p with p and p + 1 free on loopback (slurmctld's and slurmd's)."""
    for _ in range(50):
        with socket.socket() as a:
            a.bind(("127.0.0.1", 0))
            port = a.getsockname()[1]
            if port >= 65535:
                continue
            with socket.socket() as b:
                try:
                    b.bind(("127.0.0.1", port + 1))
                except OSError:
                    continue
        return port
    raise RuntimeError("no two consecutive free ports on 127.0.0.1")


def _assert_sized_from(tier: dict, granted_mib: int) -> None:
    """A RAM tier sized from a job granted `granted_mib` (SLURM_MEM_PER_NODE), minus the
    default headroom, x the default share; or less, where a smaller cgroup limit or a
    small /dev/shm (a container's) was the tighter bound, as its source then says."""
    expected = (granted_mib - 512) * MIB // 2
    source = tier["source"]
    if "cgroup" in source.split(" - ")[0] or "capped at the free room" in source:
        assert tier["capacity"] <= expected, tier
    else:
        assert f"SLURM_MEM_PER_NODE={granted_mib}" in source and tier["capacity"] == expected, tier


def _queue(slurm) -> str:
    return subprocess.run(["squeue", "-h", "-o", "%i %j %T"], env=slurm["env"], capture_output=True,
                          text=True, timeout=30).stdout.strip()


@pytest.fixture(scope="session")
def dataset(tmp_path_factory):
    path = str(tmp_path_factory.mktemp("shared") / "train.zarr")
    write_blobs(path, n=SAMPLES)
    return path


def _write_doc_files(folder) -> None:
    for name, text in doc_files().items():
        (folder / name).write_text(text)


def test_doc_has_the_recipes():
    assert {"train.sbatch", "train.py", "notebook.py"} <= set(doc_files())


def test_sbatch_recipe_sizes_its_worker_and_srun_ranks_read_an_epoch_once(slurm, dataset, tmp_path):
    _write_doc_files(tmp_path)
    record = tmp_path / "record"
    done = subprocess.run(["sbatch", "--parsable", "-W", "-o", str(tmp_path / "job.out"), "train.sbatch",
                           "--source", dataset, "--epochs", "1", "--record", str(record)],
                          cwd=tmp_path, env=slurm["env"], capture_output=True, text=True, timeout=600)
    log = (tmp_path / "job.out").read_text() if (tmp_path / "job.out").exists() else ""
    assert done.returncode == 0, f"sbatch: {done.stdout} {done.stderr}\njob output:\n{log[-4000:]}"
    job_id = done.stdout.strip().split(";")[0]

    ranks = [json.loads((record / f"rank-{r}.json").read_text()) for r in range(2)]
    assert [(r["rank"], r["world_size"]) for r in ranks] == [(0, 2), (1, 2)]
    ids = [i for r in ranks for i in r["epochs"]["0"]]
    assert sorted(ids) == list(range(SAMPLES)), "the epoch was not read exactly once over the two ranks"

    stats = json.loads((record / "stats.json").read_text())
    (worker,) = stats["workers"].values()
    job_tmp = os.path.join(slurm["state"], "tmp", job_id)
    assert 0 < worker["ram"]["capacity"] <= 1500 * MIB
    _assert_sized_from(worker["ram"], 1500)
    assert worker["ssd"]["capacity"] > 0 and "$SLURM_TMPDIR" in worker["ssd"]["source"]
    assert worker["ssd"]["dir"].startswith(job_tmp + os.sep), (worker["ssd"], job_tmp)
    assert not os.path.exists(job_tmp), "the job's temp dir outlived the job"
    assert _queue(slurm) == ""


def test_slurm_cluster_notebook_two_jobs_two_ranks_two_epochs(slurm, dataset, tmp_path):
    pytest.importorskip("dask_jobqueue", reason="the jobqueue extra: pip install 'dmdask[jobqueue]'")
    _write_doc_files(tmp_path)
    done = subprocess.run([sys.executable, "notebook.py", dataset], cwd=tmp_path, env=slurm["env"],
                          capture_output=True, text=True, timeout=600)
    assert done.returncode == 0, f"{done.stdout[-3000:]}\n{done.stderr[-5000:]}"
    lines = done.stdout.splitlines()
    workers = [line.split(" ", 2) for line in lines if line.startswith("tcp://")]
    assert len(workers) == 2, done.stdout
    for _, capacity, rest in workers:  # memory="1500MiB": dask-jobqueue asks --mem=2G; sized from that grant
        _assert_sized_from({"capacity": int(capacity), "source": rest}, 2048)
    for epoch in range(2):
        assert f"epoch {epoch}: {SAMPLES} samples, {SAMPLES} distinct, ids 0..{SAMPLES - 1}" in lines, done.stdout
    assert _queue(slurm) == ""


def _wait_for_state(slurm, job_id: str, want, seconds: float = 300) -> str:
    """Poll squeue until job `job_id` is in one of `want` ("" once it left the queue)."""
    import time

    deadline = time.monotonic() + seconds
    while time.monotonic() < deadline:
        state = subprocess.run(["squeue", "-h", "-j", job_id, "-o", "%T"], env=slurm["env"], capture_output=True,
                               text=True, timeout=30).stdout.strip()
        if state in want:
            return state
        time.sleep(0.5)
    raise AssertionError(f"job {job_id} did not reach {want} in {seconds} s (last: {state!r})")


def _wait_for_idle_node(slurm, seconds: float = 120) -> None:
    import time

    deadline = time.monotonic() + seconds
    while time.monotonic() < deadline:
        states = subprocess.run(["sinfo", "-h", "-N", "-o", "%t"], env=slurm["env"], capture_output=True, text=True,
                                timeout=30).stdout.split()
        if states == ["idle"]:
            return
        time.sleep(0.5)
    raise AssertionError(f"the node did not become idle in {seconds} s")


def test_a_requeued_job_refills_its_cache_and_reads_its_epoch_once(slurm, dataset, tmp_path):
    """docs/hpc.md (c): the same script, requeued while it runs, on a fresh $SLURM_TMPDIR."""
    import time

    _write_doc_files(tmp_path)
    record = tmp_path / "record"
    submitted = subprocess.run(["sbatch", "--parsable", "--requeue", "-o", str(tmp_path / "job.out"),
                                "--open-mode=append", "train.sbatch", "--source", dataset, "--epochs", "1",
                                "--record", str(record)],
                               cwd=tmp_path, env=slurm["env"], capture_output=True, text=True, timeout=60)
    assert submitted.returncode == 0, submitted.stderr
    job_id = submitted.stdout.strip().split(";")[0]
    _wait_for_state(slurm, job_id, {"RUNNING"})
    wait_until(lambda: (tmp_path / f"dmdask-scheduler-{job_id}.json").exists(), 300, "the job's scheduler started")
    scontrol = ["scontrol"]
    assert subprocess.run(scontrol + ["requeue", job_id], env=slurm["env"], timeout=60).returncode == 0
    _wait_for_state(slurm, job_id, {"PENDING"})
    _wait_for_idle_node(slurm)
    killed_by = int(time.time())
    # Slurm holds a requeued job back for a while (Reason=BeginTime); let it start sooner, but
    # in a later second than its kill: slurmd refuses credentials issued in the second of a
    # revocation ("already killed, do not launch batch job")
    wait_until(lambda: int(time.time()) > killed_by, 5, "a second later than the kill", pause=0.01)
    subprocess.run(scontrol + ["update", f"JobId={job_id}", "StartTime=now"], env=slurm["env"], timeout=60)
    _wait_for_state(slurm, job_id, {""})
    log = (tmp_path / "job.out").read_text()
    shown = subprocess.run(scontrol + ["show", "job", job_id], env=slurm["env"], capture_output=True, text=True,
                           timeout=60).stdout
    assert "Restarts=1" in shown and "JobState=COMPLETED" in shown, shown + log[-3000:]
    assert "DUE TO JOB REQUEUE" in log

    ranks = [json.loads((record / f"rank-{r}.json").read_text()) for r in range(2)]
    assert sorted(i for r in ranks for i in r["epochs"]["0"]) == list(range(SAMPLES))
    stats = json.loads((record / "stats.json").read_text())
    (worker,) = stats["workers"].values()
    assert worker["ssd"]["dir"].startswith(os.path.join(slurm["state"], "tmp", job_id) + os.sep)
    assert stats["total"]["shared_store"]["bytes"] > 0  # the second run filled its cache from the store again
