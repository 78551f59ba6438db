"""`dmdask.client.coalesce.Coalesced`: one request at a time, the keys asked for meanwhile
sent together next; failures reach exactly the callers of the failed request. (The request
is a coroutine here: the property is the coalescing itself; the real-process check is
`test_first_contact.py::test_a_cold_rank_locates_its_first_batches_blocks_with_one_request`.)"""
import asyncio

from dmdask.client.coalesce import Coalesced


def test_keys_asked_together_or_meanwhile_go_in_one_request_each():
    sent, gate = [], None

    async def request(keys):
        sent.append(keys)
        await gate.wait()
        return {k: k.upper() for k in keys}

    async def scenario():
        nonlocal gate
        gate = asyncio.Event()
        coalesced = Coalesced(request)
        first = [asyncio.ensure_future(coalesced(ks)) for ks in (["a", "b"], ["b", "c"], ["d"])]
        await asyncio.sleep(0.01)  # the first request is under way
        later = [asyncio.ensure_future(coalesced(ks)) for ks in (["e"], ["a", "f"])]
        await asyncio.sleep(0.01)
        gate.set()
        return await asyncio.gather(*first, *later)

    replies = asyncio.run(scenario())
    assert sent == [["a", "b", "c", "d"], ["e", "a", "f"]]
    assert replies[0] == replies[1] == replies[2] == {"a": "A", "b": "B", "c": "C", "d": "D"}
    assert replies[3] == replies[4] == {"e": "E", "a": "A", "f": "F"}


def test_a_failed_request_fails_its_callers_only_and_a_cancelled_caller_no_other():
    calls = []

    async def request(keys):
        calls.append(keys)
        await asyncio.sleep(0.01)
        if "bad" in keys:
            raise OSError("the scheduler went away")
        return keys

    async def scenario():
        coalesced = Coalesced(request)
        doomed = [asyncio.ensure_future(coalesced(["bad"])), asyncio.ensure_future(coalesced(["x"]))]
        await asyncio.sleep(0)
        meanwhile = asyncio.ensure_future(coalesced(["y"]))
        cancelled = asyncio.ensure_future(coalesced(["z"]))
        await asyncio.sleep(0)
        cancelled.cancel()
        results = await asyncio.gather(*doomed, meanwhile, cancelled, return_exceptions=True)
        return results, await coalesced(["w"])

    (bad, x, y, z), w = asyncio.run(scenario())
    assert isinstance(bad, OSError) and isinstance(x, OSError)
    assert y == ["y", "z"] and isinstance(z, asyncio.CancelledError)
    assert w == ["w"] and calls == [["bad", "x"], ["y", "z"], ["w"]]
