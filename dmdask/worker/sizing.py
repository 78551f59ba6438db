"""A worker's tier sizes when no setting gives them, taken from the job it runs in: the
rules are docs/hpc.md#a-worker-sized-from-its-job. Every size says where it came from
(`Sized.source`). Reads only what it is given (an environment mapping, file paths), so
each source is unit-tested with fakes.
"""
from __future__ import annotations

import os
import re
import shutil
from collections.abc import Mapping
from dataclasses import dataclass

from dask.utils import format_bytes

MIB = 2**20
DEFAULT_RAM = 2**30
JOB_ID_VARIABLES = ("SLURM_JOB_ID", "PBS_JOBID", "LSB_JOBID")
_UNITS = {"": MIB, "K": 2**10, "M": MIB, "G": 2**30, "T": 2**40}  # Slurm counts memory in MiB


@dataclass(frozen=True)
class Sized:
    """A tier capacity in bytes and where it came from, in words."""

    bytes: int
    source: str


def slurm_memory(env: Mapping[str, str]) -> Sized | None:
    """The memory Slurm granted this job on this node; None outside Slurm or with no
    limit (`--mem=0` means the whole node). A value Slurm would not write raises
    ValueError naming the variable."""
    per_node = env.get("SLURM_MEM_PER_NODE")
    if per_node:
        value = _slurm_bytes("SLURM_MEM_PER_NODE", per_node)
        return Sized(value, f"SLURM_MEM_PER_NODE={per_node}") if value else None
    per_cpu = env.get("SLURM_MEM_PER_CPU")
    if per_cpu:
        cpus_text = env.get("SLURM_CPUS_ON_NODE") or (env.get("SLURM_JOB_CPUS_PER_NODE") or "1").split("(")[0]
        try:
            cpus = int(cpus_text.split(",")[0])
        except ValueError:
            raise ValueError(f"SLURM_CPUS_ON_NODE={cpus_text!r} is not a number of CPUs") from None
        value = _slurm_bytes("SLURM_MEM_PER_CPU", per_cpu) * cpus
        return Sized(value, f"SLURM_MEM_PER_CPU={per_cpu} x {cpus} CPUs") if value else None
    return None


def _slurm_bytes(name: str, text: str) -> int:
    match = re.fullmatch(r"\s*(\d+)\s*([KMGT]?)B?\s*", text.upper())
    if not match:
        raise ValueError(f"{name}={text!r} is not a memory size (Slurm writes MiB, e.g. 1500)")
    return int(match.group(1)) * _UNITS[match.group(2)]


NO_LIMIT = 1 << 62  # cgroup v1 writes "no limit" as a huge number (PAGE_COUNTER_MAX pages)


def cgroup_memory(proc_cgroup: str = "/proc/self/cgroup", root: str = "/sys/fs/cgroup") -> Sized | None:
    """The smallest memory limit of this process's cgroup and its ancestors: cgroup v2's
    `memory.max`, else cgroup v1's `memory.limit_in_bytes` (its memory controller's
    hierarchy under `root/memory`); None without a limit ("max", or v1's huge number) or
    when nothing can be read. Never raises."""
    try:
        with open(proc_cgroup) as f:
            lines = f.read().splitlines()
    except OSError:
        return None
    v2 = next((line[3:] for line in lines if line.startswith("0::")), None)
    found = None if v2 is None else _smallest(root, v2, "memory.max")
    v1 = next((parts[2] for parts in (line.split(":", 2) for line in lines)
               if len(parts) == 3 and "memory" in parts[1].split(",")), None)
    if found is None and v1 is not None:
        found = _smallest(os.path.join(root, "memory"), v1, "memory.limit_in_bytes")
    return None if found is None else Sized(found[0], f"cgroup {found[1]}")


def _smallest(root: str, path: str, name: str) -> tuple[int, str] | None:
    """(limit, file) of the smallest limit file `name` in cgroup `path` of the hierarchy at
    `root` and its ancestors, up to `root`; None if none holds a limit."""
    best = None
    folder = os.path.join(root, path.lstrip("/"))
    while True:
        limit = _read_limit(os.path.join(folder, name))
        if limit is not None and (best is None or limit < best[0]):
            best = (limit, os.path.join(folder, name))
        if os.path.normpath(folder) == os.path.normpath(root):
            break
        folder = os.path.dirname(folder.rstrip("/"))
        if not folder.startswith(os.path.normpath(root)):
            break
    return best


def _read_limit(path: str) -> int | None:
    try:
        with open(path) as f:
            text = f.read().strip()
    except OSError:
        return None
    return int(text) if text.isdigit() and int(text) < NO_LIMIT else None  # "max" or v1's huge number: none


