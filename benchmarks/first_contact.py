"""Scenario 14: first contact at scale (issue 41): a cold dataset of 10^4 to 10^6 blocks.

A Zarr array of one-byte samples in chunks of 10, no chunk written (reads give the fill
value), so block loads are nearly free and what is measured is the control plane. A stock
`dask scheduler` (its log kept) and two `dask worker --worker-class dmdask.Worker`, a fresh
cluster per size. Rank 0 of 1,024 calls `dmdask.batches` then `next()` in this process
(it creates the blocks); rank `other` of the same world does the same in a second process,
started once rank 0 holds the claim. Default settings (`dmdask.client.recovery-seconds`
60 s: a first batch later than that fails, and is reported as failed).

Measured per size: the time from rank 0's call to each rank's `batches()` returning
("registered") and to its first batch, the blocks loaded when the other rank had its first
batch, the time until every block is loaded, the scheduler's RSS growth and CPU-seconds per
block (start to every block loaded), and the scheduler's event-loop stalls (Dask's
`distributed.admin.tick` warnings, "Event loop was unresponsive", in its log); then the
scheduler CPU of one more rank's open of the dataset, ready by then (`opens` of them).

With `profile` (quick, full: at the size named), one more cluster of that size whose
scheduler runs under `py-spy record` (its parent: no ptrace permission needed) and
`tracemalloc`: where the scheduler's CPU goes (functions by samples, self and inclusive) and
its memory (bytes still allocated once every block is loaded, by source line).
"""
from __future__ import annotations

import collections
import contextlib
import json
import os
import shutil
import subprocess
import sys
import tempfile
import threading
import time

from .common import scheduler_address
from .scale import write_fill_array

PRESETS = {
    "tiny": {"blocks": [1000], "world": 1024, "other": 517, "batch": 64, "profile": None, "opens": 4},
    # quick: 3*10^5, not 10^6 (2-core machine: every block of 10^5 loaded after ~80 s, so 10^6
    # would take ~15 min and ~10 GiB for the scheduler and workers; `full` measures it)
    "quick": {"blocks": [10**4, 10**5, 3 * 10**5], "world": 1024, "other": 517, "batch": 64, "profile": 10**5, "opens": 32},
    "full": {"blocks": [10**4, 10**5, 10**6], "world": 1024, "other": 517, "batch": 64, "profile": 10**5, "opens": 32},
    # the 10^6-block point alone, stopped `limit_s` after rank 0's call (first batches, the cost of the
    # blocks loaded by then, stalls), and Dask's own cost per task (`dask_floor`) of `floor` tasks beside it
    "million": {"blocks": [10**6], "world": 1024, "other": 517, "batch": 64, "profile": None, "opens": 4,
                "limit_s": 300, "floor": 3 * 10**4},
    # 32 processes x 4 threads, ranks of one world of 1,024, open a cold 10^5-block dataset at once
    "crowd": {"blocks": [], "world": 1024, "other": 517, "batch": 64, "profile": None, "opens": 0,
              "crowd": (10**5, 32, 4)},
}
GOAL_FIRST_BATCH_S = 5.0
GOAL_KIB_PER_BLOCK = 1.0
GOAL_US_PER_BLOCK = 50.0
STALL = "Event loop was unresponsive"
LOAD_TIMEOUT = 1800  # seconds to wait for every block to load


@contextlib.contextmanager
def logged_cluster(folder: str, n_workers: int = 2, ram: str = "2 GiB", profile_to: str | None = None):
    """A stock scheduler (under `py-spy record` writing `profile_to`, if given) and
    `n_workers` dmdask workers, their logs in `folder`; yields (address, scheduler pid)."""
    import psutil

    scheduler_file = os.path.join(folder, "scheduler.json")
    env = dict(os.environ, DASK_DMDASK__WORKER__RAM=ram)
    command = [sys.executable, "-m", "distributed.cli.dask_scheduler", "--port", "0", "--dashboard-address", ":0",
               "--scheduler-file", scheduler_file]
    if profile_to:
        command = [shutil.which("py-spy") or os.path.join(os.path.dirname(sys.executable), "py-spy"), "record", "--nonblocking",
                   "--format", "raw", "--rate", "50", "--output", profile_to, "--"] + command
    procs = [subprocess.Popen(command, env=env, stdout=subprocess.DEVNULL,
                              stderr=open(os.path.join(folder, "scheduler.log"), "w"))]
    try:
        address = scheduler_address(scheduler_file)
        pid = procs[0].pid
        if profile_to:
            pid = next(p.pid for p in psutil.Process(pid).children(recursive=True) if "dask_scheduler" in
                       " ".join(p.cmdline()))
        for i in range(n_workers):
            procs.append(subprocess.Popen(
                [sys.executable, "-m", "distributed.cli.dask_worker", address, "--worker-class", "dmdask.Worker",
                 "--nthreads", "1", "--no-nanny", "--local-directory", folder],
                env=env, stdout=subprocess.DEVNULL, stderr=open(os.path.join(folder, f"worker-{i}.log"), "w")))
        yield address, pid
    finally:
        for p in reversed(procs):
            p.send_signal(2) if profile_to and p is procs[0] else p.terminate()  # py-spy writes on SIGINT
        for p in procs:
            try:
                p.wait(60)
            except subprocess.TimeoutExpired:
                p.kill()


