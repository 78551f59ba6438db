"""`dmdask.client.coalesce.Coalesced`: one request at a time, the keys asked for meanwhile
sent together next; failures reach exactly the callers of the failed request. (The request
is a coroutine here: the property is the coalescing itself; the real-process check is
`test_first_contact.py::test_a_cold_rank_locates_its_first_batches_blocks_with_one_request`.)
Each request waits on a gate the test opens, so no step depends on timing."""
import asyncio

from dmdask.client.coalesce import Coalesced


class _Requests:
    """The request: records its keys, waits for `gate`, then answers (or fails for "bad")."""

    def __init__(self):
        self.sent, self.gate, self.started = [], asyncio.Event(), asyncio.Event()

    async def __call__(self, keys):
        self.sent.append(keys)
        self.started.set()
        await self.gate.wait()
        if "bad" in keys:
            raise OSError("the scheduler went away")
        return {k: k.upper() for k in keys}


async def _queued(*calls):
    """The callers' tasks, each run up to its first await (its keys queued)."""
    tasks = [asyncio.ensure_future(call) for call in calls]
    await asyncio.sleep(0)
    return tasks


def test_keys_asked_together_or_meanwhile_go_in_one_request_each():
    async def scenario():
        request = _Requests()
        coalesced = Coalesced(request)
        first = await _queued(coalesced(["a", "b"]), coalesced(["b", "c"]), coalesced(["d"]))
        await request.started.wait()  # the first request is under way
        later = await _queued(coalesced(["e"]), coalesced(["a", "f"]))
        request.gate.set()
        return request.sent, await asyncio.gather(*first, *later)

    sent, replies = asyncio.run(scenario())
    assert sent == [["a", "b", "c", "d"], ["e", "a", "f"]]
    assert replies[0] == replies[1] == replies[2] == {"a": "A", "b": "B", "c": "C", "d": "D"}
    assert replies[3] == replies[4] == {"e": "E", "a": "A", "f": "F"}


def test_a_failed_request_fails_its_callers_only_and_a_cancelled_caller_no_other():
    async def scenario():
        request = _Requests()
        coalesced = Coalesced(request)
        doomed = await _queued(coalesced(["bad"]), coalesced(["x"]))
        await request.started.wait()
        meanwhile, cancelled = await _queued(coalesced(["y"]), coalesced(["z"]))
        cancelled.cancel()
        request.gate.set()
        results = await asyncio.gather(*doomed, meanwhile, cancelled, return_exceptions=True)
        return request.sent, results, await coalesced(["w"])

    sent, (bad, x, y, z), w = asyncio.run(scenario())
    assert isinstance(bad, OSError) and isinstance(x, OSError)
    assert y == {"y": "Y", "z": "Z"} and isinstance(z, asyncio.CancelledError)
    assert w == {"w": "W"} and sent == [["bad", "x"], ["y", "z"], ["w"]]
