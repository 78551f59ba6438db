"""`dmdask.recovery.Tries`: the attempts and pauses of every wait on a lost worker,
scheduler or block, checked on a fake clock (no real waiting)."""
import asyncio
import types

import pytest

from dmdask import recovery
from dmdask.recovery import Deadline, Tries


class Clock:
    def __init__(self):
        self.now, self.pauses = 0.0, []

    def monotonic(self):
        return self.now

    def sleep(self, seconds):
        self.pauses.append(seconds)
        self.now += seconds

    async def async_sleep(self, seconds):
        self.sleep(seconds)


@pytest.fixture
def clock(monkeypatch):
    clock = Clock()
    monkeypatch.setattr(recovery, "time", types.SimpleNamespace(monotonic=clock.monotonic, sleep=clock.sleep))
    monkeypatch.setattr(recovery, "asyncio", types.SimpleNamespace(sleep=clock.async_sleep))
    return clock


def test_attempts_until_the_deadline_then_stop_without_a_last_pause(clock):
    tries = Tries(1.0, pause=0.3)
    assert list(tries) == [1, 2, 3, 4, 5]  # at 0, 0.3, 0.6, 0.9, 1.2: past the deadline, no pause after it
    assert clock.pauses == [0.3, 0.3, 0.3, 0.3] and tries.count == 5


def test_a_first_attempt_even_past_the_deadline(clock):
    assert list(Tries(-1.0, pause=5.0)) == [1]
    assert sum(clock.pauses) == 0


def test_pause_by_attempt_number_and_no_pause(clock):
    tries = Tries(10.0, pause=lambda attempt: 0.1 * attempt)
    for attempt in tries:
        if attempt == 2:
            tries.no_pause()  # say, the attempt waited on the scheduler already
        if attempt == 4:
            break
    assert clock.pauses == pytest.approx([0.1, 0.3])  # none before attempts 1 and 3


def test_renew_gives_the_full_time_again(clock):
    deadline = Deadline(1.0)
    tries = Tries(deadline, pause=0.5)
    renewed = False
    for attempt in tries:
        if clock.now >= 1.0 and not renewed:  # a worker joined: the full time again
            renewed = True
            deadline.renew()
    assert renewed and clock.now > 2.0 and deadline.left() < 0


def test_async_attempts(clock):
    async def run():
        tries, seen = Tries(1.0, pause=0.5), []
        async for attempt in tries:
            seen.append(attempt)
        return seen

    assert asyncio.run(run()) == [1, 2, 3, 4]
    assert clock.pauses == [0.5, 0.5, 0.5]
