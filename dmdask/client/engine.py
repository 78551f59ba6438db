"""One fetch engine: rows of blocks from the workers that hold them, located on the
scheduler, for the iterator (`client.fetch.GroupFetcher`) and transparent mode
(`fs.blocks.Blocks`) alike; a coroutine of the client's event loop.

Each try: the scheduler checked (`Contact.check_scheduler`: waited for while the client
reconnects, else `SchedulerLostError`), the blocks' holders asked of the caller's
`holders_of` (which locates those it does not know), the rows planned (`plan_rows`) and
taken by the caller's `attempt`. Every fault either caller meets is handled here, the same
for both:
- a block whose load failed: its error raised (`BlockReadError`, or whatever `holders_of`
  raises for it), never retried here;
- a block not held yet (loading, claimed, recomputed after a loss): located again at once
  (the scheduler's locate waits for the load); while the cluster has no workers the try
  waits for one (`Contact.wait_if_no_workers`) and the deadline starts again when one joins;
- a worker lost (OSError, CommClosedError) or a block its holder no longer has (`Moved`):
  the blocks' holders forgotten (`forget`) and located again; a lost worker is also
  forgotten as the local one (`Contact.forget_worker`) and told to `on_lost`; the first
  request a holder left unanswered (a `TimeoutError`: paused, or silent until the scheduler
  treats it as lost, `dmdask.worker.silent-seconds`) renews the deadline once;
- the client losing its scheduler meanwhile (a RuntimeError such as "ConnectionPool is
  closed" while its status is not "running"): tried again (any other RuntimeError is raised).
Tries run until `dmdask.client.recovery-seconds` pass without success; then `NoWorkersError`
when the cluster has no workers, else `Exhausted` (the caller names what it was fetching).
"""
from __future__ import annotations

from collections.abc import Awaitable, Callable

import numpy as np
from distributed.comm.core import CommClosedError

from ..errors import BlockReadError, no_workers
from ..recovery import Tries
from .gather import Moved, plan_rows


class Exhausted(Exception):
    """The fetch still failed once its deadline passed; `tries`: how many were made. Its
    cause is the last fault met (None when the blocks were never all held)."""

    def __init__(self, tries: int):
        super().__init__(f"still failing after {tries} tries")
        self.tries = tries


async def fetch_rows(contact, keys: dict[int, str], blocks: np.ndarray, offsets: np.ndarray,
                     holders_of: Callable[[list[str]], Awaitable[tuple[dict[str, str], set[str]]]],
                     forget: Callable[[list[str]], None],
                     attempt: Callable[[dict, dict, set[str]], Awaitable], recovery: float,
                     on_lost: Callable[[BaseException], Awaitable[None]] | None = None):
    """`attempt(plan, positions, loading)`'s result for the rows (`blocks`, `offsets`: block
    number and row in it, one per row; `keys`: block number -> key), retried as the module
    says. `holders_of(keys)`: (a holder of each block it knows, those among them still
    loading); `forget(keys)`: drop what it knows of their holders."""
    tries = Tries(recovery, pause=lambda attempt_count: min(1.0, 0.05 * attempt_count))
    wanted = list(keys.values())
    last: BaseException | None = None
    silent_waited = False
    async for _ in tries:
        await contact.check_scheduler()
        try:
            holders, loading = await holders_of(wanted)
            if len(holders) < len(keys):  # still loading, recomputed after a loss, or no worker left
                if await contact.wait_if_no_workers():
                    tries.deadline.renew()
                tries.no_pause()  # the locate waited on the scheduler
                continue
            plan, positions = plan_rows(blocks, offsets, keys, holders)
            return await attempt(plan, positions, loading)
        except BlockReadError:
            raise
        except (OSError, CommClosedError) as exc:  # a worker left: ask again
            last = exc
            if isinstance(exc, TimeoutError) and not silent_waited:  # a silent holder's wait: not counted, once
                silent_waited = True
                tries.deadline.renew()
            if on_lost is not None:
                await on_lost(exc)
            contact.forget_worker()
            if await contact.wait_if_no_workers():
                tries.deadline.renew()  # one joined: the fetch gets its full time again
        except Moved as exc:  # released or moved by its holder
            last = exc
        except RuntimeError as exc:  # "ConnectionPool is closed": the client is losing its scheduler
            if contact.client.status == "running":
                raise
            last = exc
        forget(wanted)
    if not await contact.workers(wait=False):
        raise no_workers(recovery) from last
    raise Exhausted(tries.count) from last
