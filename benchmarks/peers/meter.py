"""What every process of a run peaks at, and what it writes to node-local storage.

A `Meter` thread polls, every `interval` seconds:
- each watched process and all its descendants: `VmHWM` from /proc/<pid>/status (the
  peak resident set, monotone, so the last poll before a process ends is its lower bound);
- each node's folders: every file seen, by (path, inode), at the largest size seen, so a
  file evicted and fetched again counts twice ("written"), and a file growing counts once.
"""
from __future__ import annotations

import glob
import os
import threading
from typing import Dict, List, Tuple


def vmhwm_kib(pid: int) -> int:
    """The peak resident set of a live process, in KiB (0 if it is gone)."""
    try:
        with open(f"/proc/{pid}/status") as f:
            for line in f:
                if line.startswith("VmHWM:"):
                    return int(line.split()[1])
    except (FileNotFoundError, ProcessLookupError, PermissionError):
        pass
    return 0


def _children(pid: int) -> List[int]:
    try:
        import psutil

        return [c.pid for c in psutil.Process(pid).children(recursive=True)]
    except Exception:  # noqa: BLE001 - gone while we looked
        return []


class Meter:
    """Poll peaks of process trees and bytes written under node folders (see module doc)."""

    def __init__(self, interval: float = 0.2):
        self.interval = interval
        self._roots: Dict[int, Tuple[str, int]] = {}  # pid -> (role, node)
        self._folders: Dict[str, Tuple[int, str]] = {}  # pattern -> (node, kind)
        self.peaks: Dict[int, dict] = {}
        self.files: Dict[Tuple[str, int], Tuple[int, str, int]] = {}  # (path, inode) -> (node, kind, size)
        self._lock = threading.Lock()
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, name="peers-meter", daemon=True)

    def watch(self, pid: int, role: str, node: int = -1) -> None:
        with self._lock:
            self._roots[pid] = (role, node)

    def folder(self, pattern: str, node: int, kind: str = "disk") -> None:
        """Count files under every folder matching the glob `pattern` as written on `node`."""
        with self._lock:
            self._folders[pattern] = (node, kind)

    def __enter__(self) -> "Meter":
        self._thread.start()
        return self

    def __exit__(self, *exc) -> None:
        self._stop.set()
        self._thread.join()
        self.poll()

    def _run(self) -> None:
        while not self._stop.wait(self.interval):
            self.poll()

    def poll(self) -> None:
        with self._lock:
            roots, folders = dict(self._roots), dict(self._folders)
        for pid, (role, node) in roots.items():
            for p, r in [(pid, role)] + [(c, role + " child") for c in _children(pid)]:
                kib = vmhwm_kib(p)
                entry = self.peaks.setdefault(p, {"pid": p, "role": r, "node": node, "vmhwm_kib": 0})
                entry["vmhwm_kib"] = max(entry["vmhwm_kib"], kib)
        for pattern, (node, kind) in folders.items():
            for top in glob.glob(pattern):
                for dirpath, _, names in os.walk(top):
                    for name in names:
                        path = os.path.join(dirpath, name)
                        try:
                            st = os.stat(path)
                        except FileNotFoundError:
                            continue
                        key = (path, st.st_ino)
                        seen = self.files.get(key)
                        self.files[key] = (node, kind, max(st.st_size, seen[2] if seen else 0))

    def written(self, kind: str = "disk") -> Dict[int, int]:
        """Bytes written per node (files of `kind`)."""
        out: Dict[int, int] = {}
        for node, k, size in self.files.values():
            if k == kind:
                out[node] = out.get(node, 0) + size
        return out

    def processes(self) -> List[dict]:
        return sorted(self.peaks.values(), key=lambda e: (e["node"], e["role"], e["pid"]))
