"""Scenario 9: dmdask at 64, 256 and 1,024 nodes and up to 10^8 samples, simulated.

No cluster and no process: dmdask's own planning code runs for sampled ranks, and the
rules of docs/architecture.md count the rest.

- Placement (section 6): the creator's `EpochOrder.blocks_first_needed(8 x blocks)`; block
  i of that order on worker i mod W (one worker a node). Its time is measured.
- Planning (section 7): one `EpochOrder` and `RankShare` per rank; the time to a rank's first
  batch ids and to all its ids of an epoch are measured on sampled ranks.
- Messages (section 3), per rank and epoch, walking the sampled ranks' batches in groups of
  `prefetch // 2` batches of at most REQUEST_BYTES: one `dmdask_locate` to the scheduler for a
  group holding blocks whose holder this epoch's iterator does not know yet; one
  one row-channel request per holder on another node; one `dmdask_describe` to the own node's worker per
  block first read there (its files then mapped); plus one `dmdask_get_or_claim` per epoch.
- Traffic (section 6): shared-store bytes E*D - min(C,D)*(E-1) for the cluster's cache C,
  against per-node caches of the same size that share nothing (a node's samples are a fresh
  1/N of D each epoch: later epochs hit c/D of the time); rows crossing nodes, counted.
"""
from __future__ import annotations

import time
from typing import List

import numpy as np

from dmdask.client.iterator import REQUEST_BYTES
from dmdask.plan.order import EpochOrder, RankShare

# nodes; datasets as (samples, samples a block); ranks_per_node; batch; sample_bytes (mean);
# cache: the cluster's cache as a fraction of the dataset; epochs; ranks sampled per point.
PRESETS = {
    "tiny": {"nodes": [4, 16], "datasets": [(10**5, 1000)], "ranks_per_node": 2, "batch": 64,
             "sample_bytes": 63_000, "cache": [0.5, 1.0], "epochs": 3, "sampled_ranks": 1, "prefetch": 8},
    "quick": {"nodes": [64, 256, 1024],
              "datasets": [(10**6, 1000), (10**7, 1000), (10**8, 10_000), (10**8, 1000), (10**8, 100)],
              "ranks_per_node": 8, "batch": 256, "sample_bytes": 63_000, "cache": [0.5, 1.0, 2.0], "epochs": 5,
              "sampled_ranks": 2, "prefetch": 8},
    "full": {"nodes": [64, 256, 1024],
             "datasets": [(10**6, 1000), (10**7, 1000), (10**8, 10_000), (10**8, 1000), (10**8, 100)],
             "ranks_per_node": 8, "batch": 256, "sample_bytes": 63_000, "cache": [0.5, 1.0, 2.0], "epochs": 5,
             "sampled_ranks": 8, "prefetch": 8},
}
SEED = 0


def placement(n: int, block_len: int) -> dict:
    """The creator's first-needed order, timed, and each block's worker for each W."""
    order = EpochOrder(n, block_len, shuffle=True, seed=SEED, epoch=0)
    started = time.perf_counter()
    first = order.blocks_first_needed(8 * order.num_blocks)
    seconds = time.perf_counter() - started
    slot = np.empty(order.num_blocks, dtype=np.int64)
    slot[first] = np.arange(order.num_blocks)
    return {"seconds": seconds, "blocks": order.num_blocks, "slot": slot}


