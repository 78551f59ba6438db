"""Scenario 12: the peer path against the link (issue 36).

Every row a rank reads from another node's worker crosses TCP. This scenario measures,
between the same two loopback addresses (127.0.0.1 the reader, 127.0.0.2 the holder; no
other address is used):

- raw TCP, the link: Python `sendall` of 4 MiB buffers from a process bound on 127.0.0.2
  into `recv_into` one preallocated buffer in the reader process on 127.0.0.1;
- Dask's `client.gather(direct=True)` of 32 futures of 8 MiB held by the worker;
- dmdask remote warm epochs: a `dask scheduler` and one `dask worker --worker-class
  dmdask.Worker` bound on 127.0.0.2, holding every dataset (Zarr v3, uncompressed) in its
  RAM tier; a reader process on 127.0.0.1 with `dmdask.client.host` = "127.0.0.1", so that
  nothing is mapped: every row crosses TCP, which each epoch checks by the worker's
  `peer.bytes_out` (`dmdask.stats`) rising by at least the bytes the epoch read;
- dmdask same-host warm epochs: a second reader process whose `dmdask.client.host` is the
  worker's, which maps the worker's arenas.

Configurations run in interleaved repetitions (one untimed warm-up round first), so that a
noisy neighbour slows them alike; a repetition lasts at least the preset's `min_seconds`
(whole epochs, transfers or gathers back to back, counted together); each figure is the
median of its repetitions, and the ratio to raw TCP pairs each repetition with the link's
of the same round. CPU is `psutil` user + system time of each process and its live
descendants, minor page faults those of /proc/PID/stat, taken before and after each
measurement: the reader's inside the reader, the worker's, the scheduler's and the TCP
sender's by pid (the sender reports its own), and the kernel's softirq threads'
(`ksoftirqd/N`): on loopback a packet's receive work runs in softirq context, charged to
whichever process the CPU was running, unless the kernel defers it to those threads, which
it does more the busier the machine is (the link's CPU per GB fell from 0.31 to 0.17 between
a quiet run and one at load 9 when they were not counted). They are counted in every total,
the link's and dmdask's alike; other work on the machine can add to them.

Runs alone too: `python -m benchmarks.peer_path --quick [--sizes 110KB,1MiB] [--reps N]
[--json FILE]` prints the table and the goals.
"""
from __future__ import annotations

import argparse
import contextlib
import json
import multiprocessing
import os
import socket
import statistics
import subprocess
import sys
import tempfile
import time

import numpy as np

READER_HOST = "127.0.0.1"
HOLDER_HOST = "127.0.0.2"
MiB = 2**20
BLOCK_BYTES = 4 * MiB  # a Zarr chunk (a dmdask block) holds about this many bytes of samples
TCP_BUFFER = 4 * MiB
SPREAD_BYTES = 256 * MiB  # the link over distinct memory: each side cycles through this much, as a loader's batches do
SPREAD_FLAG = 1 << 63  # a request's high bit: send from (receive into) distinct memory
GATHER_FUTURES, GATHER_BYTES = 32, 8 * MiB

# name -> (bytes per sample, batch size)
SIZES = {"3KB": (3072, 256), "110KB": (112640, 64), "1MiB": (MiB, 16), "3KB-64KiB-blocks": (3072, 256)}
# sizes whose blocks are smaller than BLOCK_BYTES: 3 KB rows 21 a block, so that the rows of a
# shuffled request come each from a block of its own, as in a dataset of many blocks (no goal)
SMALL_BLOCKS = {"3KB-64KiB-blocks": 64 << 10}
PRESETS = {
    "tiny": {"dataset_bytes": 4 * MiB, "tcp_bytes": 64 * MiB, "reps": 2, "gather": 2, "min_seconds": 0},
    # 512 MiB a size, as issue 36 measured: at 256 MiB a warm epoch lasted 0.1 s, and its start
    # (the open's round trip, batch 0 asked alone) was 15-25% of a per-byte figure
    "quick": {"dataset_bytes": 512 * MiB, "tcp_bytes": 1024 * MiB, "reps": 3, "gather": GATHER_FUTURES,
              "min_seconds": 1.0},
    "full": {"dataset_bytes": 512 * MiB, "tcp_bytes": 2048 * MiB, "reps": 5, "gather": GATHER_FUTURES,
             "min_seconds": 2.0},
}
# goals of issue 36: remote / raw TCP at each size (shuffled), and CPU per GB against raw TCP's
RATIO_GOALS = {"3KB": 0.5, "110KB": 0.8, "1MiB": 0.8}
MOONSHOT = {"3KB": 0.8}
CPU_GOAL = 1.5


