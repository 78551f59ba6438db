"""Keep a parent's fsspec filesystems working after it forks (a `DataLoader` worker).

A forked child drops the fsspec filesystems it inherited (fsspec's at-fork hook clears its
instance cache); finalising an async one (HTTP) closes the inherited aiohttp connections,
unregistering their sockets from the epoll instance it shares with its parent, whose next
request through that filesystem then times out. So a child keeps a reference to each
inherited instance until it exits. fsspec has no public way to list its cached instances:
this reads the `_cache` of each `AbstractFileSystem` subclass (fsspec 2023-2026.9).
"""
from __future__ import annotations

import os

import fsspec

_inherited: list = []  # the parent's instances while it forks; in a child, until it exits


def _subclasses(cls):
    for sub in cls.__subclasses__():
        yield sub
        yield from _subclasses(sub)


def _hold() -> None:
    """In the parent, just before a fork (before fsspec's own hook clears the child's
    cache): references the child inherits."""
    _inherited[:] = [inst for cls in set(_subclasses(fsspec.AbstractFileSystem))
                     for inst in list((cls.__dict__.get("_cache") or {}).values())]


def keep_across_forks() -> None:
    """Install the at-fork hooks (once per process: `dmdask.fs.register`)."""
    os.register_at_fork(before=_hold, after_in_parent=_inherited.clear)
