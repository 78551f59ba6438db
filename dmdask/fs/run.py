"""The run token of transparent mode: what a job's processes share so that the store is
asked for a listing or a file's info once per job (`dmdask.scheduler.files`).

Guarantees: `import dmdask` makes the token in a process that has none (`start`), so a
training process and every loader process it starts (they inherit `DMDASK_FS_RUN`) are
one run. Set `DMDASK_FS_RUN` yourself to share one run between the ranks of a job.
"""
from __future__ import annotations

import os
import uuid

RUN_ENV = "DMDASK_FS_RUN"


def start() -> str:
    """This run's token: the one this process inherited from its parent, else made now."""
    return os.environ.setdefault(RUN_ENV, uuid.uuid4().hex)


def new_run() -> str:
    """Start a new run in this process (and the processes it starts from now on)."""
    os.environ[RUN_ENV] = uuid.uuid4().hex
    return os.environ[RUN_ENV]
