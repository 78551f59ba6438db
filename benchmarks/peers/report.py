"""Scenario 8's section of docs/benchmarks.md: settings, conversion, a table per point, a plot."""
from __future__ import annotations

from typing import List

import numpy as np

from .goals import bound, load, loader_bound

MIB = 2**20
SHORT = {"dataloader": "DataLoader", "webdataset": "WebDataset", "mosaic": "Mosaic", "litdata": "LitData",
         "grain": "Grain", "dmdask": "dmdask", "transparent": "dmdask::"}


def _mib(b: float) -> str:
    return f"{b / MIB:,.0f} MiB" if b >= MIB else (f"{b / 1024:,.0f} KiB" if b else "0")


def _s(seconds: float) -> str:
    return f"{seconds:.2f} s" if seconds < 1 else f"{seconds:.1f} s"


def _settings(result: dict) -> str:
    """From the loaders' modules (their documentation), else from the results."""
    from . import LOADERS

    modules = {m.NAME: m for m in LOADERS}
    lines = ["| loader | reads | settings | exactly once | cache | cache shared between nodes |",
             "|---|---|---|---|---|---|"]
    for m in result["loaders"]:
        module = modules.get(m["name"])
        c = module.CAN if module else m["can"]
        settings = module.settings(result["config"]) if module else m["settings"]
        lines.append(f"| {m['label']} | {m['format']} over {m['store'].upper()} | {settings} "
                     f"| {c['exactly_once']} | {c['cache']} | {c['shared_cache']} |")
    return "\n".join(lines)


def _conversion(result: dict) -> str:
    users = {}
    for m in result["loaders"]:
        users.setdefault(m["format"], []).append(m["label"])
    lines = ["| format | for | written in | put on the S3 server in | files | bytes |", "|---|---|---:|---:|---:|---:|"]
    for fmt, r in result["formats"].items():
        who = ", ".join(users.get(fmt, []))
        if "error" in r:
            lines.append(f"| {fmt} | {who} | not written: {r['error']} | | | |")
            continue
        up = f"{r['upload_s']:.1f} s" if "upload_s" in r else "(HTTP store: none)"
        lines.append(f"| {fmt} | {who} | {r['seconds']:.1f} s | {up} | {r['files']:,} | {_mib(r['bytes'])} |")
    return "\n".join(lines)


def _same_host_label(point: dict) -> str:
    return f"dmdask, same host (all {point['same_host']['ranks']} ranks on one node)"


def _point_table(result: dict, point: dict) -> str:
    size = result["dataset_bytes"]
    labels = {m["name"]: m["label"] for m in result["loaders"]}
    rows = dict(point["loaders"])
    if "same_host" in point:
        labels["same_host"] = _same_host_label(point)
        rows["same_host"] = point["same_host"]
    mine = rows.get("dmdask", {})
    ref = mine if mine.get("status") == "ok" else None
    lines = ["| loader | epoch 1 | epochs 2+ | epochs 2+ / dmdask | stall 1 / 2+ | samples/s 2+ "
             "| store bytes (x D) / requests | store bytes / dmdask | node disk written | peak memory: all processes "
             "(largest, count) | duplicates / misses an epoch |",
             "|---|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|"]
    for name, r in rows.items():
        if r["status"] != "ok":
            lines.append(f"| {labels[name]} | {r['status']}: {r['reason']} | | | | | | | | | |")
            continue
        later = r["epochs"][1:] or r["epochs"]
        stall2 = float(np.mean([e["stall"] for e in later]))
        sps = float(np.mean([e["samples_per_s"] for e in later]))
        dup = "/".join(str(e["duplicates"]) for e in r["epochs"])
        miss = "/".join(str(e["misses"]) for e in r["epochs"])
        disk = _mib(r["disk_written"]) + (f" (+{_mib(r['shm_written'])} RAM tier)" if r["shm_written"] else "")
        vs_later = f"{r['later_s'] / ref['later_s']:.2f}" if ref else "-"
        vs_bytes = f"{r['store_bytes'] / ref['store_bytes']:.2f}" if ref and ref["store_bytes"] else "-"
        m = r["memory"]
        lines.append(
            f"| {labels[name]} | {_s(r['epoch1_s'])} | {_s(r['later_s'])} | {vs_later} "
            f"| {r['epochs'][0]['stall']:.0%} / {stall2:.0%} | {sps:,.0f} "
            f"| {r['store_bytes'] / size:.2f} / {r['store_requests']:,} | {vs_bytes} | {disk} "
            f"| {m['sum_mib']:,.0f} MiB ({m['max_mib']:,.0f} MiB, {m['processes']}) "
            f"| {'none' if r['exactly_once'] else dup + ' / ' + miss} |")
    b = bound(result, point)
    if "same_host" in point:
        lines.append(f"\n{labels['same_host']}: one dmdask worker whose RAM tier is the cluster's cache "
                     f"({point['nodes']} x {point['node_cache']:.2f} D), every row mapped from its arenas, none over "
                     "TCP: the same-host path the remote rows are compared with.")
    return "\n".join(lines) + f"\n\nBound E*D - min(C,D)*(E-1) here: {b / size:.2f} D (C = {point['nodes']} x " \
                              f"{point['node_cache']:.2f} D)."


