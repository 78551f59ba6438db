"""Runs one loader at one point (nodes, node cache): its services, its rank processes, the
counts taken at each epoch's end, and the figures made of them."""
from __future__ import annotations

import contextlib
import json
import os
import signal
import socket
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass, field
from typing import Dict, List

import numpy as np

from .meter import Meter
from .nodes import NodeNamespaces

SHM_BYTES = 8 * 2**30  # a node's /dev/shm (tmpfs: memory is taken only as files are written)
ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


@dataclass
class Run:
    """What a loader's `services(run)` may use: the run's folder, its nodes and their folders."""

    root: str
    nodes: int
    ranks_per_node: int
    node_cache_bytes: int
    meter: Meter
    namespaces: NodeNamespaces
    node_dirs: List[str] = field(default_factory=list)


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _rank_env(rank: int, world: int, per_node: int, nodes: int, port: int, extra: dict) -> dict:
    env = dict(os.environ, **extra)
    env.update(RANK=str(rank), WORLD_SIZE=str(world), LOCAL_RANK=str(rank % per_node),
               LOCAL_WORLD_SIZE=str(per_node), NODE_RANK=str(rank // per_node), GROUP_RANK=str(rank // per_node),
               NNODES=str(nodes), MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), OMP_NUM_THREADS="1",
               LITDATA_DISABLE_VERSION_CHECK="1", PYTHONPATH=os.pathsep.join([ROOT, os.environ.get("PYTHONPATH", "")]))
    return env


def run_one(module, point: dict, ctx: dict, store, extra_env: dict, timeout: float) -> dict:
    """`module`'s ranks over `point`; {"status": "ok", ...figures} or {"status": "failed", "reason"}."""
    nodes, per_node = point["nodes"], ctx["ranks_per_node"]
    world = nodes * per_node
    with tempfile.TemporaryDirectory(prefix=f"dmdask-bench-peers-{module.NAME}-") as root, Meter() as meter, \
            NodeNamespaces(nodes, SHM_BYTES) as namespaces:
        run = Run(root, nodes, per_node, point["node_cache_bytes"], meter, namespaces)
        for node in range(nodes):
            run.node_dirs.append(os.path.join(root, f"node{node}"))
            os.makedirs(os.path.join(run.node_dirs[-1], "tmp"))
            meter.folder(run.node_dirs[-1], node, kind="disk")
        port = _free_port()
        with open(os.path.join(root, "ctx.json"), "w") as f:
            json.dump(dict(ctx, module=module.__name__.rsplit(".", 1)[1], world=world, nodes=nodes, port=port,
                           node_dirs=run.node_dirs, node_cache_bytes=point["node_cache_bytes"]), f)
        services = getattr(module, "services", None)
        started, load = time.perf_counter(), os.getloadavg()[0]
        try:
            with (services(run) if services else contextlib.nullcontext({})) as service_env:
                store.reset_stats()
                counts = _ranks(run, world, per_node, nodes, port, dict(extra_env, **service_env), ctx["epochs"],
                                store, timeout)
        except Exception as exc:  # noqa: BLE001 - one loader failing must not stop the others
            return {"status": "failed", "reason": f"{type(exc).__name__}: {exc}"[:600]}
        if "reason" in counts:
            return {"status": "failed", "reason": counts["reason"]}
        out = _figures(root, world, ctx, counts, meter, time.perf_counter() - started, namespaces.isolated)
        # the 1-minute load average as the run started and as it ended (this machine's other work shows in it)
        return dict(out, load_1min=[round(load, 2), round(os.getloadavg()[0], 2)])


