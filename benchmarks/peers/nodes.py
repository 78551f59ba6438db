"""Simulated nodes' own /dev/shm: one mount namespace per node, held by a sleeping process.

Loaders that share memory between the processes of a node (Mosaic's shared-memory state,
dmdask's RAM tier) name it per host, so two simulated nodes on one machine would collide
or, worse, read each other's memory. Each node gets a private tmpfs on /dev/shm; its
ranks and workers enter that namespace (`nsenter -m`). Network and everything else stay
shared. Needs root and util-linux's unshare/nsenter; without them `prefix` is empty and
the nodes share this machine's /dev/shm (`isolated` is False, and the report says so).
"""
from __future__ import annotations

import os
import shutil
import subprocess
import time
from typing import List


class NodeNamespaces:
    def __init__(self, nodes: int, shm_bytes: int):
        self.nodes, self.shm_bytes = nodes, shm_bytes
        self.holders: List[subprocess.Popen] = []
        self.isolated = os.geteuid() == 0 and bool(shutil.which("unshare")) and bool(shutil.which("nsenter"))

    def __enter__(self) -> "NodeNamespaces":
        if not self.isolated:
            return self
        mount = f"mount -t tmpfs -o size={self.shm_bytes} tmpfs /dev/shm && exec sleep 86400"
        for _ in range(self.nodes):
            self.holders.append(subprocess.Popen(["unshare", "-m", "--propagation", "private", "sh", "-c", mount]))
        deadline = time.monotonic() + 10
        while not all(self._ready(p) for p in self.holders):
            if time.monotonic() > deadline or any(p.poll() is not None for p in self.holders):
                self.__exit__()
                self.isolated = False
                return self
            time.sleep(0.02)
        return self

    @staticmethod
    def _ready(p: subprocess.Popen) -> bool:
        try:
            with open(f"/proc/{p.pid}/cmdline", "rb") as f:
                return f.read().startswith(b"sleep")
        except FileNotFoundError:
            return False

    def __exit__(self, *exc) -> None:
        for p in self.holders:
            p.kill()
            p.wait()
        self.holders = []

    def prefix(self, node: int) -> List[str]:
        """The command prefix that runs a program in `node`'s namespace."""
        return ["nsenter", "-t", str(self.holders[node].pid), "-m", "--"] if self.isolated else []

    def shm(self, node: int) -> str:
        """`node`'s /dev/shm as this process sees it."""
        return f"/proc/{self.holders[node].pid}/root/dev/shm" if self.isolated else "/dev/shm"