def _plot(result: dict, path: str) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    points = result["points"]
    fig, axes = plt.subplots(2, len(points), figsize=(5.2 * len(points), 7), squeeze=False)
    for col, point in enumerate(points):
        ok = [(k, r) for k, r in point["loaders"].items() if r["status"] == "ok"]
        x = np.arange(len(ok))
        names = [SHORT.get(k, k) for k, _ in ok]
        top, bottom = axes[0][col], axes[1][col]
        top.bar(x - 0.2, [r["epoch1_s"] for _, r in ok], 0.4, label="epoch 1")
        top.bar(x + 0.2, [r["later_s"] for _, r in ok], 0.4, label="epochs 2+ (mean)")
        top.set_ylabel("epoch wall time (s)")
        top.axhline(result["dataset_bytes"] / result["config"]["bandwidth"], color="tab:red", ls=":", lw=1,
                    label="reading D once from the store")
        top.set_title(f"{point['nodes']} nodes, node cache {point['node_cache']:.2f} D"
                      + ("" if point.get("rate", result["config"]["rate"]) else ", no step"), fontsize=9)
        bottom.bar(x, [r["store_bytes"] / result["dataset_bytes"] for _, r in ok], 0.6, color="tab:gray")
        bottom.axhline(bound(result, point) / result["dataset_bytes"], color="k", ls="--", lw=1,
                       label="bound E*D - min(C,D)*(E-1)")
        bottom.set_ylabel(f"store bytes over {point.get('epochs', result['config']['epochs'])} epochs (x D)")
        for ax in (top, bottom):
            heights = [p.get_height() for p in ax.patches if p.get_height() > 0]
            if heights and max(heights) > 8 * min(heights):
                ax.set_yscale("log")
            ax.set_xticks(x)
            ax.set_xticklabels(names, fontsize=7)
            ax.grid(axis="y", alpha=0.3)
        if col == 0:
            top.legend(fontsize=7)
            bottom.legend(fontsize=7)
    fig.tight_layout()
    fig.savefig(path, dpi=100)
    plt.close(fig)


def summary(result: dict) -> List[str]:
    """One line per point and peer: its epochs 2+ time, epoch 1 time and store bytes over dmdask's."""
    lines = ["| point | peer | epochs 2+ / dmdask | epoch 1 / dmdask | store bytes / dmdask |", "|---|---|---:|---:|---:|"]
    labels = {m["name"]: m["label"] for m in result["loaders"]}
    for point in result["points"]:
        mine = point["loaders"].get("dmdask", {})
        if mine.get("status") != "ok":
            continue
        for name, r in point["loaders"].items():
            if name == "dmdask" or r["status"] != "ok":
                continue
            tag = ", no step" if loader_bound(result, point) else ""
            lines.append(f"| {point['nodes']} nodes, {point['node_cache']:.2f} D a node{tag} | {labels[name]} "
                         f"| {r['later_s'] / mine['later_s']:.2f} | {r['epoch1_s'] / mine['epoch1_s']:.2f} "
                         f"| {r['store_bytes'] / max(1, mine['store_bytes']):.2f} |")
    return lines


def per_rank(result: dict) -> List[str]:
    """The loader-bound points side by side: each loader's per-rank samples/s on epochs 2+ (the
    epoch's samples / its wall time / ranks) and dmdask's remote figure over its same-host run's."""
    points = [p for p in result["points"] if loader_bound(result, p)]
    if not points:
        return []
    labels = {m["name"]: m["label"] for m in result["loaders"]}
    head = [f"{p['nodes']} nodes x {p['node_cache']:.2f} D" for p in points]
    lines = ["| loader | " + " | ".join(f"{h}: per rank / dmdask's | load (start-end)" for h in head) + " |",
             "|---|" + "---:|---:|" * len(points)]

    def cell(r: dict, mine: dict) -> str:
        if r.get("status") != "ok":
            return f"{r.get('status', 'not run')} | "
        v = r["later_per_rank_samples_per_s"]
        ratio = f" ({v / mine['later_per_rank_samples_per_s']:.2f})" if mine.get("status") == "ok" else ""
        return f"{v:,.0f}{ratio} | {load(r)}"

    for name in labels:
        cells = [cell(p["loaders"].get(name, {}), p["loaders"].get("dmdask", {})) for p in points]
        lines.append(f"| {labels[name]} | " + " | ".join(cells) + " |")
    if any("same_host" in p for p in points):
        cells = [cell(p.get("same_host", {}), p["loaders"].get("dmdask", {})) for p in points]
        lines.append("| dmdask, same host (the point's ranks all on one node) | " + " | ".join(cells) + " |")
        ratios = []
        for p in points:
            mine, same = p["loaders"].get("dmdask", {}), p.get("same_host", {})
            ok = mine.get("status") == "ok" and same.get("status") == "ok"
            ratios.append(f"**{mine['later_per_rank_samples_per_s'] / same['later_per_rank_samples_per_s']:.2f}x** | "
                          if ok else "- | ")
        lines.append("| dmdask remote / same host, per rank | " + " | ".join(ratios) + " |")
    return lines