def run(preset: str, sizes=None, reps: int | None = None) -> dict:
    """Measure every configuration of `preset` ("tiny", "quick", "full"); `sizes`: a subset
    of SIZES' names (default all), `reps`: repetitions (default the preset's)."""
    cfg = dict(PRESETS[preset])
    cfg["reps"] = reps or cfg["reps"]
    cfg["sizes"] = list(sizes or SIZES)
    unknown = set(cfg["sizes"]) - set(SIZES)
    if unknown:
        raise ValueError(f"unknown sample sizes {sorted(unknown)}; choose from {list(SIZES)}")
    import dataclasses

    import dmdask

    # dmdask's default, as users get it
    cfg["prefetch"] = next(f.default for f in dataclasses.fields(dmdask.Spec) if f.name == "prefetch")
    cfg["samples"] = {name: max(2 * SIZES[name][1], cfg["dataset_bytes"] // SIZES[name][0]) for name in cfg["sizes"]}
    with tempfile.TemporaryDirectory(prefix="dmdask-bench-peer-path-") as root:
        paths = {name: _write_dataset(f"{root}/{name}.zarr", SIZES[name][0], cfg["samples"][name],
                                      SMALL_BLOCKS.get(name, BLOCK_BYTES)) for name in cfg["sizes"]}
        capacity = sum(_dataset_bytes(name, cfg) for name in cfg["sizes"]) + 64 * MiB
        with _holder(root, capacity) as pids, _Bench(*pids) as bench:
            measured = bench.measure(cfg, paths)
    result = {"config": cfg, **measured}
    result["goals"] = goals(result)
    return result


def _dataset_bytes(name: str, cfg) -> int:
    return cfg["samples"][name] * (SIZES[name][0] + 8)  # the samples and their int64 labels


def _write_dataset(path: str, sample_bytes: int, n: int, block_bytes: int = BLOCK_BYTES) -> str:
    """A Zarr v3 group, uncompressed: "x" (n samples of `sample_bytes` random bytes) and
    "label" (int64, the sample's id), in chunks of about `block_bytes`."""
    import zarr

    chunk = max(1, block_bytes // sample_bytes)
    group = zarr.open_group(path, mode="w", zarr_format=3)
    x = group.create_array("x", shape=(n, sample_bytes), chunks=(chunk, sample_bytes), dtype="uint8",
                           compressors=None)
    group.create_array("label", shape=(n,), chunks=(chunk,), dtype="int64", compressors=None)[:] = np.arange(n)
    rng = np.random.default_rng(0)
    step = chunk * max(1, (64 * MiB) // (chunk * sample_bytes))
    for start in range(0, n, step):
        stop = min(n, start + step)
        x[start:stop] = rng.integers(0, 256, size=(stop - start, sample_bytes), dtype=np.uint8)
    return path


@contextlib.contextmanager
def _holder(root: str, capacity: int):
    """A `dask scheduler` and one dmdask worker (RAM tier `capacity`, no SSD), both bound on
    HOLDER_HOST, no dashboards (their HTTP servers, which Dask starts anyway for /health and
    /metrics, on HOLDER_HOST too); yields (scheduler address, the worker's pid, the scheduler's pid)."""
    import distributed

    from .common import stop_processes

    scheduler_file = os.path.join(root, "scheduler.json")
    env = dict(os.environ, DASK_DISTRIBUTED__SCHEDULER__WORK_STEALING="False")
    logs = {name: open(os.path.join(root, f"{name}.log"), "wb") for name in ("scheduler", "worker")}
    procs = [subprocess.Popen([sys.executable, "-m", "distributed.cli.dask_scheduler", "--host", HOLDER_HOST,
                               "--port", "0", "--no-dashboard", "--dashboard-address", f"{HOLDER_HOST}:0",
                               "--scheduler-file", scheduler_file, "--preload", "dmdask"], env=env,
                              stdout=logs["scheduler"], stderr=subprocess.STDOUT)]
    try:
        deadline = time.monotonic() + 120
        while not os.path.exists(scheduler_file):
            if time.monotonic() > deadline or procs[0].poll() is not None:
                raise RuntimeError(f"the scheduler on {HOLDER_HOST} did not start (exit {procs[0].poll()})")
            time.sleep(0.1)
        time.sleep(0.2)
        with open(scheduler_file) as f:
            address = json.load(f)["address"]
        worker_env = dict(env, DASK_DMDASK__WORKER__RAM=str(capacity), DASK_DMDASK__WORKER__SSD="0")
        procs.append(subprocess.Popen(
            [sys.executable, "-m", "distributed.cli.dask_worker", address, "--worker-class", "dmdask.Worker",
             "--nthreads", "2", "--no-nanny", "--no-dashboard", "--dashboard-address", f"{HOLDER_HOST}:0",
             "--host", HOLDER_HOST, "--name", "holder",
             "--local-directory", root], env=worker_env, stdout=logs["worker"], stderr=subprocess.STDOUT))
        with distributed.Client(address, timeout=60) as client:
            client.wait_for_workers(1, timeout=120)
            (worker_address, info), = client.scheduler_info()["workers"].items()
            if distributed.comm.get_address_host(worker_address) != HOLDER_HOST:
                raise RuntimeError(f"the worker listens on {worker_address}, not on {HOLDER_HOST}")
        yield address, procs[1].pid, procs[0].pid
    except BaseException as exc:  # what the holders said, with the error
        for (name, log), proc in zip(logs.items(), procs):
            log.flush()
            with open(log.name, "rb") as f:
                tail = f.read()[-3000:].decode(errors="replace")
            exc.add_note(f"--- the {name}'s log (its last 3,000 characters; exit status {proc.poll()}):\n{tail}")
        raise
    finally:
        stop_processes(procs)
        for log in logs.values():
            log.close()


class _Bench:
    """The measuring side: a remote reader, a same-host reader, a TCP sender (each a process
    of its own), and this process's client for the worker's counters."""

    def __init__(self, address: str, worker_pid: int, scheduler_pid: int):
        self.address, self.worker_pid, self.scheduler_pid = address, worker_pid, scheduler_pid

    def __enter__(self):
        import distributed
        import psutil

        ctx = multiprocessing.get_context("spawn")
        self.client = distributed.Client(self.address, timeout=60)
        self.worker = psutil.Process(self.worker_pid)
        self.scheduler = psutil.Process(self.scheduler_pid)
        self.processes = []
        self.remote = self._start(ctx, _reader_main, self.address, READER_HOST)
        self.same_host = self._start(ctx, _reader_main, self.address, HOLDER_HOST)
        self.sender = self._start(ctx, _sender_main)
        self.tcp_port = self.sender.recv()
        return self

    def _start(self, ctx, target, *args):
        mine, theirs = ctx.Pipe()
        p = ctx.Process(target=target, args=(theirs, *args), daemon=True)
        p.start()
        self.processes.append(p)
        return mine

    def __exit__(self, *exc):
        for conn in (self.remote, self.same_host, self.sender):
            with contextlib.suppress(Exception):
                conn.send(("stop",))
        for p in self.processes:
            p.join(30)
            if p.is_alive():
                p.terminate()
        self.client.close()

    @staticmethod
    def _call(conn, *command, timeout: float = 900):
        conn.send(command)
        if not conn.poll(timeout):
            raise TimeoutError(f"no answer to {command[0]} within {timeout} s")
        reply = conn.recv()
        if isinstance(reply, dict) and "error" in reply:
            raise RuntimeError(f"{command[0]} failed: {reply['error']}")
        return reply

    def _bytes_out(self) -> int:
        import dmdask

        return dmdask.stats(self.client)["total"]["peer"]["bytes_out"]

    def measure(self, cfg, paths) -> dict:
        configs = [("raw_tcp", None, None), ("gather", None, None), ("raw_tcp_spread", None, None)]
        for name in cfg["sizes"]:
            configs += [("remote", name, True), ("remote", name, False)]
        configs += [("same_host", name, True) for name in cfg["sizes"]]
        self._call(self.remote, "make_futures", cfg["gather"], GATHER_BYTES)
        for name in cfg["sizes"]:  # the cold epoch: the worker loads each dataset into its RAM tier
            self._call(self.remote, "epoch", paths[name], SIZES[name][1], False, 0)
        held = dmdask_ram_bytes(self.client)
        wanted = sum(_dataset_bytes(name, cfg) for name in cfg["sizes"])
        if held < wanted:
            raise RuntimeError(f"the worker holds {held} bytes in RAM after the cold epochs, not the {wanted} of "
                               "the datasets")
        measured = {key: [] for key in configs}
        loads = []
        for rep in range(cfg["reps"] + 1):  # round 0: warm-up, not counted
            for key in configs:
                one = self._one(key, cfg, paths, epoch=rep + 1)
                if rep:
                    measured[key].append(one)
            if rep:
                loads.append(round(os.getloadavg()[0], 2))
        link = _summary("raw TCP", measured[configs[0]])
        gather = _summary("Dask gather(direct=True)", measured[configs[1]], link)
        spread = _summary("raw TCP over distinct memory", measured[configs[2]], link)
        rows = []
        for kind, name, shuffle in configs[3:]:
            reps = measured[(kind, name, shuffle)]
            row = dict(_summary(kind, reps, link), path=kind, size=name, sample_bytes=SIZES[name][0],
                       batch=SIZES[name][1], shuffle=shuffle)
            if kind == "remote":
                row["bytes_out_check"] = bytes_out_check(reps)
            rows.append(row)
        return {"link": link, "gather": gather, "link_spread": spread, "rows": rows, "load_1min": loads,
                "worker_ram_bytes": held, "addresses": self._addresses()}

    def _addresses(self) -> dict:
        """Where each process's TCP sockets are, while all are still open: {"listen": local
        IPs of listening sockets, "connected": local IPs of the others} of the readers, the
        worker, the scheduler and the TCP sender. The holders listen on HOLDER_HOST only; a
        connection that binds no address (a reader's or the worker's to the scheduler) gets
        READER_HOST from the kernel, loopback's source address."""
        import psutil

        def ips(*processes):
            found = {"listen": set(), "connected": set()}
            for process in processes:
                for p in [process] + process.children(recursive=True):
                    with contextlib.suppress(psutil.NoSuchProcess):
                        for c in p.net_connections(kind="inet"):
                            if c.laddr:
                                found["listen" if c.status == psutil.CONN_LISTEN else "connected"].add(c.laddr.ip)
            return {k: sorted(v) for k, v in found.items()}

        readers = [psutil.Process(p.pid) for p in self.processes[:2]]
        out = {"readers": ips(*readers), "worker": ips(self.worker), "scheduler": ips(self.scheduler),
               "tcp_sender": ips(psutil.Process(self.processes[2].pid))}
        used = {ip for v in out.values() for ips_ in v.values() for ip in ips_}
        out["only_the_two_addresses"] = used <= {READER_HOST, HOLDER_HOST}
        out["holders_listen_on_holder_host"] = all(set(out[k]["listen"]) <= {HOLDER_HOST}
                                                   for k in ("worker", "scheduler", "tcp_sender"))
        return out

    def _one(self, key, cfg, paths, epoch: int) -> dict:
        kind, name, shuffle = key
        dmdask_epoch = kind in ("remote", "same_host")
        out = self._bytes_out() if dmdask_epoch else 0
        worker, scheduler, softirq = usage(self.worker), usage(self.scheduler), softirq_cpu()
        if kind in ("raw_tcp", "raw_tcp_spread"):
            got = self._call(self.remote, "tcp", self.tcp_port, cfg["tcp_bytes"], cfg["min_seconds"],
                             kind == "raw_tcp_spread")
            if not self.sender.poll(120):
                raise TimeoutError("the TCP sender did not report its CPU within 120 s of the last byte")
            sent = self.sender.recv()
            got["holder_cpu"], got["holder_faults"] = sent["cpu"], sent["faults"]
        else:
            if kind == "gather":
                got = self._call(self.remote, "gather", cfg["min_seconds"])
            else:
                reader = self.remote if kind == "remote" else self.same_host
                got = self._call(reader, "epoch", paths[name], SIZES[name][1], shuffle, epoch, cfg["min_seconds"])
            spent = since(worker, self.worker)
            got["holder_cpu"], got["holder_faults"] = spent["cpu"], spent["faults"]
        got["scheduler_cpu"] = since(scheduler, self.scheduler)["cpu"]
        got["softirq_cpu"] = softirq_cpu() - softirq
        if dmdask_epoch:
            got["bytes_out"] = self._bytes_out() - out
        return got


def bytes_out_check(reps: list) -> dict:
    """Whether every row of each remote epoch crossed TCP: the worker's `peer.bytes_out` rose
    by at least the bytes the epoch read (a row taken from a mapped arena adds nothing)."""
    return {"bytes_read": [r["bytes"] for r in reps], "bytes_out": [r["bytes_out"] for r in reps],
            "every_row_crossed_tcp": all(r["bytes_out"] >= r["bytes"] for r in reps),
            "exact": all(r["bytes_out"] == r["bytes"] for r in reps)}


def dmdask_ram_bytes(client) -> int:
    import dmdask

    return dmdask.stats(client)["total"]["ram"]["bytes"]


def _summary(label: str, reps: list, link: dict | None = None) -> dict:
    """Medians over the repetitions; CPU-seconds per GB (10^9 bytes) of the reader and of the
    holder (the dmdask worker, or the TCP sender), their total, and of the scheduler apart."""
    def med(f):
        return statistics.median(f(r) for r in reps)

    out = {"label": label, "reps": reps,
           "mb_per_s": med(lambda r: r["bytes"] / r["seconds"] / 1e6),
           "cpu_per_gb": {"reader": med(lambda r: r["cpu"] / (r["bytes"] / 1e9)),
                          "holder": med(lambda r: r["holder_cpu"] / (r["bytes"] / 1e9))}}
    out["cpu_per_gb"]["scheduler"] = med(lambda r: r["scheduler_cpu"] / (r["bytes"] / 1e9))
    out["cpu_per_gb"]["softirq"] = med(lambda r: r.get("softirq_cpu", 0.0) / (r["bytes"] / 1e9))
    out["cpu_per_gb"]["total"] = med(lambda r: (r["cpu"] + r["holder_cpu"] + r.get("softirq_cpu", 0.0))
                                     / (r["bytes"] / 1e9))
    out["faults_per_mb"] = {"reader": med(lambda r: r["faults"] / (r["bytes"] / 1e6)),  # minor page faults
                            "holder": med(lambda r: r["holder_faults"] / (r["bytes"] / 1e6))}
    if reps and "samples" in reps[0]:
        out["samples_per_s"] = med(lambda r: r["samples"] / r["seconds"])
    if link is not None:  # each repetition against the link's in the same round, then the median
        out["ratios"] = [(r["bytes"] / r["seconds"]) / (t["bytes"] / t["seconds"]) for r, t in zip(reps, link["reps"])]
        out["to_raw_tcp"] = statistics.median(out["ratios"])
        out["cpu_to_raw_tcp"] = out["cpu_per_gb"]["total"] / link["cpu_per_gb"]["total"]
    return out


def goals(result: dict) -> list:
    """Issue 36's goals, each met or not, with the load average of the run's repetitions."""
    load = result["load_1min"]
    loaded = f"; load (1 min) {min(load):.1f}-{max(load):.1f}" if load else ""
    out = []
    for row in result["rows"]:
        if row["path"] != "remote" or not row["shuffle"] or row["size"] not in RATIO_GOALS:
            continue
        want = RATIO_GOALS[row["size"]]
        check = "" if row["bytes_out_check"]["every_row_crossed_tcp"] else "; NOT every row crossed TCP"
        out.append({"goal": f"remote >= {want}x raw TCP ({row['size']}, shuffled)",
                    "met": row["to_raw_tcp"] >= want and not check,
                    "measured": f"{row['to_raw_tcp']:.2f}x ({row['mb_per_s']:,.0f} / "
                                f"{result['link']['mb_per_s']:,.0f} MB/s){check}{loaded}"})
        if row["size"] in MOONSHOT:
            out.append({"goal": f"moonshot: remote >= {MOONSHOT[row['size']]}x raw TCP ({row['size']}, shuffled)",
                        "met": row["to_raw_tcp"] >= MOONSHOT[row["size"]] and not check,
                        "measured": f"{row['to_raw_tcp']:.2f}x{loaded}"})
        c = row["cpu_per_gb"]
        link = result["link"]["cpu_per_gb"]
        out.append({"goal": f"remote CPU per GB (reader + worker + softirq threads) <= {CPU_GOAL}x raw TCP's "
                            f"({row['size']}, shuffled)",
                    "met": row["cpu_to_raw_tcp"] <= CPU_GOAL,
                    "measured": f"{row['cpu_to_raw_tcp']:.2f}x ({c['reader']:.2f} + {c['holder']:.2f} + "
                                f"{c['softirq']:.2f} against {link['reader']:.2f} + {link['holder']:.2f} + "
                                f"{link['softirq']:.2f} CPU-s/GB){loaded}"})
    return out


# ---- the processes -------------------------------------------------------------------------------

_SOFTIRQ_THREADS: list[int] = []  # pids of the kernel's ksoftirqd/N threads, found once


def softirq_cpu() -> float:
    """CPU-seconds the kernel's softirq threads (`ksoftirqd/N`) have used: network receive
    work the kernel deferred from the interrupted processes (0.0 where there are none, or
    their times cannot be read)."""
    import psutil

    if not _SOFTIRQ_THREADS:
        _SOFTIRQ_THREADS.extend(p.pid for p in psutil.process_iter(["name"])
                                if (p.info["name"] or "").startswith("ksoftirqd/"))
    total = 0.0
    for pid in _SOFTIRQ_THREADS:
        with contextlib.suppress(psutil.Error, OSError):
            t = psutil.Process(pid).cpu_times()
            total += t.user + t.system
    return total


def usage(process) -> tuple:
    """(user + system CPU-seconds, minor page faults) of a `psutil.Process` and of its live
    descendants."""
    import psutil

    cpu, faults = 0.0, 0
    for p in [process] + process.children(recursive=True):
        try:
            t = p.cpu_times()
            with open(f"/proc/{p.pid}/stat") as f:
                stat = f.read()
        except (psutil.NoSuchProcess, FileNotFoundError, ProcessLookupError):  # ended while we looked
            continue
        cpu += t.user + t.system
        faults += int(stat[stat.rindex(")") + 2:].split()[7])  # minflt: the 10th field of /proc/PID/stat
    return cpu, faults


def since(before: tuple, process=None) -> dict:
    """{"cpu", "faults"} spent by `process` (default: this one) since `usage` gave `before`."""
    import psutil

    cpu, faults = usage(process or psutil.Process())
    return {"cpu": cpu - before[0], "faults": faults - before[1]}


def _me() -> tuple:
    import psutil

    return usage(psutil.Process())


def _reader_main(conn, address: str, host: str) -> None:
    """A reader: its dask config names `host` as its own (dmdask.client.host), so that it maps
    the arenas of workers on `host` only. Answers commands on `conn` until ("stop",)."""
    import logging
    import warnings

    import dask.config
    import distributed

    warnings.filterwarnings("ignore")
    logging.getLogger("distributed").setLevel(logging.ERROR)
    dask.config.set({"dmdask.client.host": host})
    client = distributed.Client(address, timeout=60)
    futures = []
    try:
        while True:
            command, *args = conn.recv()
            if command == "stop":
                return
            try:
                if command == "epoch":
                    conn.send(_epoch(client, *args))
                elif command == "make_futures":
                    futures = _make_futures(client, *args)
                    conn.send(len(futures))
                elif command == "gather":
                    conn.send(_gather(client, futures, *args))
                elif command == "tcp":
                    conn.send(_receive(*args))
                else:
                    conn.send({"error": f"unknown command {command!r}"})
            except Exception as exc:  # noqa: BLE001 - reported to the measuring process
                conn.send({"error": f"{type(exc).__name__}: {exc}"})
    finally:
        client.close()


def _epoch(client, path: str, batch: int, shuffle: bool, epoch: int, min_seconds: float = 0) -> dict:
    """Whole epochs of warm batches back to back, no training step, until `min_seconds` have
    passed (at least one: `epoch`, then epoch * 1000 + 1, + 2, ...): their samples, bytes (every
    field but "index"), seconds, epochs, and this process's CPU-seconds and minor faults."""
    import dmdask

    spec = dmdask.Spec(path, batch_size=batch, shuffle=shuffle, seed=1)
    before, started = _me(), time.perf_counter()
    samples = nbytes = epochs = 0
    while not epochs or time.perf_counter() - started < min_seconds:
        for b in dmdask.batches(client, spec, epoch=epoch * 1000 + epochs if epochs else epoch, progress=False):
            samples += len(b["index"])
            nbytes += sum(v.nbytes for k, v in b.items() if k != "index")
        epochs += 1
    seconds = time.perf_counter() - started
    return {"samples": samples, "bytes": nbytes, "seconds": seconds, "epochs": epochs, **since(before)}


def _make_futures(client, n: int, nbytes: int) -> list:
    """`n` futures of `nbytes` bytes each, held by the worker."""
    import distributed

    (worker,) = client.scheduler_info()["workers"]
    # numpy's own function: nothing of this module (maybe `__main__`) is pickled to the worker
    futures = client.map(np.full, [nbytes] * n, [i % 251 for i in range(n)], dtype=np.uint8, workers=[worker],
                         pure=False)
    distributed.wait(futures, timeout=300)
    return futures


def _gather(client, futures, min_seconds: float = 0) -> dict:
    """`client.gather(futures, direct=True)`, again until `min_seconds` have passed."""
    before, started = _me(), time.perf_counter()
    nbytes = gathers = 0
    while not gathers or time.perf_counter() - started < min_seconds:
        nbytes += sum(a.nbytes for a in client.gather(futures, direct=True))
        gathers += 1
    seconds = time.perf_counter() - started
    return {"bytes": nbytes, "seconds": seconds, "gathers": gathers, **since(before)}


def _receive(port: int, total: int, min_seconds: float = 0, spread: bool = False) -> dict:
    """From READER_HOST, over one connection: ask the sender on HOLDER_HOST:port for `total`
    bytes and `recv_into` one preallocated buffer until they are all in; again until
    `min_seconds` have passed. `spread`: both sides cycle through SPREAD_BYTES of distinct
    memory (4 MiB at a time) instead of one 4 MiB buffer that stays in the CPU's cache."""
    memory = memoryview(np.ones(SPREAD_BYTES if spread else TCP_BUFFER, dtype=np.uint8))  # faulted in first
    at = 0
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind((READER_HOST, 0))
        s.connect((HOLDER_HOST, port))
        before, started = _me(), time.perf_counter()
        got = transfers = 0
        while not transfers or time.perf_counter() - started < min_seconds:
            s.sendall((total | (SPREAD_FLAG if spread else 0)).to_bytes(8, "little"))
            left = total
            while left:
                if at + TCP_BUFFER > len(memory):
                    at = 0
                n = s.recv_into(memory[at:at + TCP_BUFFER], min(left, TCP_BUFFER))
                at += n
                if not n:
                    raise ConnectionError(f"the sender closed with {left} of {total} bytes left")
                left -= n
            got, transfers = got + total, transfers + 1
        seconds = time.perf_counter() - started
        return {"bytes": got, "seconds": seconds, "transfers": transfers, **since(before)}


def _sender_main(conn) -> None:
    """The link's holder side: listens on HOLDER_HOST; each request on a connection asks for
    N bytes and gets them as `sendall` of one 4 MiB buffer, repeated; once the reader closes
    the connection, reports the CPU-seconds and minor page faults it took on `conn`."""
    buffer = np.random.default_rng(0).integers(0, 256, TCP_BUFFER, dtype=np.uint8).tobytes()
    spread = None  # SPREAD_BYTES of distinct memory, made at the first request for it
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as listener:
        listener.bind((HOLDER_HOST, 0))
        listener.listen(1)
        listener.settimeout(1.0)
        conn.send(listener.getsockname()[1])
        while not conn.poll():
            try:
                s, _ = listener.accept()
            except socket.timeout:
                continue
            with s:
                s.settimeout(None)
                before = _me()
                at = 0
                while (request := _exactly(s, 8)) is not None:
                    left = int.from_bytes(request, "little")
                    if left & SPREAD_FLAG and spread is None:
                        spread = memoryview(np.resize(np.frombuffer(buffer, np.uint8), SPREAD_BYTES))
                    source = spread if left & SPREAD_FLAG else memoryview(buffer)
                    left &= SPREAD_FLAG - 1
                    while left:
                        if at + TCP_BUFFER > len(source):
                            at = 0
                        n = min(left, TCP_BUFFER)
                        s.sendall(source[at:at + n])
                        left, at = left - n, at + n
                conn.send(since(before))


def _exactly(s, n: int):
    """`n` bytes from socket `s`, or None if it closed before the first."""
    data = b""
    while len(data) < n:
        more = s.recv(n - len(data))
        if not more:
            if data:
                raise ConnectionError(f"the reader closed after {len(data)} of a request's {n} bytes")
            return None
        data += more
    return data


# ---- the report ----------------------------------------------------------------------------------

def table(result: dict) -> str:
    """The markdown table of every configuration."""
    link = result["link"]
    lines = ["| path | MB/s (median) | samples/s | / raw TCP | CPU-s per GB, reader / holder / softirq threads (scheduler) "
             "| minor faults per MB, reader / holder | every row over TCP |", "|---|---:|---:|---:|---:|---:|:-:|"]

    def line(label, r, ratio=True):
        c = r["cpu_per_gb"]
        check = r.get("bytes_out_check")
        lines.append(f"| {label} | {r['mb_per_s']:,.0f} | "
                     + (f"{r['samples_per_s']:,.0f}" if "samples_per_s" in r else "") + " | "
                     + (f"{r['to_raw_tcp']:.2f}" if ratio else "1.00")
                     + f" | {c['reader']:.2f} / {c['holder']:.2f} / {c.get('softirq', 0.0):.2f} ({c['scheduler']:.2f}) | "
                     + f"{r['faults_per_mb']['reader']:.0f} / {r['faults_per_mb']['holder']:.0f} | "
                     + ("" if check is None else "yes" if check["every_row_crossed_tcp"] else "**no**") + " |")

    line("raw TCP, 1 connection, 4 MiB `sendall` -> `recv_into`", link, ratio=False)
    if "link_spread" in result:
        line(f"raw TCP over distinct memory ({SPREAD_BYTES // MiB} MiB cycled on each side)", result["link_spread"])
    line(f"Dask `client.gather(direct=True)`, {result['config']['gather']} x {GATHER_BYTES // MiB} MiB",
         result["gather"])
    for r in result["rows"]:
        where = "remote" if r["path"] == "remote" else "same host (mapped arenas)"
        line(f"dmdask {where}, {r['size']}, batch {r['batch']}, {'shuffled' if r['shuffle'] else 'not shuffled'}",
             r)
    return "\n".join(lines)


def report(result: dict, plots_dir: str) -> str:
    cfg, load, addresses = result["config"], result["load_1min"], result.get("addresses", {})
    parts = [
        f"A reader process on {READER_HOST} and a holder on {HOLDER_HOST} (loopback), no training step. "
        "The link: one TCP connection, `sendall` of 4 MiB buffers into `recv_into` one preallocated buffer, "
        f"{cfg['tcp_bytes'] // MiB} MiB a repetition. dmdask: a `dask scheduler` and one `dask worker "
        f"--worker-class dmdask.Worker` on {HOLDER_HOST} holding every dataset in its RAM tier (Zarr v3, "
        f"uncompressed, about {cfg['dataset_bytes'] // MiB} MiB a sample size, blocks of about "
        f"{BLOCK_BYTES // MiB} MiB, but those of 3KB-64KiB-blocks: 64 KiB, 21 rows, so that each row of a "
        "shuffled request comes from a block of its own, as in a dataset of many blocks; no goal); the remote reader sets `dmdask.client.host` = \"{READER_HOST}\", so that "
        "nothing is mapped (each epoch checks that the worker's `peer.bytes_out` rose by at least the bytes "
        "it read); the same-host reader's host is the worker's (mapped arenas).",
        f"Every socket of the run was on these two addresses, the holders listening on {HOLDER_HOST} only."
        if addresses.get("only_the_two_addresses") else f"**Sockets on other addresses than these two**: {addresses}.",
        f"Batch sizes as in the table, dmdask's default prefetch ({cfg['prefetch'] or '8 batches, or 16 MiB of small ones, 64 MiB from other hosts'}), no transform. "
        f"{cfg['reps']} interleaved repetitions of every configuration after one warm-up round, each at least "
        f"{cfg['min_seconds']:g} s (whole epochs, transfers or gathers back to back), medians; "
        "/ raw TCP: each repetition's MB/s over the link's in the same round, median; CPU-seconds per GB "
        "(10^9 bytes) of the reader process, of the holder (the worker, or the TCP sender) and of the kernel's "
        "softirq threads (`ksoftirqd/N`: loopback receive work the kernel deferred to them, more the busier the "
        "machine; counted in the link's total and dmdask's alike), psutil user + "
        "system (the link's goal figure reuses one 4 MiB buffer that stays in the CPU's cache on each side; the "
        "line over distinct memory sends from and receives into 256 MiB cycled, as the bytes of a loader's "
        "batches are: what moving memory that is not in the cache costs, and counted in no goal); "
        "the scheduler's apart, counted in no goal; minor page faults per MB (10^6 bytes) of the "
        "same processes (/proc/PID/stat: memory touched for the first time).",
        (f"Load average (1 min) during the repetitions: {min(load):.1f}-{max(load):.1f}; " if load else "")
        + "read the ratios and CPU per GB, not the MB/s.",
    ]
    return " ".join(parts) + "\n\n" + table(result) + "\n"


def _print_goals(result: dict) -> str:
    return "\n".join(f"[{'met' if g['met'] else 'NOT met'}] {g['goal']}: {g['measured']}" for g in result["goals"])


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(prog="python -m benchmarks.peer_path", description=__doc__.split("\n\n")[0])
    size = parser.add_mutually_exclusive_group()
    for preset in PRESETS:
        size.add_argument(f"--{preset}", action="store_const", dest="preset", const=preset)
    parser.add_argument("--sizes", default="", help=f"comma-separated subset of {list(SIZES)}")
    parser.add_argument("--reps", type=int, default=None, help="repetitions of every configuration")
    parser.add_argument("--json", default=None, help="write the result to this file")
    args = parser.parse_args(argv)
    sizes = [s for s in args.sizes.split(",") if s] or None
    if sizes and set(sizes) - set(SIZES):
        parser.error(f"unknown sizes {sorted(set(sizes) - set(SIZES))}; choose from {list(SIZES)}")
    if args.reps is not None and args.reps < 1:
        parser.error("--reps must be >= 1")
    import logging
    import warnings

    warnings.filterwarnings("ignore")
    logging.getLogger("distributed").setLevel(logging.ERROR)
    import datetime

    from .common import machine

    started, context = time.perf_counter(), {
        "machine": machine(), "command": "python -m benchmarks.peer_path " + " ".join(argv or sys.argv[1:]),
        "date": datetime.datetime.now(datetime.timezone.utc).strftime("%Y-%m-%d %H:%M UTC")}
    result = run(args.preset or "quick", sizes=sizes, reps=args.reps)
    result.update(context, seconds=time.perf_counter() - started)
    print(table(result))
    print(_print_goals(result))
    print(f"({result['seconds']:.0f} s)")
    if args.json:
        with open(args.json, "w") as f:
            json.dump(result, f, indent=1, default=float)
    return 0


if __name__ == "__main__":
    sys.exit(main())