def _trivial(i: int) -> int:
    return i


def dask_floor(tasks: int, root: str, chunk: int = 4096) -> dict:
    """What Dask alone costs the scheduler per task, for tasks like dmdask's block loads: a
    trivial task per block, keys like block keys, each pinned to one of two workers (strict
    restrictions), submitted in graphs of `chunk`, all held in memory (the futures kept).
    The scheduler's RSS growth and CPU-seconds per task once every task is in memory."""
    import distributed
    import psutil

    folder = tempfile.mkdtemp(prefix="dmdask-bench-dask-floor-", dir=root)
    load = os.getloadavg()[0]
    with logged_cluster(folder) as (address, pid), distributed.Client(address) as client:
        client.wait_for_workers(2, timeout=60)
        workers = sorted(client.scheduler_info()["workers"])
        scheduler = psutil.Process(pid)
        time.sleep(1)
        rss0, cpu0 = scheduler.memory_info().rss, sum(scheduler.cpu_times()[:2])
        started = time.time()
        futures = []
        for start in range(0, tasks, chunk):
            for w, worker in enumerate(workers):
                part = [i for i in range(start, min(tasks, start + chunk)) if i % len(workers) == w]
                futures += client.map(_trivial, part, key=[f"dmdask-block-{'0' * 32}-{i}" for i in part],
                                      workers=[worker], allow_other_workers=False, pure=False)
        distributed.wait(futures)
        done = time.time() - started
        rss1, cpu1 = scheduler.memory_info().rss, sum(scheduler.cpu_times()[:2])
        stalls = _stalls(folder, started)
    shutil.rmtree(folder, ignore_errors=True)
    return {"tasks": tasks, "load_1min": load, "all_in_memory_s": done,
            "scheduler_rss_kib_per_task": (rss1 - rss0) / 1024 / tasks,
            "scheduler_cpu_us_per_task": (cpu1 - cpu0) * 1e6 / tasks,
            "scheduler_stalls": stalls.get("scheduler", {}).get("count", 0), "load_1min_after": os.getloadavg()[0]}


def _submitted_on(dask_scheduler) -> int:
    """The block loads dmdask's plugin took in, over every dataset."""
    return sum(ds.submitted for ds in dask_scheduler.extensions["dmdask"].datasets.values())


def _datasets(client) -> list:
    from dmdask.protocol.scheduler import Datasets, SchedulerAPI

    return client.sync(SchedulerAPI(client).send, Datasets())


def _loaded(client, name: str) -> tuple[int, int] | None:
    """(loaded, blocks) of dataset `name` in the registry, or None while it has none."""
    for d in _datasets(client):
        if d.name == name:
            return d.loaded, d.blocks
    return None