def report(result: dict, plots_dir: str) -> str:
    _plot(result, f"{plots_dir}/peers.png")
    cfg, size = result["config"], result["dataset_bytes"]
    points = result["points"]
    isolated = all(r.get("nodes_isolated", False) for p in points for r in p["loaders"].values()
                   if r["status"] == "ok")
    from . import PRESETS

    def listed(pts):
        return ", ".join(f"{p['nodes']} nodes x {p['node_cache']:.2f} D (cluster {p['nodes'] * p['node_cache']:.2f} D"
                         + (", no step)" if p.get("rate", cfg["rate"]) == 0 else ")") for p in pts)

    covered = listed(points)
    others = "; ".join(f"`--{name}`: {listed(c['points'])}" for name, c in PRESETS.items()
                       if name != "tiny" and c["points"] != cfg["points"])
    floor = size / cfg["bandwidth"]
    text = [
        f"{cfg['samples']:,} image-like samples of 16-110 KB (D = {size / MIB:.1f} MiB), each loader's own format "
        f"written once (below). One store for all, throttled to {cfg['bandwidth'] / MIB:.0f} MiB/s in all and "
        f"{cfg['latency'] * 1e3:.0f} ms a request, counting every request and byte: `StoreServer` over HTTP, and "
        "moto's S3 server behind the same throttle and counters for the loaders that speak only S3, each in a "
        "process of its own (`StoreProcess`: a server thread in the benchmark's process shared its lock with the "
        "meter polling every process's memory, 11-108 ms a poll, and sent less than its cap while its queue was "
        "shallow). "
        f"Points: {covered}" + (f" (other presets: {others})" if others else "") + f". Each node runs {cfg['ranks_per_node']} rank processes (one gloo process group, "
        f"RANK/WORLD_SIZE/LOCAL_RANK/LOCAL_WORLD_SIZE set as torchrun does), each with {cfg['loader_workers']} "
        "loader worker process; dmdask has instead one worker process a node "
        f"(threads = ranks a node). Every rank runs {cfg['epochs']} epochs (a point that names its own: that many) "
        "of the same loop: its batches of "
        f"{cfg['batch']}, a training step emulated by a sleep of batch / {cfg['rate']:,} samples/s (none at the "
        "loader-bound points, marked *no emulated step*: there every loader is the bottleneck, and dmdask runs "
        "once more with the point's ranks all on one node whose one worker holds the cluster's cache, its "
        "same-host path, every row mapped and none over TCP), barriers between epochs; each loader's library is "
        "imported before the first epoch (as a training script imports at its top; torch is imported by every "
        "rank anyway) and followed by one full garbage collection (else the process's first, 0.1-0.2 s here, lands in whichever loader's epoch first "
        "crosses the collector's threshold), the loader is built inside epoch 1's clock. All processes share "
        "this machine's cores, one loader at a time. "
        + ("Each node has its own /dev/shm (a mount namespace with a private tmpfs), as separate hosts would: "
           "Mosaic's shared memory and dmdask's RAM tier are per node; dmdask's ranks map their own node's "
           "blocks and ask the other nodes' workers over TCP. " if isolated else
           "The nodes share this machine's /dev/shm (no mount namespaces here). ")
        + f"Reading D once takes the store at least {floor:.1f} s; a loader whose one iterator spans all epochs "
        "(Grain here) keeps reading ahead while the ranks wait at the barriers, so its epochs 2+ can look shorter "
        "than that. Node disk written: bytes of files that appeared under a node's folder (each (path, inode) at its "
        "largest size, polled every 0.2 s; dmdask's RAM tier in /dev/shm shown apart). Peak memory: VmHWM of "
        "every process of the run (ranks, loader workers, dmdask's scheduler and workers), polled. Duplicates "
        "and misses: from the sample ids the ranks got, per epoch. "
        f"Whole scenario: {result['runtime_s']:.0f} s.",
        "", "**Settings** (each as its documentation recommends for multi-node training)", "", _settings(result),
        "", "**Conversion** (timed apart, not in any epoch)", "", _conversion(result),
    ]
    for point in points:
        step = "" if point.get("rate", cfg["rate"]) else f", no emulated step (loader-bound), {point['epochs']} epochs"
        text += ["", f"**{point['nodes']} nodes, node cache {point['node_cache']:.2f} D "
                     f"(cluster {point['nodes'] * point['node_cache']:.2f} D){step}**", "", _point_table(result, point)]
    table = per_rank(result)
    if table:
        text += ["", "**Loader-bound points: per-rank samples/s on epochs 2+** (an epoch's samples / its wall time / "
                     "ranks, the mean over epochs 2+; in brackets: over dmdask's at the same point; load: the 1-minute "
                     "load average as the loader's run started and ended)", ""] + table
    text += ["", "**Ratios to dmdask** (above 1: dmdask is faster, or reads less)", ""] + summary(result)
    text += ["", "![peers](benchmarks/peers.png)", ""]
    return "\n".join(text)
