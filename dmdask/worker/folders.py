"""The folders a worker keeps blocks in: one per tier and worker process, named after
the process (`dmdask-<tier>-<pid>-<token>`), so the next worker that starts on the node
removes what a crashed one left behind."""
from __future__ import annotations

import os
import re
import shutil
import tempfile

from ..shm.modes import protect_folder

_NAME = re.compile(r"^dmdask-(ram|ssd)-(\d+)-[A-Za-z0-9_]+$")


def make_folder(root: str, tier: str, gid: int | None = None) -> str:
    """A new folder of this process under `root`, after removing those of dead processes:
    readable by this user only (0700), or by group `gid` too (`dmdask.shm.modes`)."""
    os.makedirs(root, exist_ok=True)
    remove_stale(root)
    path = tempfile.mkdtemp(dir=root, prefix=f"dmdask-{tier}-{os.getpid()}-")
    protect_folder(path, gid)
    return path


def remove_stale(root: str) -> list:
    """Remove the folders of worker processes that no longer run; returns their paths."""
    removed = []
    try:
        names = os.listdir(root)
    except OSError:
        return removed
    for name in names:
        match = _NAME.match(name)
        if match and not _alive(int(match.group(2))):
            shutil.rmtree(os.path.join(root, name), ignore_errors=True)
            removed.append(os.path.join(root, name))
    return removed


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:  # another user's process
        return True
    return True