def oom_kill_file(proc_cgroup: str = "/proc/self/cgroup", root: str = "/sys/fs/cgroup") -> str | None:
    """The file of this process's memory cgroup that counts its out-of-memory kills (cgroup
    v2 `memory.events`, v1 `memory.oom_control`, each with a line `oom_kill N`); None if
    there is none. Never raises."""
    try:
        with open(proc_cgroup) as f:
            lines = f.read().splitlines()
    except OSError:
        return None
    for line in lines:
        parts = line.split(":", 2)
        if len(parts) != 3:
            continue
        if parts[0] == "0" and not parts[1]:
            path = os.path.join(root, parts[2].lstrip("/"), "memory.events")
        elif "memory" in parts[1].split(","):
            path = os.path.join(root, "memory", parts[2].lstrip("/"), "memory.oom_control")
        else:
            continue
        if os.path.exists(path):
            return path
    return None


def oom_kills(path: str | None) -> int:
    """The out-of-memory kills counted in `path` (`oom_kill_file`) so far; 0 if unknown."""
    try:
        with open(path) as f:
            return next((int(line.split()[1]) for line in f if line.startswith("oom_kill ")), 0)
    except (OSError, TypeError, ValueError, IndexError):
        return 0


def job_memory(env: Mapping[str, str], proc_cgroup: str = "/proc/self/cgroup",
               cgroup_root: str = "/sys/fs/cgroup") -> Sized | None:
    """The smallest memory limit of this process's job (Slurm's grant, cgroup v2 or v1), or None."""
    found = [s for s in (slurm_memory(env), cgroup_memory(proc_cgroup, cgroup_root)) if s is not None]
    return min(found, key=lambda s: s.bytes) if found else None


def free_bytes(folder: str | None) -> int | None:
    """Free bytes of the file system that holds `folder` (or its nearest existing parent);
    None when there is no such folder or it cannot be read. Never raises."""
    if not folder:
        return None
    path = os.path.abspath(folder)
    while not os.path.exists(path) and os.path.dirname(path) != path:
        path = os.path.dirname(path)
    try:
        return shutil.disk_usage(path).free
    except OSError:
        return None


def ram_size(env: Mapping[str, str], shm_dir: str | None, headroom: int, share: float,
             proc_cgroup: str = "/proc/self/cgroup", cgroup_root: str = "/sys/fs/cgroup") -> Sized:
    """The RAM tier of a worker given no size: (the job's memory limit - headroom) x share,
    1 GiB when no limit is found, never more than the free room of `shm_dir`."""
    limit = job_memory(env, proc_cgroup, cgroup_root)
    if limit is None:
        sized = Sized(DEFAULT_RAM, "default (no job memory limit found)")
    else:
        value = max(0, int((limit.bytes - headroom) * share))
        sized = Sized(value, f"{limit.source} ({format_bytes(limit.bytes)}) - {format_bytes(headroom)} "
                             f"headroom, x {share:g}")
    room = free_bytes(shm_dir)
    if room is not None and room < sized.bytes:
        sized = Sized(room, f"{sized.source}; capped at the free room of {shm_dir} ({format_bytes(room)})")
    return sized


def in_batch_job(env: Mapping[str, str]) -> bool:
    """Whether this process runs inside a Slurm, PBS or LSF job."""
    return any(env.get(name) for name in JOB_ID_VARIABLES)


def ssd_folder(env: Mapping[str, str], configured: str | None) -> tuple[str | None, str]:
    """The SSD tier's parent folder and why: `configured` (ssd-dir) when set, else the
    job's temp dir (`$SLURM_TMPDIR`, else `$TMPDIR` in a batch job), else None (the
    worker's local directory)."""
    if configured:
        return configured, "dmdask.worker.ssd-dir"
    if env.get("SLURM_TMPDIR"):
        return env["SLURM_TMPDIR"], "$SLURM_TMPDIR"
    if in_batch_job(env) and env.get("TMPDIR"):
        return env["TMPDIR"], "the job's $TMPDIR"
    return None, "the worker's local directory"


def ssd_size(env: Mapping[str, str], folder: str, share: float) -> Sized:
    """The SSD tier of a worker given no size: `share` of the free space of `folder`
    inside a batch job, 0 (no tier) outside one."""
    if not in_batch_job(env):
        return Sized(0, "default (off outside a batch job)")
    room = free_bytes(folder)
    if room is None:
        return Sized(0, f"no free space could be read at {folder}")
    return Sized(int(room * share), f"{share:g} x free space of {folder} ({format_bytes(room)})")


def explicit(value: int, name: str) -> Sized:
    """A size that was given: it wins over the job's limits."""
    return Sized(int(value), f"dmdask.worker.{name}")


__all__ = ["Sized", "cgroup_memory", "explicit", "free_bytes", "in_batch_job", "job_memory", "oom_kill_file",
           "oom_kills", "ram_size", "slurm_memory", "ssd_folder", "ssd_size"]
