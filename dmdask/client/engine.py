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
- a block not held yet (loading, queued on its worker or on the scheduler, not submitted
  yet, claimed, recomputed after a loss), or one its holder was still loading when asked
  (`Moved` naming only blocks located as loading): not a fault but a busy cluster; located
  again at once (the scheduler's locate waits for the load), and such a try does not count
  against `dmdask.client.recovery-seconds` (its deadline starts again), only against
  `dmdask.client.load-seconds` from the fetch's start (`StillLoading` then, naming how many
  blocks were queued and loading); while the cluster has no workers the try waits for one
  (`Contact.wait_if_no_workers`) and the deadline starts again when one joins;
- a worker lost (OSError, CommClosedError) or a block its holder no longer has (`Moved`):
  the blocks' holders forgotten (`forget`) and located again; a lost worker is also
  forgotten as the local one (`Contact.forget_worker`) and told to `on_lost`; the first
  request a holder left unanswered (a `TimeoutError`: paused, or silent until the scheduler
  treats it as lost, `dmdask.worker.silent-seconds`) renews the deadline once;
- the client losing its scheduler meanwhile (a RuntimeError such as "ConnectionPool is
  closed" while its status is not "running"): tried again (any other RuntimeError is raised).
Tries run until `dmdask.client.recovery-seconds` pass without success; then `NoWorkersError`
when the cluster has no workers, else `Exhausted` (the caller names what it was fetching;
it says what the tries met, `Exhausted.faults`, and, for `StillLoading`, the blocks not
loaded yet).
"""
from __future__ import annotations

from collections import Counter
from collections.abc import Awaitable, Callable

import dask.config
import numpy as np
from distributed.comm.core import CommClosedError

from ..errors import BlockReadError, no_workers
from ..recovery import Deadline, Tries
from .gather import Moved, plan_rows

LOADING, LOST, MOVED, SCHEDULER = "waiting for loads", "lost workers", "blocks moved", "scheduler reconnecting"


class Exhausted(Exception):
    """The fetch still failed once its deadline passed; `tries`: how many were made;
    `faults`: what held each failed try back (`LOADING`, `LOST`, `MOVED`, `SCHEDULER`: counts).
    Its cause is the last fault met (None when the blocks were never all held)."""

    def __init__(self, tries: int, faults: Counter | None = None):
        self.tries, self.faults = tries, Counter(faults or ())
        super().__init__(f"still failing after {tries} tries ({self.what_failed()})")

    def what_failed(self) -> str:
        """The failed tries by what held them back, e.g. "7 waiting for loads, 2 lost workers"."""
        return ", ".join(f"{n} {what}" for what, n in self.faults.most_common()) or "none failed"


class StillLoading(Exhausted):
    """The fetch's blocks were still not all loaded after `dmdask.client.load-seconds`
    (`seconds`), the cluster busy rather than failing: of its `blocks`, `queued` were
    waited for on the scheduler (not on a worker yet, not submitted yet, claimed by a
    reader, or in a load group still loading) and `loading` were loading or queued on
    their workers at the last try."""

    def __init__(self, tries: int, faults: Counter, seconds: float, blocks: int, queued: int, loading: int):
        super().__init__(tries, faults)
        self.seconds, self.blocks, self.queued, self.loading = seconds, blocks, queued, loading

    def explain(self) -> str:
        """What was going on, for the caller's error."""
        return (f"{self.queued + self.loading} of its {self.blocks} blocks still not loaded after {self.seconds:.0f} s "
                f"({self.loading} loading or queued on their workers, {self.queued} waited for on the scheduler: not "
                f"on a worker yet, not submitted yet, or in a load group still loading); {self.tries} tries "
                f"({self.what_failed()}). The cluster is "
                "busy, not losing workers: raise dmdask.client.load-seconds to wait longer for loads")


def load_seconds() -> float:
    """How long a fetch waits for blocks that are loading or queued (`dmdask.client.load-seconds`)."""
    return float(dask.config.get("dmdask.client.load-seconds"))


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
    loads = Deadline(load_seconds())
    wanted = list(keys.values())
    last: BaseException | None = None
    silent_waited = False
    faults: Counter = Counter()
    waiting = None  # (queued, loading): the last try waited for loads only

    def wait_for_loads(queued: int, loading_: int) -> None:
        """A try held back by blocks loading or queued: not a fault, so the recovery
        deadline starts again, but never past `loads`."""
        nonlocal waiting
        waiting = (queued, loading_)
        faults[LOADING] += 1
        tries.deadline.renew(not_after=loads.at)

    async for _ in tries:
        await contact.check_scheduler()
        waiting = None
        loading: set[str] = set()
        try:
            holders, loading = await holders_of(wanted)
            if len(holders) < len(keys):  # still loading, recomputed after a loss, or no worker left
                if await contact.wait_if_no_workers():
                    tries.deadline.renew()
                else:
                    wait_for_loads(len(keys) - len(holders), len(loading))
                tries.no_pause()  # the locate waited on the scheduler
                continue
            plan, positions = plan_rows(blocks, offsets, keys, holders)
            return await attempt(plan, positions, loading)
        except BlockReadError:
            raise
        except (OSError, CommClosedError) as exc:  # a worker left: ask again
            last = exc
            faults[LOST] += 1
            if isinstance(exc, TimeoutError) and not silent_waited:  # a silent holder's wait: not counted, once
                silent_waited = True
                tries.deadline.renew()
            if on_lost is not None:
                await on_lost(exc)
            contact.forget_worker()
            if await contact.wait_if_no_workers():
                tries.deadline.renew()  # one joined: the fetch gets its full time again
        except Moved as exc:  # released or moved by its holder, or still loading there
            last = exc
            if exc.keys and set(exc.keys) <= set(loading):  # its holder was loading it still: busy, not a fault
                wait_for_loads(0, len(exc.keys))
            else:
                faults[MOVED] += 1
        except RuntimeError as exc:  # "ConnectionPool is closed": the client is losing its scheduler
            if contact.client.status == "running":
                raise
            last = exc
            faults[SCHEDULER] += 1
        forget(wanted)
    if not await contact.workers(wait=False):
        raise no_workers(recovery) from last
    if waiting is not None:  # the last try waited for loads: `loads` passed
        raise StillLoading(tries.count, faults, loads.seconds, len(keys), *waiting) from last
    raise Exhausted(tries.count, faults) from last
