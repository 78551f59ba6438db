"""Which host is this process's own (`my_host`): whose workers' files it reads itself."""
from __future__ import annotations

import dask.config
from distributed.comm import get_address_host

from ..internals import local_address


def my_host(client) -> str | None:
    """`dmdask.client.host` when set (workers listening on another interface than the one
    the scheduler is reached from), else the address it reaches the scheduler from; None
    while disconnected."""
    host = dask.config.get("dmdask.client.host", None)
    if host:
        return host
    address = local_address(client)
    return get_address_host(address) if address is not None else None