def _ranks(run: Run, world: int, per_node: int, nodes: int, port: int, env: dict, epochs: int, store,
           timeout: float) -> dict:
    """Start the ranks, take the counts at each epoch's end; {"epochs": [...]} or {"reason"}."""
    procs = []
    for rank in range(world):
        log = open(os.path.join(run.root, f"rank-{rank}.log"), "w")
        node = rank // per_node
        env_rank = dict(_rank_env(rank, world, per_node, nodes, port, env), TMPDIR=os.path.join(run.node_dirs[node], "tmp"))
        command = run.namespaces.prefix(node) + [sys.executable, "-m", "benchmarks.peers.rank", run.root, str(rank)]
        procs.append(subprocess.Popen(command, env=env_rank, cwd=ROOT,
                                      stdout=log, stderr=subprocess.STDOUT, start_new_session=True))
        log.close()
        run.meter.watch(procs[-1].pid, "rank", node)
    snapshots, deadline = [], time.monotonic() + timeout
    try:
        while True:
            done = os.path.join(run.root, f"epoch-{len(snapshots)}.done")
            if len(snapshots) < epochs and os.path.exists(done):
                run.meter.poll()
                stats = store.stats()
                snapshots.append({"bytes": stats["bytes"], "requests": stats["requests"] + stats["head_requests"],
                                  "disk": sum(run.meter.written("disk").values()),
                                  "shm": sum(run.meter.written("shm").values())})
                open(os.path.join(run.root, f"epoch-{len(snapshots) - 1}.ack"), "w").close()
            codes = [p.poll() for p in procs]
            if all(c is not None for c in codes):
                break
            if any(c not in (None, 0) for c in codes) or time.monotonic() > deadline:
                break
            time.sleep(0.01)
    finally:
        for p in procs:
            if p.poll() is None:
                with contextlib.suppress(ProcessLookupError):
                    os.killpg(p.pid, signal.SIGKILL)
                p.wait()
    failed = [r for r, p in enumerate(procs) if p.returncode != 0]
    if failed or len(snapshots) < epochs:
        why = "timed out" if not failed or all(procs[r].returncode == -signal.SIGKILL for r in failed) else "failed"
        tails = {r: _error_tail(os.path.join(run.root, f"rank-{r}.log")) for r in failed or [0]}
        rank = next((r for r, t in tails.items() if "gloo" not in t), next(iter(tails)))  # the first cause
        return {"reason": f"rank {rank} {why} after {len(snapshots)} epochs: {tails[rank]}"}
    return {"epochs": snapshots}


def _error_tail(path: str) -> str:
    """The last error a rank's log shows, and the lines after it."""
    with open(path) as f:
        lines = [line.rstrip() for line in f if line.strip()]
    errors = [i for i, line in enumerate(lines) if "Error" in line or "Exception" in line]
    return " / ".join(lines[errors[-1]:errors[-1] + 3] if errors else lines[-4:])[-700:]


def _figures(root: str, world: int, ctx: dict, counts: dict, meter: Meter, seconds: float,
             namespaces_isolated: bool) -> dict:
    ranks = []
    for r in range(world):
        with open(os.path.join(root, f"rank-{r}.json")) as f:
            ranks.append(json.load(f))
    n, out, before = ctx["samples"], [], {"bytes": 0, "requests": 0, "disk": 0, "shm": 0}
    for e, snap in enumerate(counts["epochs"]):
        rows = [r["epochs"][e] for r in ranks]
        wall = max(x["end"] for x in rows) - min(x["start"] for x in rows)
        ids = np.concatenate([np.load(os.path.join(root, f"ids-{r}-{e}.npy")) for r in range(world)])
        unique = np.unique(ids)
        valid = unique[(unique >= 0) & (unique < n)]
        samples = int(sum(x["samples"] for x in rows))
        out.append({"wall_s": wall, "stall": float(np.mean([x["wait_s"] for x in rows])) / wall,
                    "setup_s": float(max(x["setup_s"] for x in rows)), "samples": samples,
                    "samples_per_s": samples / wall, "per_rank_samples_per_s": samples / wall / world, "duplicates": int(len(ids) - len(unique)),
                    "misses": int(n - len(valid)), "per_rank": [x["samples"] for x in rows],
                    **{k: snap[k] - before[k] for k in before}})
        before = snap
    procs = meter.processes()
    later = out[1:] or out
    return {"status": "ok", "epochs": out, "epoch1_s": out[0]["wall_s"],
            "later_s": float(np.mean([e["wall_s"] for e in later])),
            "later_per_rank_samples_per_s": float(np.mean([e["per_rank_samples_per_s"] for e in later])),
            "store_bytes": sum(e["bytes"] for e in out), "store_requests": sum(e["requests"] for e in out),
            "disk_written": sum(e["disk"] for e in out), "shm_written": sum(e["shm"] for e in out),
            "exactly_once": all(e["duplicates"] == 0 and e["misses"] == 0 for e in out),
            "processes": procs, "memory": _memory(procs), "run_s": seconds,
            "nodes_isolated": namespaces_isolated}


def _memory(procs: List[dict]) -> Dict[str, float]:
    """Peak resident memory: the sum over all processes, the largest, and the largest by role (MiB)."""
    by_role: Dict[str, float] = {}
    for p in procs:
        by_role[p["role"]] = max(by_role.get(p["role"], 0.0), p["vmhwm_kib"] / 1024)
    return {"sum_mib": sum(p["vmhwm_kib"] for p in procs) / 1024,
            "max_mib": max((p["vmhwm_kib"] for p in procs), default=0) / 1024,
            "processes": len(procs), "by_role_max_mib": by_role}
