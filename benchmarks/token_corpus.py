"""Scenario 15: a language-model corpus of 10^10 tokens (issue 40), described without writing it.

A raw token file (`dmdask.Tokens(path, "uint16")`, nanoGPT's layout) made sparse with
`truncate`: 2x10^10 bytes that take no disk and read as zeros, so block loads cost a ranged
read of zeros and what is measured is what a rank of a large job pays for its first batch.
A `dmdask.LocalCluster` of two workers; rank `first` of `world` opens the cold dataset in a
process of its own (it creates the blocks), then rank `second` of the same world in another
(the dataset registered). Each rank: `dmdask.batches(...)` then `next()`, windows of
`seq_len + 1` tokens at a stride of `seq_len`.

Measured per rank: the seconds from the `batches` call to the first batch, what Python
allocated meanwhile (tracemalloc: the peak, and what is still held with the first batch in
hand), the process's RSS growth over the call, and whether the batch holds its windows'
tokens (zeros, each window's id within the epoch). No file is built per rank or per restart:
a rank's plan of its windows is O(batch) (`WindowShare`).

Warm tokens/s (`throughput`): a corpus of real (random) tokens, held by the two workers of a
LocalCluster of its own, read by a process on their host (the same-host path: windows taken whole from the mapped
arenas), epoch after epoch, against numpy slicing of the same array in that process's
memory (nanoGPT's `get_batch`: a batch array, one slice per window, the same windows in the
same order), interleaved in one run: the ratio of each pair, their median.
"""
from __future__ import annotations

import json
import os
import subprocess
import sys
import tempfile
import time

PRESETS = {
    "tiny": {"tokens": 10**8, "world": 64, "first": 17, "second": 3, "batch": 8, "seq_len": 1024, "ram": "512 MiB",
             "warm_tokens": 4 * 10**6, "warm_batches": [8], "repeats": 3},
    "quick": {"tokens": 10**10, "world": 1024, "first": 517, "second": 3, "batch": 8, "seq_len": 1024,
              "ram": "512 MiB", "warm_tokens": 2 * 10**7, "warm_batches": [8, 64], "repeats": 7},
    "full": {"tokens": 10**10, "world": 1024, "first": 517, "second": 3, "batch": 8, "seq_len": 1024,
             "ram": "512 MiB", "warm_tokens": 5 * 10**7, "warm_batches": [8, 64], "repeats": 9},
}
BLEND_WEIGHTS = [0.5, 0.3, 0.2]
GOAL_FIRST_BATCH_S = 2.0
GOAL_ALLOCATED_MIB = 64.0
GOAL_WARM_RATIO = 0.8  # warm tokens/s into a rank against numpy slicing of the same array