def rank(address: str, path: str, rank_: int, world: int, batch: int, wait_for_claim: bool) -> dict:
    """One rank: `batches` then `next()`; absolute times (time.time()), the blocks loaded
    when its first batch came, its first batch's ids; an error instead of the times after it."""
    import distributed
    import numpy as np

    import dmdask
    from dmdask.source import dataset_name

    with distributed.Client(address) as client:
        spec = dmdask.Spec(path, batch_size=batch, rank=rank_, world_size=world, seed=1)
        name = dataset_name(spec)
        if wait_for_claim:  # rank 0 holds the claim: this rank waits for it, as a rank of a job does
            while True:
                with contextlib.suppress(Exception):
                    if _loaded(client, name) is not None:
                        break
                time.sleep(0.05)
        out = {"rank": rank_, "called": time.time(), "error": None}
        try:
            it = dmdask.batches(client, spec, epoch=0, progress=False)
            out["registered"] = time.time()
            first = next(it)
            out["first"] = time.time()
            out["loaded_at_first"] = (_loaded(client, name) or (0, 0))[0]
            out["ids"] = np.asarray(first["index"]).tolist()
            out["batch_ok"] = bool(np.all(first["x"] == 0))
            it.close()
        except Exception as exc:  # noqa: BLE001 - reported: the default deadline passed
            out["error"] = f"{type(exc).__name__}: {str(exc)[:300]}"
            out["failed"] = time.time()
        return out


def _stalls(folder: str, started: float) -> dict:
    """Per process: the event-loop stalls its log reports, the longest, and when each
    ended (seconds after `started`, a time.time())."""
    import datetime

    counts = {}
    for name in sorted(os.listdir(folder)):
        if name.endswith(".log"):
            with open(os.path.join(folder, name), errors="replace") as f:
                lines = [line for line in f if STALL in line]
            seconds = [float(line.split(" for ")[1].split("s.")[0]) for line in lines if " for " in line]
            ended = []
            for line in lines:
                with contextlib.suppress(ValueError):
                    when = datetime.datetime.strptime(line[:23], "%Y-%m-%d %H:%M:%S,%f").timestamp()
                    ended.append(round(when - started, 1))
            counts[name[:-4]] = {"count": len(lines), "longest_s": max(seconds, default=0.0), "seconds": seconds,
                                 "ended_at_s": ended}
    return counts


def _tracemalloc_start(dask_scheduler):
    import tracemalloc

    tracemalloc.start(1)


def _tracemalloc_top(dask_scheduler, top: int = 25):
    import tracemalloc

    snapshot = tracemalloc.take_snapshot()
    tracemalloc.stop()
    stats = snapshot.statistics("lineno")
    total = sum(s.size for s in stats)
    return {"total": total, "top": [{"where": f"{_short_path(s.traceback[0].filename)}:{s.traceback[0].lineno}",
                                     "bytes": s.size, "count": s.count} for s in stats[:top]]}


