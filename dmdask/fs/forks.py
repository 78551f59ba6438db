"""Keep a parent's fsspec filesystems working after it forks (a `DataLoader` worker).

A forked child drops the fsspec filesystems it inherited (fsspec's own at-fork hook
clears its instance cache), and dropping an async one (HTTP) runs its finaliser in the
child: that closes the inherited aiohttp connections,
which unregisters their sockets from the event-loop's epoll instance the child shares
with its parent. The parent's connections then never see their replies: its next
request through that filesystem times out (seen after one epoch of non-persistent
loader workers: the parent's `ls` over HTTP failed with FSTimeoutError).

Guarantee: in a child forked after `import dmdask`, the inherited instances are not
finalised (the child keeps a reference to each until it exits, never using them), so
the parent's filesystems keep working. fsspec lists no public way to enumerate its
cached instances; this reads the `_cache` of each
`AbstractFileSystem` subclass (fsspec 2023-2026).
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


def _release_in_parent() -> None:
    _inherited.clear()


os.register_at_fork(before=_hold, after_in_parent=_release_in_parent)
