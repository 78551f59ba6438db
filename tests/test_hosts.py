"""Two real hosts: network namespaces joined by a veth pair, loopback-range addresses.

Host A runs the scheduler, a dmdask worker and rank 0; host B a worker and rank 1.
Each rank's batches must be assembled by the worker on its own host, and only the rows
held by the other host may cross the link.
"""
import json
import os
import shutil
import subprocess
import sys

import numpy as np
import pytest

from dmdask.testing.datasets import write_zarr

PY = sys.executable
HOSTS = {"a": "127.100.0.1", "b": "127.100.0.2"}

RANK_SCRIPT = r"""
import json, os, sys, numpy as np, distributed, dmdask
def tag(batch):
    return dict(batch, pid=np.full(len(batch["index"]), os.getpid()))
scheduler, source, rank, out = sys.argv[1:5]
with distributed.Client(scheduler, timeout=30) as client:
    spec = dmdask.Spec(source, batch_size=64, rank=int(rank), world_size=2, transform=tag, seed=5)
    ids, pids = [], set()
    for epoch in range(2):
        for b in dmdask.batches(client, spec, epoch=epoch):
            assert (b["x"][:, 0] == (b["index"] * 7) % 251).all()
            ids.append(b["index"].tolist()); pids |= set(b["pid"].tolist())
    stats = dmdask.stats(client)
    json.dump({"ids": ids, "pids": sorted(pids), "stats": stats, "worker_pids": client.run(os.getpid),
               "workers": {a: i["host"] for a, i in client.scheduler_info()["workers"].items()}}, open(out, "w"))
"""


def ip(*args, check=True):
    return subprocess.run(["ip", *args], check=check, capture_output=True, text=True)


def netns_available():
    return os.geteuid() == 0 and shutil.which("ip") is not None


@pytest.fixture
def two_hosts():
    suffix = str(os.getpid())
    names = {h: f"dmdask-{h}-{suffix}" for h in HOSTS}
    veth = {"a": f"dmva{suffix}"[:15], "b": f"dmvb{suffix}"[:15]}
    try:
        for h in HOSTS:
            ip("netns", "add", names[h])
        ip("link", "add", veth["a"], "type", "veth", "peer", "name", veth["b"])
        for h, addr in HOSTS.items():
            ns = ["netns", "exec", names[h]]
            ip("link", "set", veth[h], "netns", names[h])
            for conf in ("all", veth[h]):  # 127/8 on a non-loopback link needs route_localnet
                subprocess.run(["ip", *ns, "sysctl", "-qw", f"net.ipv4.conf.{conf}.route_localnet=1"], check=True)
            ip(*ns, "ip", "addr", "add", f"{addr}/24", "dev", veth[h])
            ip(*ns, "ip", "link", "set", veth[h], "up")
            ip(*ns, "ip", "link", "set", "lo", "up")
    except subprocess.CalledProcessError as exc:
        for n in names.values():
            ip("netns", "del", n, check=False)
        pytest.skip(f"network namespaces could not be set up here: {exc.stderr or exc}")
    yield names
    for n in names.values():
        ip("netns", "del", n, check=False)


def in_host(names, host, *cmd, **kwargs):
    return subprocess.Popen(["ip", "netns", "exec", names[host], *cmd], **kwargs)


@pytest.mark.skipif(not netns_available(), reason="needs root and iproute2 to create network namespaces")
def test_each_rank_is_served_on_its_own_host(two_hosts, tmp_path):
    names = two_hosts
    source = write_zarr(str(tmp_path / "shared.zarr"), 2000, sample_shape=(16,), chunk=100)
    scheduler = f"tcp://{HOSTS['a']}:8786"
    dask = os.path.join(os.path.dirname(PY), "dask")
    quiet = {"stdout": subprocess.DEVNULL, "stderr": subprocess.DEVNULL}
    file = str(tmp_path / "scheduler.json")  # written once the scheduler listens; the workers wait for it
    procs = [in_host(names, "a", dask, "scheduler", "--host", HOSTS["a"], "--port", "8786", "--scheduler-file",
                     file, "--no-dashboard",
                     env=dict(os.environ, DASK_DISTRIBUTED__SCHEDULER__WORK_STEALING="False"), **quiet)]
    for h in HOSTS:
        procs.append(in_host(names, h, dask, "worker", "--scheduler-file", file, "--worker-class", "dmdask.Worker",
                             "--host", HOSTS[h], "--nthreads", "1", "--name", f"node-{h}", **quiet))
    try:
        outs = {h: str(tmp_path / f"rank-{h}.json") for h in HOSTS}
        wait = [in_host(names, "a", PY, "-c", "import distributed as d; c = d.Client('%s', timeout=30); "
                        "c.wait_for_workers(2, timeout=60)" % scheduler)]
        assert wait[0].wait(90) == 0
        ranks = [in_host(names, h, PY, "-c", RANK_SCRIPT, scheduler, source, str(r), outs[h])
                 for r, h in enumerate(HOSTS)]
        assert [p.wait(180) for p in ranks] == [0, 0]
        results = {h: json.load(open(outs[h])) for h in HOSTS}
    finally:
        for p in procs[::-1]:
            p.terminate()
        for p in procs:
            p.wait(30)
    addr_of = {host: addr for addr, host in results["b"]["workers"].items()}
    assert set(addr_of) == set(HOSTS.values())
    for h, r in results.items():  # every batch of a rank was assembled by its own host's worker
        assert r["pids"] == [r["worker_pids"][addr_of[HOSTS[h]]]]
    stats = results["b"]["stats"]["workers"]
    for h in HOSTS:  # and each host sent the other only the rows it holds
        mine = stats[addr_of[HOSTS[h]]]
        assert mine["peer"]["bytes_in"] > 0 and mine["peer"]["bytes_out"] > 0
    all_ids = np.concatenate([np.concatenate([np.array(b) for b in results[h]["ids"]]) for h in HOSTS])
    assert len(all_ids) == 2 * 2000
    counts = np.bincount(all_ids, minlength=2000)
    assert (counts == 2).all()  # every sample exactly once per epoch over the two hosts' ranks
    total = results["b"]["stats"]["total"]
    assert total["shared_store"]["requests"] == 20  # each block read once, by one host
