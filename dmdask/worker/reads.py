"""`PriorityPool`: a worker's read threads, the earliest batch's reads first across every
rank the worker serves (a read's priority: its batch's position in its rank's epoch), a
queued read hastened when an earlier batch comes to wait for it (`hasten`), and whether
any read a batch waits for is queued or running (`idle`, `on_idle`)."""
from __future__ import annotations

import concurrent.futures
import heapq
import itertools
import threading
from collections.abc import Callable

LAST = float("inf")  # the priority of work no batch waits for (background loads, rereads)


class _Call:
    """A submitted call; in the queue once per priority it was given (the first one out runs it)."""

    __slots__ = ("args", "fn", "future", "kwargs", "priority", "taken")

    def __init__(self, priority: float, future: concurrent.futures.Future, fn: Callable, args, kwargs):
        self.priority, self.future, self.fn, self.args, self.kwargs = priority, future, fn, args, kwargs
        self.taken = False


class PriorityPool(concurrent.futures.Executor):
    """`threads` daemon threads running submitted calls, lowest `priority` first, then in
    submission order. `submit(fn, *args)` (what `loop.run_in_executor` calls) runs at the
    priority `LAST`. After `shutdown`, queued calls are cancelled and new ones refused.
    `on_idle()` is called, in the read thread, each time the last call of a priority
    before `LAST` queued or running ends."""

    def __init__(self, threads: int, name: str = "dmdask-read"):
        self.on_idle: Callable[[], None] | None = None
        self._urgent = 0  # calls of a priority before LAST, queued or running
        self._queue: list[tuple] = []  # (priority, order, _Call)
        self._calls: dict[concurrent.futures.Future, _Call] = {}  # the queued calls, by future
        self._order = itertools.count()
        self._ready = threading.Condition()
        self._closed = False
        self._threads = [threading.Thread(target=self._work, name=f"{name}-{i}", daemon=True) for i in range(threads)]
        for thread in self._threads:
            thread.start()

    def submit(self, fn: Callable, /, *args, **kwargs) -> concurrent.futures.Future:
        return self.submit_at(LAST, fn, *args, **kwargs)

    def submit_at(self, priority: float, fn: Callable, /, *args, **kwargs) -> concurrent.futures.Future:
        future: concurrent.futures.Future = concurrent.futures.Future()
        with self._ready:
            if self._closed:
                raise RuntimeError("cannot submit to a PriorityPool after shutdown")
            call = self._calls[future] = _Call(priority, future, fn, args, kwargs)
            heapq.heappush(self._queue, (priority, next(self._order), call))
            self._urgent += priority < LAST
            self._ready.notify()
        return future

    def hasten(self, future: concurrent.futures.Future, priority: float) -> None:
        """Run the call of `future` (from `submit_at`), if still queued, no later than the
        calls of `priority` submitted now: a batch waits for what another read brings (a
        read ahead, at `LAST`, that earlier batches' reads keep queued, would hold it to the
        epoch's end otherwise). Nothing if it runs already, ran, or has an earlier priority."""
        with self._ready:
            call = self._calls.get(future)
            if call is None or call.priority <= priority:
                return
            self._urgent += call.priority == LAST
            call.priority = priority
            heapq.heappush(self._queue, (priority, next(self._order), call))

    def idle(self) -> bool:
        """Whether no call of a priority before `LAST` is queued or running."""
        with self._ready:
            return not self._urgent

    def _work(self) -> None:
        while True:
            with self._ready:
                while not self._queue and not self._closed:
                    self._ready.wait()
                if not self._queue:
                    return
                call = heapq.heappop(self._queue)[2]
                if call.taken:  # queued again at an earlier priority, and run then
                    continue
                call.taken = True
                del self._calls[call.future]
            if call.future.set_running_or_notify_cancel():
                try:
                    result = call.fn(*call.args, **call.kwargs)
                except BaseException as exc:  # noqa: BLE001 - handed to the caller
                    call.future.set_exception(exc)
                else:
                    call.future.set_result(result)
            if call.priority < LAST:
                self._ended_urgent()

    def _ended_urgent(self) -> None:
        with self._ready:
            self._urgent -= 1
            idle = not self._urgent
        if idle and self.on_idle is not None:
            self.on_idle()

    def shutdown(self, wait: bool = True, *, cancel_futures: bool = False) -> None:
        with self._ready:
            self._closed = True
            if cancel_futures:
                for call in self._calls.values():
                    call.future.cancel()
                    self._urgent -= call.priority < LAST
                self._queue.clear()
                self._calls.clear()
            self._ready.notify_all()
        if wait:
            for thread in self._threads:
                thread.join()