def rank(address: str, path: str, rank_: int, world: int, batch: int, seq_len: int) -> dict:
    """One rank in this process: `batches` then `next()`, timed and traced (tracemalloc from the call).
    `path`: a token file, or several joined by "," (a `dmdask.Mix` of them, weights 0.5, 0.3, 0.2)."""
    import tracemalloc

    import distributed
    import numpy as np
    import psutil

    import dmdask

    me = psutil.Process()
    with distributed.Client(address) as client:
        paths = path.split(",")
        source = dmdask.Tokens(path, "uint16") if len(paths) == 1 else \
            dmdask.Mix([dmdask.Tokens(p, "uint16") for p in paths], weights=BLEND_WEIGHTS[:len(paths)])
        spec = dmdask.Spec(source, batch_size=batch, rank=rank_, world_size=world, seed=1,
                           window=dmdask.Window(seq_len + 1, stride=seq_len))
        rss0 = me.memory_info().rss
        tracemalloc.start()
        started = time.perf_counter()
        it = dmdask.batches(client, spec, epoch=0, progress=False)
        opened = time.perf_counter() - started
        first = next(it)
        seconds = time.perf_counter() - started
        held, peak = tracemalloc.get_traced_memory()
        tracemalloc.stop()
        rss1 = me.memory_info().rss
        store = dmdask.stats(client)["total"]["shared_store"]  # what the workers read by then
        windows = np.asarray(first["index"])
        shape_ok = first["tokens"].shape == (len(windows), seq_len + 1) and not first["tokens"].any()
        sources = first["source"] if len(paths) > 1 else np.zeros(len(windows), dtype=np.int64)
        counts = np.array([(os.path.getsize(p) // 2 - 1) // seq_len for p in paths])  # windows of each corpus
        out = {"rank": rank_, "blend": len(paths), "open_s": opened, "first_batch_s": seconds,
               "allocated_peak_mib": peak / 2**20,
               "allocated_held_mib": held / 2**20, "rss_growth_mib": (rss1 - rss0) / 2**20,
               "rss_mib": rss1 / 2**20, "windows": windows.tolist(), "batches": len(it),
               "store_requests": store["requests"], "store_bytes": store["bytes"],
               "batch_ok": bool(shape_ok and (windows < counts[sources]).all())}
        it.close()
    return out


def throughput(address: str, path: str, batch: int, seq_len: int, repeats: int) -> dict:
    """Warm tokens/s of one rank in this process against numpy slicing of the same tokens in
    its memory, interleaved: an epoch of dmdask (timed from its first `next`), then the same
    windows in the same order sliced by numpy; `repeats` pairs after two epochs that load the
    blocks and map their arenas."""
    import statistics

    import distributed
    import numpy as np

    import dmdask

    tokens = np.fromfile(path, dtype=np.uint16)  # the trainer's own copy
    length = seq_len + 1
    spec = dmdask.Spec(dmdask.Tokens(path, "uint16"), batch_size=batch, seed=1,
                       window=dmdask.Window(length, stride=seq_len))
    ours, numpys, right, requests = [], [], True, 0
    with distributed.Client(address) as client:
        for epoch in range(2 + repeats):
            it = dmdask.batches(client, spec, epoch=epoch, progress=False)
            started, count, windows = time.perf_counter(), 0, []
            for b in it:
                count += b["tokens"].size
                windows.append(b["index"])
            seconds = time.perf_counter() - started
            if epoch < 2:
                continue
            ours.append(count / seconds)
            requests += it.requests
            right = right and all((b["tokens"][j] == tokens[w * seq_len:w * seq_len + length]).all()
                                  for j, w in enumerate(b["index"].tolist()))  # the last batch
            started = time.perf_counter()
            for ids in windows:  # the same batches, sliced out of the array in memory
                out = np.empty((len(ids), length), dtype=tokens.dtype)
                for j, start in enumerate((ids * seq_len).tolist()):
                    out[j] = tokens[start:start + length]
            numpys.append(count / (time.perf_counter() - started))
    ratios = [a / b for a, b in zip(ours, numpys)]
    return {"batch": batch, "tokens_s": statistics.median(ours), "numpy_tokens_s": statistics.median(numpys),
            "ratio": statistics.median(ratios), "ratios": ratios, "requests": requests, "windows_right": right}


def _throughput_process(address: str, path: str, batch: int, cfg: dict, environ: dict) -> dict:
    """`throughput` in a process of its own, with `environ`: the environment as the benchmark
    started, as a trainer's launcher gives it, not this process's once a LocalCluster ran in
    it (distributed sets its workers' MALLOC_TRIM_THRESHOLD_=65536 and thread counts in
    os.environ, and glibc then hands each freed batch array back to the kernel)."""
    done = subprocess.run([sys.executable, "-m", "benchmarks.token_corpus", "throughput", address, path, str(batch),
                           str(cfg["seq_len"]), str(cfg["repeats"])], capture_output=True, text=True, timeout=900,
                          env=dict(environ, DASK_DMDASK__PROGRESS="false"))
    lines = done.stdout.strip().splitlines()
    if done.returncode or not lines:
        return {"batch": batch, "error": (done.stderr or done.stdout)[-600:]}
    return dict(json.loads(lines[-1]), error=None)


def _rank_process(address: str, path: str, r: int, cfg: dict) -> dict:
    done = subprocess.run([sys.executable, "-m", "benchmarks.token_corpus", address, path, str(r), str(cfg["world"]),
                           str(cfg["batch"]), str(cfg["seq_len"])], capture_output=True, text=True, timeout=600,
                          env=dict(os.environ, DASK_DMDASK__PROGRESS="false"))
    lines = done.stdout.strip().splitlines()
    if done.returncode or not lines:
        return {"rank": r, "error": (done.stderr or done.stdout)[-600:]}
    return dict(json.loads(lines[-1]), error=None)


def run(preset: str) -> dict:
    import distributed
    import numpy as np

    import dmdask

    cfg = PRESETS[preset]
    environ = dict(os.environ)  # before any LocalCluster changes it
    load = os.getloadavg()[0]
    with tempfile.TemporaryDirectory(prefix="dmdask-bench-tokens-") as root:
        path = os.path.join(root, "corpus.bin")
        with open(path, "wb") as f:
            f.truncate(2 * cfg["tokens"])  # uint16 tokens; sparse: no block of it is written
        corpora = [os.path.join(root, f"corpus-{i}.bin") for i in range(len(BLEND_WEIGHTS))]
        for corpus in corpora:  # the blend: the same number of tokens in 3 corpora
            with open(corpus, "wb") as f:
                f.truncate(2 * (cfg["tokens"] // len(corpora)))
        on_disk = sum(os.stat(p).st_blocks * 512 for p in [path] + corpora)
        warm_path = os.path.join(root, "warm.bin")  # real tokens, for warm tokens/s
        np.random.default_rng(0).integers(0, 50257, cfg["warm_tokens"], dtype=np.uint16).tofile(warm_path)
        with dmdask.LocalCluster(n_workers=2, ram=cfg["ram"]) as cluster, distributed.Client(cluster) as client:
            address = client.scheduler.address
            ranks = [_rank_process(address, path, cfg[which], cfg) for which in ("first", "second")]
            ranks.append(_rank_process(address, ",".join(corpora), cfg["first"], cfg))  # cold, as the first
            datasets = dmdask.stats(client)["datasets"]
        load_warm = os.getloadavg()[0]
        with dmdask.LocalCluster(n_workers=2, ram=cfg["ram"]) as cluster, distributed.Client(cluster) as client:
            # a cluster of its own: the one above goes on loading the blocks of 10^10 tokens
            warm = [_throughput_process(client.scheduler.address, warm_path, b, cfg, environ)
                    for b in cfg["warm_batches"]]
    blocks = -(-2 * cfg["tokens"] // (8 << 20))
    result = {"config": cfg, "load_1min": load, "load_1min_after": os.getloadavg()[0], "file_bytes": 2 * cfg["tokens"],
              "on_disk_bytes": on_disk, "blocks": blocks, "ranks": ranks, "datasets": len(datasets),
              "warm": warm, "load_warm": [load_warm, os.getloadavg()[0]]}
    result["goals"] = goals(result)
    return result


def goals(result: dict) -> list:
    cfg = result["config"]

    def measured(x):
        if x.get("error"):
            return f"rank {x['rank']}: failed ({x['error'][-120:]})"
        return (f"rank {x['rank']}: {x['first_batch_s']:.2f} s, {x['allocated_peak_mib']:.1f} MiB allocated at the "
                f"peak, RSS +{x['rss_growth_mib']:.0f} MiB")

    def goal(what: str, ranks: list) -> dict:
        ok = [x for x in ranks if not x.get("error") and x["batch_ok"]]
        return {"goal": f"{what}: a rank of {cfg['world']:,} gets its first batch within {GOAL_FIRST_BATCH_S:g} s "
                        f"with < {GOAL_ALLOCATED_MIB:g} MiB allocated, no index built per rank",
                "met": bool(ranks) and len(ok) == len(ranks) and all(x["first_batch_s"] < GOAL_FIRST_BATCH_S and
                                                                     x["allocated_peak_mib"] < GOAL_ALLOCATED_MIB
                                                                     for x in ok),
                "measured": "; ".join(measured(x) for x in ranks) + f" (load {result['load_1min']:.1f})"}

    single = [x for x in result["ranks"] if x.get("blend", 1) == 1]
    blend = [x for x in result["ranks"] if x.get("blend", 1) > 1]
    out = [goal(f"{cfg['tokens']:.0e} tokens described without writing them", single),
           goal(f"a blend of {len(BLEND_WEIGHTS)} corpora of {cfg['tokens']:.0e} tokens in all (dmdask.Mix)", blend)]
    warm = [x for x in result.get("warm", []) if not x.get("error")]
    if "warm" in result:
        out.append({"goal": f"warm tokens/s into a rank >= {GOAL_WARM_RATIO:g}x numpy slicing of the same array in "
                            "its memory (same host)",
                    "met": bool(warm) and len(warm) == len(result["warm"]) and
                    all(x["ratio"] >= GOAL_WARM_RATIO and x["windows_right"] for x in warm),
                    "measured": "; ".join(f"batch {x['batch']}: {x['ratio']:.2f}x ({x['tokens_s'] / 1e6:.0f} M "
                                          f"against {x['numpy_tokens_s'] / 1e6:.0f} M tokens/s)" for x in warm) +
                    f" (load {result['load_warm'][0]:.1f})"})
    return out


def report(result: dict, plots_dir: str) -> str:
    cfg = result["config"]
    blend = any(x.get("blend", 1) > 1 for x in result["ranks"])
    blended = ", and 3 more of a third of its tokens each" if blend else ""
    lines = [f"A raw uint16 token file of {cfg['tokens']:,} tokens ({result['file_bytes'] / 2**30:.1f} GiB, "
             f"{result['blocks']:,} blocks of 8 MiB){blended}, made with "
             f"`truncate` ({result['on_disk_bytes']:,} bytes on disk), read as `dmdask.Tokens(path, 'uint16')` "
             f"with `Window({cfg['seq_len'] + 1}, stride={cfg['seq_len']})`, batch {cfg['batch']}; a LocalCluster "
             f"of two workers, RAM tier {cfg['ram']} each. Each rank is a process of its own; times from its "
             "`batches` call; allocations traced by tracemalloc from that call (the peak, and what is held with "
             "the first batch in hand).", "",
             "| rank | dataset | open | first batch | allocated (peak) | allocated (held) | RSS growth | blocks read "
             "from the store by then | batches of the rank | windows right |",
             "|---:|---|---:|---:|---:|---:|---:|---:|---:|---|"]
    states = ("cold: creates the blocks", "registered",
              f"a blend of {len(BLEND_WEIGHTS)} corpora (`dmdask.Mix`, weights {BLEND_WEIGHTS}), cold")
    for x, state in zip(result["ranks"], states):
        if x.get("error"):
            lines.append(f"| {x['rank']} | {state} | failed | | | | | | | `{x['error'][-80:]}` |")
            continue
        lines.append(f"| {x['rank']} of {cfg['world']:,} | {state} | {x['open_s']:.2f} s | {x['first_batch_s']:.2f} s "
                     f"| {x['allocated_peak_mib']:.1f} MiB | {x['allocated_held_mib']:.1f} MiB "
                     f"| {x['rss_growth_mib']:.0f} MiB | {x['store_requests']:,} ({x['store_bytes'] / 2**20:,.0f} MiB) "
                     f"| {x['batches']:,} | {x['batch_ok']} |")
    lines += ["", f"Load (1 min) {result['load_1min']:.1f} at the start, {result['load_1min_after']:.1f} at the end.",
              "", "Blocks read by then: whole 8 MiB blocks the workers had read (and stored) since the cluster "
              "started, when the rank had its first batch; the first batches of all ranks of a large world "
              "together touch nearly every block. RSS growth counts the pages of the workers' shared-memory "
              "arenas the rank maps (/dev/shm), which tracemalloc does not see. One run per rank: on a shared "
              "machine its times vary several-fold."]
    if "warm" in result:
        lines += ["", f"Warm tokens/s: {cfg['warm_tokens']:,} random uint16 tokens in a raw file, held by the two "
                  f"workers of a LocalCluster of its own (RAM tier {cfg['ram']} each), read with `Window(1025, stride=1024)` by a process on their host (the same-host path: "
                  "each window one slice of a worker's mapped arena), against numpy slicing of the same tokens in that "
                  "process's memory (a batch array, one slice per window: nanoGPT's `get_batch`), the same windows in "
                  f"the same order. {cfg['repeats']} warm epochs of each, interleaved, after two that load and map "
                  "the blocks; medians, and the median of the pairs' ratios (their range in brackets). numpy's batch "
                  "array of 64 windows (131 KB) is past glibc's 128 KiB mmap threshold: fresh pages each batch. The "
                  "process gets the environment the benchmark started with: the one a LocalCluster leaves in its "
                  "parent (MALLOC_TRIM_THRESHOLD_=65536, set by distributed for its workers) halves dmdask's batch-8 "
                  "figure (0.4-0.5x), whose group arrays glibc then gives back to the kernel and faults in again.", "",
                  "| batch (windows) | dmdask, tokens/s | numpy slicing, tokens/s | dmdask / numpy | requests to "
                  "workers | windows right |", "|---:|---:|---:|---:|---:|---|"]
        for x in result["warm"]:
            if x.get("error"):
                lines.append(f"| {x['batch']} | failed | | | | `{x['error'][-80:]}` |")
                continue
            lines.append(f"| {x['batch']} | {x['tokens_s'] / 1e6:,.0f} M | {x['numpy_tokens_s'] / 1e6:,.0f} M "
                         f"| {x['ratio']:.2f}x ({min(x['ratios']):.2f}-{max(x['ratios']):.2f}) | {x['requests']} "
                         f"| {x['windows_right']} |")
        lines += ["", f"Load (1 min) {result['load_warm'][0]:.1f} before the warm runs, {result['load_warm'][1]:.1f} "
                  "after."]
    return "\n".join(lines) + "\n"


if __name__ == "__main__" and sys.argv[1] == "throughput":
    address, path, batch, seq_len, repeats = sys.argv[2:7]
    print(json.dumps(throughput(address, path, int(batch), int(seq_len), int(repeats))), flush=True)
elif __name__ == "__main__":
    address, path, r, world, batch, seq_len = sys.argv[1:7]
    print(json.dumps(rank(address, path, int(r), int(world), int(batch), int(seq_len))), flush=True)
