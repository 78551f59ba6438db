"""The few places dmdask reaches into the internals of Dask distributed (checked against
2026.8.0) and fsspec (2026.9.0), one small function each, with why no public API does
it: a release that changes one of these breaks it here, and only here."""
from __future__ import annotations

from distributed.core import clean_exception
from distributed.protocol.serialize import Serialized, deserialize


def task_error(ts) -> BaseException:
    """The exception a failed block's key raises on the scheduler: that of the task to
    blame for it (`TaskState.exception_blame`, which has no public accessor)."""
    return (ts.exception_blame or ts).exception


def load_first(ts, rank: int) -> None:
    """Let task `ts` run before the tasks of a lower `rank` of the same graph: the first
    term of its scheduler priority. `client.submit(priority=...)` sets one priority for a
    whole graph; blocks need an order within it (the order an epoch first needs them).
    Called before the task is first scheduled."""
    ts.priority = (-rank,) + tuple(ts.priority[1:])


def run_next(state, keys, rank: float) -> list:
    """Move the tasks of `keys` queued on a worker (`state`: its `WorkerState`; state
    "ready") ahead of every task queued there that was not moved so; among those moved,
    a lower `rank` runs first, then the scheduler's order. The worker runs its queued
    tasks in the order of their priority, kept in a heap (`WorkerState.ready`) that no
    public API reorders: each task is taken out, given a priority ahead of the
    scheduler's (which are tuples of numbers), and put back. The keys moved."""
    moved = []
    for key in keys:
        ts = state.tasks.get(key)
        if ts is None or ts.state != "ready" or ts not in state.ready:
            continue
        if ts.priority and ts.priority[0] == float("-inf") and ts.priority[1] <= rank:
            continue  # moved already, as early or earlier
        base = ts.priority[2:] if ts.priority and ts.priority[0] == float("-inf") else ts.priority
        state.ready.discard(ts)
        ts.priority = (float("-inf"), rank) + tuple(base)
        state.ready.add(ts)
        moved.append(key)
    return moved


def reraise(exception):
    """The exception an RPC reply carries (pickled as `distributed.core.error_message`
    makes it, or as the scheduler keeps a task's error: `Serialized`, which a reply sent
    `ToPickle` leaves serialized), ready to raise."""
    if isinstance(exception, Serialized):
        exception = deserialize(exception.header, exception.frames)
    return clean_exception(exception)[1]


def local_address(client) -> str | None:
    """The address this process reaches the scheduler from (its host on the cluster's
    network): the local end of the client's connection. None while disconnected."""
    comm = client.scheduler_comm.comm if client.scheduler_comm is not None else None
    return comm.local_address if comm is not None else None


def strip_protocol(fs, path: str) -> str:
    """`path` as filesystem `fs` names it, protocol removed (`AbstractFileSystem._strip_protocol`,
    which each implementation overrides). The public `fsspec.core.strip_protocol` picks the
    implementation by the path's own protocol ("file" when it names none), not `fs`."""
    return fs._strip_protocol(path)
