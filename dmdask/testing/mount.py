"""Stopping a `dmdask mount` process that a test or a benchmark started."""
from __future__ import annotations

import os
import shutil
import signal
import subprocess


def unmount(proc: subprocess.Popen, mountpoint: str) -> None:
    """Stop the mount process (libfuse unmounts on SIGINT; killed after 20 s) and unmount
    lazily if the mount point is still mounted. Returns once neither is left."""
    if proc.poll() is None:
        proc.send_signal(signal.SIGINT)
        try:
            proc.wait(timeout=20)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait(timeout=20)
    if os.path.ismount(mountpoint):
        tool = shutil.which("fusermount3") or shutil.which("fusermount")
        subprocess.run([tool, "-u", "-z", mountpoint], check=False, timeout=20)
