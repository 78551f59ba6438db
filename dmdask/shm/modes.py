"""Who may read a worker's files (docs/failures.md, "Trust model"): only the worker's user
(folders 0700, files 0600, whatever the umask), or the group `dmdask.worker.group`
(folders 2750, so new files inherit the group; files 0640).
"""
from __future__ import annotations

import grp
import os

import dask.config

from ..errors import SpecError


def group_id(value=None) -> int | None:
    """The gid of the configured group (`dmdask.worker.group`), None for none."""
    value = dask.config.get("dmdask.worker.group", None) if value is None else value
    if value is None or value == "":
        return None
    try:
        return int(value) if str(value).isdigit() else grp.getgrnam(str(value)).gr_gid
    except KeyError:
        raise SpecError("dmdask.worker.group", "a group of this node (a name or id), or null", value) from None


def file_mode(gid: int | None) -> int:
    return 0o600 if gid is None else 0o640


def protect_folder(path: str, gid: int | None) -> None:
    """Give a folder made by this worker its mode (and group)."""
    if gid is not None:
        os.chown(path, -1, gid)
    os.chmod(path, 0o700 if gid is None else 0o2750)


def group_of(folder: str) -> int | None:
    """The group a worker folder was opened to (`protect_folder`), None for none."""
    st = os.stat(folder)
    return st.st_gid if st.st_mode & 0o050 else None


def create_file(path: str, gid: int | None, flags: int = os.O_WRONLY | os.O_TRUNC) -> int:
    """Open `path` (created when missing) with the file mode, whatever the umask; an fd."""
    fd = os.open(path, flags | os.O_CREAT, file_mode(gid))
    try:
        os.fchmod(fd, file_mode(gid))
    except BaseException:
        os.close(fd)
        raise
    return fd
