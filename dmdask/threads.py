"""Thread pools of a process that a forked child starts anew (it has none of its parent's
threads, and a pool's locks may have been held at the fork)."""
from __future__ import annotations

import concurrent.futures
import os


class ForkSafeExecutor(concurrent.futures.Executor):
    """A thread pool that a forked child starts anew."""

    def __init__(self, threads: int, name: str):
        self.threads, self.name = threads, name
        self._start()
        os.register_at_fork(after_in_child=self._start)

    def _start(self) -> None:
        self._pool = concurrent.futures.ThreadPoolExecutor(self.threads, thread_name_prefix=self.name)

    def submit(self, fn, /, *args, **kwargs):
        return self._pool.submit(fn, *args, **kwargs)
