"""Who holds which blocks: the one `dmdask_locate` request of `dmdask.batches`
(`dmdask.client.iterator`) and transparent mode (`dmdask.fs.blocks`, `dmdask.fs.claims`),
and which host is this process's own (`my_host`), whose workers' files it reads itself.

Guarantees: one request, which waits on the scheduler at most `wait` seconds for blocks
still loading (and for keys in `expect`, just submitted by the caller, and blocks a reader
claimed); a holder on `host` is preferred; a block whose load failed comes back as the
exception its load raised, one the scheduler does not have as `unknown`, neither as an
error of the call. Callers retry (`dmdask.recovery.Tries`) on comm errors.
"""
from __future__ import annotations

from typing import Dict, Iterable, List, NamedTuple, Optional

import dask.config
from distributed.comm import get_address_host

from ..internals import local_address, reraise

LOCATE_SECONDS = 2.0  # one wait on the scheduler for blocks still loading


class Located(NamedTuple):
    holders: Dict[str, str]  # key -> a worker holding it
    erred: Dict[str, BaseException]  # key -> the error of its load
    unknown: List[str]  # keys the scheduler does not have (released, forgotten or never submitted)
    loading: Dict[str, str]  # planned=True: key -> the worker loading it right now (not waited for)


async def locate(client, keys: List[str], host: Optional[str], wait: float = LOCATE_SECONDS,
                 expect: Iterable[str] = (), planned: bool = False) -> Located:
    """Where `keys` are (see the module docstring); `planned`: name the worker loading a
    block right now instead of waiting for it."""
    reply = await client.scheduler.dmdask_locate(keys=list(keys), host=host, timeout=wait, expect=list(expect),
                                                 planned=planned)
    return Located(reply["holders"], {k: reraise(e) for k, e in reply["erred"].items()},
                   reply["unknown"], reply["planned"])


def my_host(client) -> Optional[str]:
    """The host this process counts as its node: `dmdask.client.host` when set (a node
    whose workers listen on another interface than the one the scheduler is reached
    from), else the address it reaches the scheduler from; None while disconnected."""
    host = dask.config.get("dmdask.client.host", None)
    if host:
        return host
    address = local_address(client)
    return get_address_host(address) if address is not None else None