def _other_rank(address: str, path: str, cfg: dict) -> subprocess.Popen:
    return subprocess.Popen([sys.executable, "-m", "benchmarks.first_contact", address, path, str(cfg["other"]),
                             str(cfg["world"]), str(cfg["batch"])], stdout=subprocess.PIPE, text=True,
                            cwd=os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


def one_size(blocks: int, cfg: dict, root: str, profile: bool = False) -> dict:
    """One cold dataset of `blocks` blocks on a fresh cluster."""
    import distributed
    import psutil

    from dmdask.client.datasets import ensure_plugin, open_dataset

    path = write_fill_array(os.path.join(root, f"b{blocks}.zarr"), blocks * 10, chunk=10)
    folder = tempfile.mkdtemp(prefix="dmdask-bench-first-contact-", dir=root)
    profile_to = os.path.join(folder, "profile.txt") if profile else None
    load = os.getloadavg()[0]
    with logged_cluster(folder, profile_to=profile_to) as (address, pid), distributed.Client(address) as client:
        client.wait_for_workers(2, timeout=60)
        scheduler = psutil.Process(pid)
        ensure_plugin(client)  # its fixed cost (dmdask imported on the scheduler) is not counted per block
        if profile:
            client.run_on_scheduler(_tracemalloc_start)
        rss0, cpu0 = scheduler.memory_info().rss, sum(scheduler.cpu_times()[:2])
        other = _other_rank(address, path, cfg)
        box: dict = {"rank": 0, "called": time.time(), "error": "its process failed (see the log)"}
        zero = threading.Thread(target=lambda: box.update(rank(address, path, 0, cfg["world"], cfg["batch"], False)))
        started = time.time()
        zero.start()
        from dmdask.source import dataset_name
        import dmdask

        name = dataset_name(dmdask.Spec(path, batch_size=cfg["batch"]))
        every, limit = None, cfg.get("limit_s", LOAD_TIMEOUT)
        while time.time() - started < limit:
            found = None
            with contextlib.suppress(Exception):  # before rank 0 registered dmdask's plugin
                found = _loaded(client, name)
            if found is not None and found[1] == blocks and found[0] == blocks:
                every = time.time() - started
                break
            time.sleep(0.5)
        rss1, cpu1 = scheduler.memory_info().rss, sum(scheduler.cpu_times()[:2])
        loaded = (found or (0, 0))[0] if every is None else blocks  # stopped at `limit_s`: those loaded by then
        submitted = client.run_on_scheduler(_submitted_on) if every is None else blocks
        opened = time.perf_counter()
        for _ in range(cfg["opens"]):  # a rank's open of the dataset once ready (`GetOrClaim`)
            open_dataset(client, dmdask.Spec(path, batch_size=cfg["batch"]), 0)
        opens = {"count": cfg["opens"], "seconds_each": (time.perf_counter() - opened) / max(1, cfg["opens"]),
                 "scheduler_cpu_ms_each": (sum(scheduler.cpu_times()[:2]) - cpu1) * 1e3 / max(1, cfg["opens"])}
        memory = client.run_on_scheduler(_tracemalloc_top) if profile else None
        zero.join()
        theirs = json.loads(other.communicate(timeout=LOAD_TIMEOUT)[0].strip().splitlines()[-1])
    ranks = []
    for r in (box, theirs):
        ranks.append({"rank": r["rank"], "registered_s": r.get("registered", float("nan")) - started,
                      "first_batch_s": r.get("first", float("nan")) - started,
                      "after_own_call_s": r.get("first", r.get("failed", float("nan"))) - r["called"],
                      "loaded_at_first": r.get("loaded_at_first"), "batch_ok": r.get("batch_ok", False),
                      "error": r.get("error")})
    per = max(1, submitted)  # per block the scheduler has a task of
    row = {"blocks": blocks, "load_1min": load, "ranks": ranks, "every_block_loaded_s": every,
           "stopped_at_s": None if every is not None else limit, "loaded_then": loaded, "submitted_then": submitted,
           "scheduler_rss_kib_per_block": (rss1 - rss0) / 1024 / per,
           "scheduler_cpu_s": cpu1 - cpu0, "scheduler_cpu_us_per_block": (cpu1 - cpu0) * 1e6 / per,
           "stalls": _stalls(folder, started), "opens": opens, "load_1min_after": os.getloadavg()[0]}
    if profile:
        row["memory"] = memory
        row["cpu_profile"] = summarize_profile(profile_to)
    shutil.rmtree(folder, ignore_errors=True)
    return row


def summarize_profile(path: str, top: int = 25) -> dict:
    """py-spy's raw output (one line per stack: frames leaf last, `;`-separated, then a
    count): samples per function, self (the leaf) and inclusive, idle stacks left out."""
    own, inclusive, total = collections.Counter(), collections.Counter(), 0
    if not os.path.exists(path):
        return {"error": f"no profile written at {path}"}
    with open(path) as f:
        for line in f:
            stack, _, count = line.rstrip("\n").rpartition(" ")
            if not stack or not count.isdigit():
                continue
            frames = [_short(frame) for frame in stack.split(";")]
            if any(w in frames[-1] for w in ("select", "poll (", "_run_once (asyncio")) and len(frames) < 12:
                continue  # the loop waiting for work
            n = int(count)
            total += n
            own[frames[-1]] += n
            for frame in set(frames):
                inclusive[frame] += n
    return {"busy_samples": total, "self": own.most_common(top),
            "inclusive": [(f, n) for f, n in inclusive.most_common(top * 3)
                          if ("dmdask" in f or "distributed" in f)][:top]}


def _short(frame: str) -> str:
    """`fn (path/to/site-packages/pkg/mod.py:12)` as `fn (pkg/mod.py)`."""
    name, _, where = frame.partition(" (")
    return f"{name} ({_short_path(where.rstrip(')').rsplit(':', 1)[0])})"


def _code(where: str) -> str:
    """The source line `package/module.py:line` names, as installed here (the run's versions)."""
    import importlib.util
    import linecache

    path, _, line = where.rpartition(":")
    package, _, rest = path.partition("/")
    spec = importlib.util.find_spec(package) if package and rest else None
    if spec is None or not spec.submodule_search_locations:
        return "?"
    text = linecache.getline(os.path.join(list(spec.submodule_search_locations)[0], rest), int(line)).strip()
    return text.replace("`", "'") or "?"


def _short_path(path: str) -> str:
    """A module's path from its package on (`distributed/scheduler.py`, `dmdask/internals.py`)."""
    for marker in ("site-packages/", "/dmdask/", "/benchmarks/"):
        if marker in path:
            return (marker.strip("/") + "/" if marker != "site-packages/" else "") + path.split(marker, 1)[1]
    return path


def run(preset: str) -> dict:
    cfg = PRESETS[preset]
    rows = []
    with tempfile.TemporaryDirectory(prefix="dmdask-bench-first-contact-data-") as root:
        for blocks in cfg["blocks"]:
            rows.append(one_size(blocks, cfg, root))
            print(f"[first_contact] {blocks} blocks: {json.dumps(rows[-1], default=float)}", flush=True)
        profiled = one_size(cfg["profile"], cfg, root, profile=True) if cfg["profile"] else None
        floor = dask_floor(cfg["floor"], root) if cfg.get("floor") else None
        if floor:
            print(f"[first_contact] Dask alone: {json.dumps(floor, default=float)}", flush=True)
        opened = crowd(*cfg["crowd"], root) if cfg.get("crowd") else None  # (blocks, processes, threads)
        if opened:
            print(f"[first_contact] crowd: {json.dumps(opened, default=float)}", flush=True)
    return {"config": cfg, "rows": rows, "profiled": profiled, "dask_floor": floor, "crowd": opened,
            "goals": goals(cfg, rows, opened)}


def goals(cfg: dict, rows: list, opened: dict | None = None) -> list:
    """Issue 41's goals, judged on the rows measured (the profiled run left out: it is slowed)."""
    out = [{"goal": f"a cold first batch of a rank of {cfg['world']:,} within {GOAL_FIRST_BATCH_S:.0f} s "
                      f"at {r['blocks']:,} blocks (every rank measured)",
              "met": all(x["error"] is None and x["first_batch_s"] <= GOAL_FIRST_BATCH_S for x in r["ranks"]),
              "measured": ", ".join(f"rank {x['rank']}: " + (f"{x['first_batch_s']:.1f} s" if x["error"] is None
                                                             else f"failed after {x['after_own_call_s']:.0f} s")
                                    for x in r["ranks"]) + f" (load {r['load_1min']:.1f})"} for r in rows]
    if rows:  # not in the crowd preset
        big = rows[-1]
        out.append({"goal": f"<= {GOAL_KIB_PER_BLOCK:g} KiB and <= {GOAL_US_PER_BLOCK:g} us of scheduler CPU per block, "
                              "no event-loop stall over 1 s",
                      "met": big["scheduler_rss_kib_per_block"] <= GOAL_KIB_PER_BLOCK
                      and big["scheduler_cpu_us_per_block"] <= GOAL_US_PER_BLOCK
                      and max(_loading_stalls(big), default=0.0) <= 1.0,
                      "measured": f"{big['blocks']:,} blocks: {big['scheduler_rss_kib_per_block']:.1f} KiB, "
                                  f"{big['scheduler_cpu_us_per_block']:.0f} us, "
                                  f"{len(_loading_stalls(big))} stalls until every block was loaded, the longest "
                                  f"{max(_loading_stalls(big), default=0.0):.1f} s (load {big['load_1min']:.1f})"})
        if 10**6 not in [r["blocks"] for r in rows]:
            out.append({"goal": f"a cold first batch of a rank of {cfg['world']:,} within {GOAL_FIRST_BATCH_S:.0f} s, "
                                "and the scheduler's cost per block, at 1,000,000 blocks", "met": False,
                        "measured": "not measured in this run (`--full` measures it; quick stops at "
                                    f"{rows[-1]['blocks']:,} blocks: 10^6 would take ~15 min to load on 2 cores)"})
    if opened is None:
        out.append({"goal": "128 client processes opening a 10^5-block dataset at once: every first batch within "
                            f"{GOAL_CROWD_S:.0f} s", "met": False, "measured": "not measured in this run"})
    else:
        worst = opened["first_batch_s"]["max"]
        out.append({"goal": f"{opened['processes']} client processes x {opened['threads']} threads opening a "
                            f"{opened['blocks']:,}-block dataset at once: every first batch within {GOAL_CROWD_S:.0f} s",
                    "met": not opened["n_failed"] and worst is not None and worst <= GOAL_CROWD_S,
                    "measured": f"{opened['ranks'] - opened['n_failed']} of {opened['ranks']} first batches, "
                                f"after {opened['first_batch_s']['min']:.1f}-{worst:.1f} s (median "
                                f"{opened['first_batch_s']['median']:.1f} s), {opened['stalls'].get('count', 0)} "
                                f"scheduler stalls (load {opened['load_at_go']:.1f})" if worst is not None else
                                f"every rank failed: {opened['failed'][:1]}"})
    return out


def _before(preset: str) -> dict | None:
    """The same scenario measured over dmdask before issue 41's changes, if recorded."""
    import glob

    found = sorted(glob.glob(os.path.join(os.path.dirname(os.path.abspath(__file__)), "results",
                                          f"first_contact-before-*-{preset}.json")))
    if not found:
        return None
    with open(found[-1]) as f:
        return json.load(f)


def _loading_stalls(row: dict) -> list:
    """The scheduler's stalls that ended by the time every block was loaded (not those of
    the cluster's shutdown); all of them when their end was not recorded."""
    found = row["stalls"].get("scheduler", {})
    seconds, ended = found.get("seconds"), found.get("ended_at_s")
    if seconds is None or ended is None or len(ended) != len(seconds):
        return [found.get("longest_s", 0.0)] * found.get("count", 0)
    end = (row["every_block_loaded_s"] or float("inf")) + 1
    return [s for s, e in zip(seconds, ended) if e <= end]


def _stall_text(row: dict, process: str = "scheduler") -> str:
    found = row["stalls"].get(process, {})
    if "ended_at_s" not in found:
        return f"{found.get('count', 0)} (longest {found.get('longest_s', 0):.1f} s)"
    return f"{found['count']}" + (" (" + ", ".join(f"{s:.1f} s, {e:.0f} s" for s, e in
                                                  zip(found["seconds"], found["ended_at_s"])) + ")"
                                  if found["count"] else "")


NOTES = os.path.join(os.path.dirname(os.path.abspath(__file__)), "first_contact_notes.md")


def _hand_notes() -> list:
    """The hand-written findings of issue 41 (`first_contact_notes.md`: runs of other presets,
    side-by-side comparisons), kept in the section whenever the page is regenerated."""
    if not os.path.exists(NOTES):
        return []
    with open(NOTES) as f:
        return ["", f.read().strip()]


def report(result: dict, plots_dir: str) -> str:
    cfg = result["config"]
    before = _before(result.get("preset", "quick"))
    lines = [f"Rank 0 of {cfg['world']:,} (creates the blocks) and rank {cfg['other']} (a second process), batch "
             f"{cfg['batch']}, one-byte samples in chunks of 10 never written; a fresh stock scheduler and two "
             "workers per size; times from rank 0's `batches` call; CPU-seconds are the scheduler's own (start to "
             "every block loaded), less disturbed by the machine's load than times. Since issue 41 a load still "
             "queued on its worker when a rank asks for its rows runs next (`dmdask.internals.run_next`), and the "
             "claimant submits the loads in chunks of 4,096, the dataset ready once the first is in, the blocks ranks "
             "ask for meanwhile next (`dmdask.client.submit`).", "",
             "| blocks | load | rank 0 registered | rank 0 first batch | other rank first batch (blocks loaded then) "
             "| every block loaded | scheduler RSS / block | scheduler CPU (per block) | scheduler stalls (long, ended at) "
             "| each worker's stalls | scheduler CPU per later open |",
             "|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|"]

    def first(x):
        return f"failed after {x['after_own_call_s']:.0f} s" if x["error"] else f"{x['first_batch_s']:.1f} s"

    rows = [(r, "") for r in result["rows"] + ([result["profiled"]] if result.get("profiled") else [])]
    rows += [(r, f" before ({before['commit']})") for r in (before or {}).get("rows", [])]
    for r, label in rows:
        zero, other = r["ranks"]
        stalls = _stall_text(r)
        workers = "; ".join(_stall_text(r, w) for w in sorted(r["stalls"]) if w.startswith("worker"))
        every = (f"{r['every_block_loaded_s']:.0f} s" if r["every_block_loaded_s"] else
                 f"stopped at {r['stopped_at_s']:.0f} s ({r['loaded_then']:,} loaded, {r['submitted_then']:,} submitted; "
                 "per block: per block submitted)" if r.get("stopped_at_s") else "not within the timeout")
        opens = f"{r['opens']['scheduler_cpu_ms_each']:.1f} ms" if "opens" in r else "not measured"
        lines.append(f"| {r['blocks']:,}{' (profiled)' if 'cpu_profile' in r else ''}{label} | {r['load_1min']:.1f} "
                     f"| {zero['registered_s']:.1f} s | {first(zero)} | {first(other)} ({other['loaded_at_first']}) "
                     f"| {every} | {r['scheduler_rss_kib_per_block']:.1f} KiB | {r['scheduler_cpu_s']:.0f} s "
                     f"({r['scheduler_cpu_us_per_block']:.0f} us) | {stalls} | {workers} "
                     f"| {opens} |")
    profiled = result.get("profiled")
    floor = result.get("dask_floor")
    if floor:
        lines += ["", f"Dask alone, for comparison (`first_contact.dask_floor`, load {floor['load_1min']:.1f}): "
                      f"{floor['tasks']:,} trivial tasks keyed like blocks, each pinned to one of the two workers, "
                      "submitted in graphs of 4,096 and held in memory: "
                      f"{floor['scheduler_rss_kib_per_task']:.1f} KiB of scheduler RSS and "
                      f"{floor['scheduler_cpu_us_per_task']:.0f} us of scheduler CPU per task, all in memory after "
                      f"{floor['all_in_memory_s']:.0f} s, {floor['scheduler_stalls']} scheduler stalls."]
    if before:
        lines += ["", f"Rows marked before: `{before['command']}`, {before['date']}."]
    lines += _hand_notes()
    if before:
        lines += [x for note in before.get("notes", []) for x in ("", note)]
    if result.get("profiled"):
        lines += ["", "The profiled row runs the scheduler under py-spy and tracemalloc (every allocation traced): "
                      "its times and CPU are inflated and are not compared with the others; a rank whose client "
                      "lost the scheduler meanwhile (a stall past `dmdask.client.scheduler-seconds`) is reported "
                      "as failed. CPU per later open: psutil counts the scheduler's CPU in 10 ms steps."]
    if profiled and "cpu_profile" in profiled:
        prof = profiled["cpu_profile"]
        lines += ["", f"Where the scheduler's busy CPU went at {profiled['blocks']:,} blocks (py-spy, "
                      f"{prof.get('busy_samples', 0)} busy samples; inclusive, dmdask and distributed functions):", ""]
        lines += [f"- {n / max(1, prof['busy_samples']):.0%} {f}" for f, n in prof.get("inclusive", [])[:15]]
        lines += ["", "The same samples by the function running (self):", ""]
        lines += [f"- {n / max(1, prof['busy_samples']):.0%} {f}" for f, n in prof.get("self", [])[:12]]
        mem = profiled["memory"]
        lines += ["", f"Scheduler memory still allocated once every block was loaded (tracemalloc, "
                      f"{mem['total'] / 2**20:.0f} MiB in all, {mem['total'] / profiled['blocks']:.0f} B per block), "
                      "by line:", ""]
        lines += [f"- {m['bytes'] / profiled['blocks']:.0f} B/block ({m['count'] / profiled['blocks']:.1f} objects) "
                  f"{m['where']}: `{_code(m['where'])}`" for m in mem["top"][:15]]
    return "\n".join(lines) + "\n"


GOAL_CROWD_S = 15.0


def _error_kinds(results: list) -> list:
    """Every failed rank's error, counted by its text with the numbers left out (rank,
    batches, seconds, tries), most frequent first: (count, text of the first of its kind)."""
    import re

    kinds: dict[str, list] = {}
    for r in results:
        if r["error"]:
            kinds.setdefault(re.sub(r"\d+(\.\d+)?", "N", r["error"]), []).append(r["error"])
    return sorted(((len(v), v[0]) for v in kinds.values()), reverse=True)


def crowd_process(address: str, path: str, ranks: list[int], world: int, batch: int, folder: str) -> list:
    """Ranks `ranks` of one process, a thread each: each connects, says so (a file in
    `folder`), waits for the file `go`, then opens the dataset and takes its first batch."""
    import distributed

    clients = [distributed.Client(address, set_as_default=False) for _ in ranks]
    with open(os.path.join(folder, f"connected-{ranks[0]}"), "w"):
        pass
    go = os.path.join(folder, "go")
    while not os.path.exists(go):
        time.sleep(0.01)
    out: list = [None] * len(ranks)

    def one(i):
        import dmdask

        c = {"rank": ranks[i], "called": time.time(), "error": None}
        try:
            it = dmdask.batches(clients[i], dmdask.Spec(path, batch_size=batch, rank=ranks[i], world_size=world, seed=1),
                                epoch=0, progress=False)
            batch_ = next(it)
            c["first"], c["ids"] = time.time(), len(batch_["index"])
            it.close()
        except Exception as exc:  # noqa: BLE001 - reported
            c["error"], c["failed"] = f"{type(exc).__name__}: {str(exc)[:600]}", time.time()
        out[i] = c

    threads = [threading.Thread(target=one, args=(i,)) for i in range(len(ranks))]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    for c in clients:
        c.close()
    return out


def crowd(blocks: int, processes: int, threads: int, root: str, world: int = 1024, batch: int = 64,
          wait_s: float = 300.0) -> dict:
    """`processes` x `threads` ranks of one world of `world` (spread over it) open a cold
    dataset of `blocks` blocks at once (every client connected first, then one signal):
    each rank's first batch, from the signal."""
    path = write_fill_array(os.path.join(root, f"crowd{blocks}.zarr"), blocks * 10, chunk=10)
    folder = tempfile.mkdtemp(prefix="dmdask-bench-crowd-", dir=root)
    n = processes * threads
    ranks = [i * (world // n) for i in range(n)]
    load = os.getloadavg()[0]
    with logged_cluster(folder) as (address, pid):
        import psutil

        procs = [subprocess.Popen([sys.executable, "-m", "benchmarks.first_contact", "crowd", address, path,
                                   ",".join(map(str, ranks[p * threads:(p + 1) * threads])), str(world), str(batch),
                                   folder], stdout=subprocess.PIPE, text=True,
                                  cwd=os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
                 for p in range(processes)]
        deadline = time.time() + 600
        while len([f for f in os.listdir(folder) if f.startswith("connected-")]) < processes and time.time() < deadline:
            time.sleep(0.2)
        scheduler = psutil.Process(pid)
        cpu0 = sum(scheduler.cpu_times()[:2])
        load_at_go = os.getloadavg()[0]
        go = time.time()
        with open(os.path.join(folder, "go"), "w"):
            pass
        results, hung = [], []
        for i, p in enumerate(procs):
            try:  # a process still waiting past `wait_s` is reported (py-spy dump of it), its ranks failed
                out = p.communicate(timeout=max(1.0, go + wait_s - time.time()))[0]
                results += json.loads(out.strip().splitlines()[-1])
            except (subprocess.TimeoutExpired, IndexError, ValueError):
                spy = shutil.which("py-spy") or os.path.join(os.path.dirname(sys.executable), "py-spy")
                dump = subprocess.run([spy, "dump", "--pid", str(p.pid)], capture_output=True, text=True, check=False).stdout
                hung.append({"ranks": ranks[i * threads:(i + 1) * threads], "dump": dump[-6000:]})
                p.kill()
                p.communicate()
                results += [{"rank": r, "error": f"its process did not answer within {wait_s:.0f} s", "failed": 0.0}
                            for r in ranks[i * threads:(i + 1) * threads]]
        cpu = sum(scheduler.cpu_times()[:2]) - cpu0
        stalls = _stalls(folder, go)
    shutil.rmtree(folder, ignore_errors=True)
    firsts = sorted(r["first"] - go for r in results if r["error"] is None)
    return {"blocks": blocks, "processes": processes, "threads": threads, "load_1min": load, "load_at_go": load_at_go,
            "ranks": n, "failed": [r for r in results if r["error"]][:3], "n_failed": sum(bool(r["error"]) for r in results),
            "errors": _error_kinds(results),
            "first_batch_s": {"min": firsts[0] if firsts else None, "median": firsts[len(firsts) // 2] if firsts else None,
                              "max": firsts[-1] if firsts else None},
            "scheduler_cpu_s": cpu, "stalls": stalls.get("scheduler", {}), "hung": hung,
            "load_1min_after": os.getloadavg()[0]}


if __name__ == "__main__":
    if sys.argv[1] == "crowd":
        address, path, ranks_, world, batch, folder = sys.argv[2:8]
        print(json.dumps(crowd_process(address, path, [int(r) for r in ranks_.split(",")], int(world), int(batch),
                                       folder)))
    else:
        address, path, rank_, world, batch = sys.argv[1:6]
        print(json.dumps(rank(address, path, int(rank_), int(world), int(batch), True)))