def rank_epoch(n: int, block_len: int, rank: int, world: int, batch: int, group: int, holder: np.ndarray,
               my_node: int, epoch: int = 1) -> dict:
    """One rank's epoch through the data path's rules: messages sent and rows read remotely."""
    started = time.perf_counter()
    order = EpochOrder(n, block_len, shuffle=True, seed=SEED, epoch=epoch)
    share = RankShare(order, rank, world, batch, drop_last=False)
    first_ids = share.batch(0)
    first_s = time.perf_counter() - started
    known = np.zeros(order.num_blocks, dtype=bool)
    described = np.zeros(order.num_blocks, dtype=bool)
    locate = located = rows = describe = remote_samples = 0
    plan_s = 0.0
    for start in range(0, len(share), group):
        t = time.perf_counter()
        ids = np.concatenate(share.batches(start, min(len(share), start + group)))
        plan_s += time.perf_counter() - t
        blocks = np.unique(ids // block_len)
        unknown = blocks[~known[blocks]]
        if len(unknown):
            locate, located = locate + 1, located + len(unknown)
            known[unknown] = True
        where = holder[blocks]
        local = blocks[where == my_node]
        describe += int((~described[local]).sum())
        described[local] = True
        rows += len(np.unique(where[where != my_node]))
        remote_samples += int((holder[ids // block_len] != my_node).sum())
    return {"batches": len(share), "samples": share.num_samples, "first_batch_s": first_s, "plan_s": plan_s,
            "first_ids": len(first_ids), "locate": locate, "located": located, "rows": rows, "describe": describe,
            "remote_samples": remote_samples}


def run(preset: str) -> dict:
    cfg = PRESETS[preset]
    started = time.perf_counter()
    rows = []
    for n, block_len in cfg["datasets"]:
        place = placement(n, block_len)
        for nodes in cfg["nodes"]:
            world = nodes * cfg["ranks_per_node"]
            holder = place["slot"] % nodes
            group = max(1, min(cfg["prefetch"] // 2, REQUEST_BYTES // max(1, cfg["batch"] * cfg["sample_bytes"])))
            sampled = np.linspace(0, world - 1, cfg["sampled_ranks"]).astype(int)
            ranks = [rank_epoch(n, block_len, int(r), world, cfg["batch"], group, holder,
                                int(r) // cfg["ranks_per_node"]) for r in sampled]
            mean = {k: float(np.mean([r[k] for r in ranks])) for k in ranks[0]}
            messages = mean["locate"] + mean["rows"] + mean["describe"] + 1  # + get_or_claim
            rows.append({"samples": n, "block_len": block_len, "blocks": place["blocks"], "nodes": nodes,
                         "world": world, "group": group, "placement_s": place["seconds"], "rank": mean,
                         "messages_per_batch": messages / mean["batches"],
                         "scheduler_requests_per_epoch": world * (mean["locate"] + 1),
                         "worker_requests_per_epoch": world * (mean["rows"] + mean["describe"]) / nodes,
                         "remote_fraction": mean["remote_samples"] / mean["samples"]})
            print(f"[simulate] n={n:,} blocks={place['blocks']:,} nodes={nodes}: "
                  f"{rows[-1]['messages_per_batch']:.2f} messages/batch", flush=True)
    traffic = [{"cache": c, "nodes": nodes, **_traffic(c, nodes, cfg["epochs"])}
               for c in cfg["cache"] for nodes in cfg["nodes"]]
    result = {"config": cfg, "rows": rows, "traffic": traffic, "runtime_s": time.perf_counter() - started}
    result["goals"] = _goals(result)
    return result


def _traffic(cache: float, nodes: int, epochs: int) -> dict:
    """Store reads over `epochs`, in datasets D: dmdask's bound and per-node caches sharing nothing."""
    shared = epochs - min(cache, 1.0) * (epochs - 1)
    per_node = min(cache / nodes, 1.0)
    return {"dmdask": shared, "per_node": 1 + (epochs - 1) * (1 - per_node)}


def _goals(result: dict) -> List[dict]:
    rows = result["rows"]
    biggest = max(r["samples"] for r in rows)
    worst = max(r["rank"]["first_batch_s"] for r in rows)
    slowest = max(rows, key=lambda r: r["placement_s"])
    return [
        {"goal": f"a rank's first batch ids in < 0.1 s at every point (up to {biggest:,} samples)",
         "met": worst < 0.1, "measured": f"worst {worst * 1e3:.1f} ms"},
        {"goal": f"the creator's placement of {slowest['blocks']:,} blocks in < 30 s",
         "met": slowest["placement_s"] < 30, "measured": f"{slowest['placement_s']:.1f} s"},
    ]


def report(result: dict, plots_dir: str) -> str:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    cfg = result["config"]
    lines = ["| samples | blocks | nodes | ranks | placement (creator) | rank: first batch ids | rank: an epoch's ids "
             "| messages a batch | locate / rows / describe a rank-epoch | scheduler requests an epoch "
             "| requests a worker serves an epoch | rows from other nodes |",
             "|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|"]
    for r in result["rows"]:
        k = r["rank"]
        lines.append(f"| {r['samples']:,} | {r['blocks']:,} | {r['nodes']:,} | {r['world']:,} "
                     f"| {r['placement_s']:.2f} s | {k['first_batch_s'] * 1e3:.1f} ms | {k['plan_s'] * 1e3:.0f} ms "
                     f"| {r['messages_per_batch']:.2f} | {k['locate']:.0f} / {k['rows']:.0f} / {k['describe']:.0f} "
                     f"| {r['scheduler_requests_per_epoch']:,.0f} | {r['worker_requests_per_epoch']:,.0f} "
                     f"| {r['remote_fraction']:.1%} |")
    traffic = ["| cluster cache / D | nodes | dmdask (bound) | per-node caches, nothing shared | dmdask / per-node |",
               "|---:|---:|---:|---:|---:|"]
    for t in result["traffic"]:
        traffic.append(f"| {t['cache']:.2f} | {t['nodes']:,} | {t['dmdask']:.2f} D | {t['per_node']:.2f} D "
                       f"| {t['dmdask'] / t['per_node']:.2f} |")
    fig, (a, b) = plt.subplots(1, 2, figsize=(11, 4))
    for (n, bl) in dict.fromkeys((r["samples"], r["block_len"]) for r in result["rows"]):
        sel = [r for r in result["rows"] if (r["samples"], r["block_len"]) == (n, bl)]
        a.plot([r["nodes"] for r in sel], [r["messages_per_batch"] for r in sel], "o-",
               label=f"{n:.0e} samples, {sel[0]['blocks']:,} blocks")
    a.set_xscale("log", base=2)
    a.set_xlabel("nodes")
    a.set_ylabel("messages a rank sends per batch")
    a.legend(fontsize=7)
    for c in cfg["cache"]:
        sel = [t for t in result["traffic"] if t["cache"] == c]
        b.plot([t["nodes"] for t in sel], [t["dmdask"] for t in sel], "o-", label=f"dmdask, C = {c:g} D")
        b.plot([t["nodes"] for t in sel], [t["per_node"] for t in sel], "s--", label=f"per-node caches, C = {c:g} D")
    b.set_xscale("log", base=2)
    b.set_xlabel("nodes")
    b.set_ylabel(f"store reads over {cfg['epochs']} epochs (x D)")
    b.legend(fontsize=7)
    for ax in (a, b):
        ax.grid(alpha=0.3)
    fig.tight_layout()
    fig.savefig(f"{plots_dir}/simulate.png", dpi=110)
    plt.close(fig)
    return (f"{cfg['ranks_per_node']} ranks a node, batch {cfg['batch']}, samples of {cfg['sample_bytes']:,} B "
            f"(so a group is {result['rows'][0]['group']} batch a request), prefetch {cfg['prefetch']}, exact "
            f"global shuffle, one worker a node; {cfg['sampled_ranks']} ranks walked through a whole epoch per "
            "point (their mean shown), epoch 1's order. Times are this machine's, one core. Scheduler requests: "
            "`dmdask_locate` and `dmdask_get_or_claim` of every rank; worker requests: row-channel requests and "
            "`dmdask_describe`, spread over the workers. Epochs after the first run no scheduler task "
            "(section 4). A rank's row-channel requests a group are the distinct other nodes holding its "
            "samples, about min(nodes - 1, samples a group, blocks): they grow with the nodes until each "
            "sample of a group sits on a node of its own; the block size matters only once there are fewer blocks "
            "than that.\n\n" + "\n".join(lines)
            + f"\n\nShared-store reads over {cfg['epochs']} epochs, in datasets D:\n\n" + "\n".join(traffic)
            + f"\n\n![simulation](benchmarks/simulate.png)\n\nWhole simulation: {result['runtime_s']:.0f} s.\n")
