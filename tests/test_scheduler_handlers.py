"""The scheduler plugin's handlers through `SchedulerAPI`, on `gen_cluster`'s in-process
scheduler and workers: the exact typed reply of each, and the refusal of what a handler
does not take (naming the handler and the field) with the registry left as it was."""
import asyncio
import dataclasses

import pytest
from distributed import Client, Event, LocalCluster, wait
from distributed.comm import get_address_host
from distributed.protocol import ToPickle
from distributed.utils_test import gen_cluster, gen_test

import dmdask
from dmdask.protocol.scheduler import (Abandon, ArenaBlocks, BlocksOpened, Busy, Claimed, DatasetSummary, Datasets,
                                       FileEntry, Folders, FolderEntries, FsClaim, FsMetadata, FsOpenBlocks, GetOrClaim,
                                       GetOrRegister, InfoClaims, Layouts, Locate, NoWorkers, OpenBlocks, Ready,
                                       Register, Registered, Release, SchedulerAPI)
from dmdask.protocol.worker import DescribeRequest, Descriptions, handler
from dmdask.scheduler import DatasetsPlugin
from dmdask.source.base import DatasetInfo

INFO = DatasetInfo(name="fs-x", identity="x", url="/x", fields=("x",), num_samples=10, block_len=5, nbytes=40)
NEW = dataclasses.replace(INFO, name="fs-z", identity="z")  # not in the registry: a refused request registers nothing


def _load_when_told(k):
    if k == 1:
        Event("block-1-comes").wait(timeout=20)
    return k


def _fails():
    raise ValueError("no such block")


async def _api(c):
    await c.register_plugin(DatasetsPlugin())
    return SchedulerAPI(c)


@gen_cluster(client=True)
async def test_get_or_claim_then_register_then_ready_with_the_same_typed_info(c, s, a, b):
    api = await _api(c)
    assert await api.send(GetOrClaim("fs-x", "me")) == Claimed()
    assert await api.send(GetOrClaim("fs-x", "me")) == Claimed()  # its holder asks again before registering
    assert await api.send(Register("fs-x", "you", INFO)) == Busy()
    assert await api.send(Register("fs-x", "me", INFO, order=[1, 0])) == Registered()
    plugin = s.extensions["dmdask"]
    assert plugin.datasets["fs-x"].planned == sorted(s.workers)[::-1]  # block 1 first: on the first worker
    futures = c.map(lambda k: k, [0, 1], key=[INFO.block_key(0), INFO.block_key(1)])
    await wait(futures)
    reply = await api.send(GetOrClaim("fs-x", "other"))
    assert reply == Ready(INFO, 2) and isinstance(reply.info, DatasetInfo) and reply.info.fields == ("x",)
    holders = {}  # asked with a host: who holds which block (and their layouts, see test_first_contact)
    for k in (0, 1):
        holders.setdefault(next(iter(s.tasks[INFO.block_key(k)].who_has)).address, []).append(k)
    # gen_cluster's workers have no `dmdask_describe`: left out of the layouts, the reply still comes
    assert await api.send(GetOrClaim("fs-x", "other", get_address_host(a.address))) == Ready(INFO, 2, holders, {})
    assert await api.send(Datasets()) == [DatasetSummary("fs-x", "/x", "x", 10, 2, 40, 2, 0, True)]
    assert await api.send(Release("fs-x")) is True
    assert await api.send(Release("fs-x")) is False
    assert await api.send(Datasets()) == []


@gen_cluster(client=True)
async def test_the_layouts_of_a_hosts_blocks_are_asked_once_until_a_block_comes_or_goes(c, s, a, b):
    """Ranks of one host opening a dataset, at once or one after the other: each worker is
    asked for its layouts once; a block that comes (or leaves), a release, or a worker that
    did not answer make the next open ask again."""
    asked = []
    x = {"x": ("/dev/shm/x", "<f4", ())}  # every block in one arena, at row 7

    def describing(worker):
        async def describe(request):
            asked.append(worker.address)
            return Descriptions({key: {"arena": x, "first_row": 7} for key in request.keys})
        return handler(DescribeRequest, describe)

    for worker in (a, b):
        worker.handlers["dmdask_describe"] = describing(worker)
    api = await _api(c)
    host = get_address_host(a.address)
    assert await api.send(GetOrClaim("fs-x", "me")) == Claimed()
    assert await api.send(Register("fs-x", "me", INFO)) == Registered()
    go = Event("block-1-comes", client=c)
    first, second = c.map(_load_when_told, [0, 1], key=[INFO.block_key(0), INFO.block_key(1)])  # one graph
    await wait(first)
    plan = s.extensions["dmdask"].datasets["fs-x"].planned  # one block a worker
    expected = {plan[0]: Layouts([ArenaBlocks(x, [0], [7])])}  # blocks of one arena: its fields said once
    replies = await asyncio.gather(*(api.send(GetOrClaim("fs-x", f"rank{r}", host)) for r in range(4)))
    assert [r.layouts for r in replies] == [expected] * 4 and asked == [plan[0]]
    assert (await api.send(GetOrClaim("fs-x", "later", host))).layouts == expected and asked == [plan[0]]
    await go.set()  # block 1 comes: both workers asked again
    await wait(second)
    reply = await api.send(GetOrClaim("fs-x", "after", host))
    assert reply.layouts == {**expected, plan[1]: Layouts([ArenaBlocks(x, [1], [7])])}
    assert sorted(asked) == sorted(plan + [plan[0]])

    async def silent(request):
        raise OSError("no answer")

    plugin = s.extensions["dmdask"]
    plugin.reads.forget_layouts(dataset="fs-x")
    for worker in (a, b):
        worker.handlers["dmdask_describe"] = handler(DescribeRequest, silent)
    assert (await api.send(GetOrClaim("fs-x", "unanswered", host))).layouts == {}
    assert plugin.reads.layouts == {}  # not kept: asked again next time
    for worker in (a, b):
        worker.handlers["dmdask_describe"] = describing(worker)
    assert (await api.send(GetOrClaim("fs-x", "answered", host))).layouts and len(asked) == 5  # a and b
    assert await api.send(Release("fs-x")) is True
    assert plugin.reads.layouts == {}


def test_layouts_name_each_arena_once_and_keep_other_blocks_by_key():
    """`Layouts.of` a worker's descriptions: arena blocks grouped by arena (their fields
    once, each block's index and first row in step); file blocks and blocks not mappable
    (None) by key, as described."""
    a, b = {"x": ["/dev/shm/a.x", "<f4", [3]]}, {"x": ["/dev/shm/b.x", "<f4", [3]]}
    folder = {"path": "/ssd/blk-2", "layout": [], "tier": "ssd"}
    described = {INFO.block_key(4): {"arena": a, "first_row": 10, "start": 40, "tier": "ram"},
                 INFO.block_key(1): {"arena": b, "first_row": 0, "start": 10, "tier": "ram"},
                 INFO.block_key(0): {"arena": a, "first_row": 0, "start": 0, "tier": "ram"},
                 INFO.block_key(2): folder, INFO.block_key(3): None}
    assert Layouts.of(described) == Layouts([ArenaBlocks(a, [4, 0], [10, 0]), ArenaBlocks(b, [1], [0])],
                                            {INFO.block_key(2): folder, INFO.block_key(3): None})


@gen_test()
async def test_replies_come_typed_over_an_inproc_comm_too():
    """An inproc comm unpickles nothing: the reply reaches `SchedulerAPI` as the handler's ToPickle."""
    async with LocalCluster(n_workers=1, processes=False, asynchronous=True, dashboard_address=":0") as cluster, \
            Client(cluster, asynchronous=True) as c:
        api = await _api(c)
        assert c.scheduler.address.startswith("inproc://")
        assert await api.send(GetOrRegister(INFO)) == Registered()
        assert await api.send(Datasets()) == [DatasetSummary("fs-x", "/x", "x", 10, 2, 40, 0, 0, True)]


@gen_cluster(client=True)
async def test_get_or_register_creates_once_and_abandon_hands_the_claim_on(c, s, a, b):
    api = await _api(c)
    assert await api.send(GetOrRegister(INFO)) == Registered()
    assert await api.send(GetOrRegister(INFO)) == Ready(INFO, 0)
    other = dataclasses.replace(INFO, name="fs-y", identity="y")
    assert await api.send(GetOrClaim("fs-y", "me")) == Claimed()
    assert await api.send(GetOrRegister(other)) == Busy()  # being created by a get_or_claim
    await api.send(Abandon("fs-y", "me"))
    assert await api.send(GetOrRegister(other)) == Registered()


@gen_cluster(client=True, nthreads=[])
async def test_a_cluster_without_workers_registers_nothing(c, s):
    api = await _api(c)
    assert await api.send(GetOrRegister(INFO)) == NoWorkers()
    assert await api.send(OpenBlocks([INFO], [INFO.block_key(0)], c.id)) == NoWorkers()
    assert await api.send(FsClaim("run", [("f|d", "d/z")])) == NoWorkers()
    assert await api.send(Datasets()) == []


@gen_cluster(client=True)
async def test_locate_names_holders_errors_and_unknown_keys(c, s, a, b):
    api = await _api(c)
    held, erred = c.submit(lambda: 1, key="held"), c.submit(_fails, key="erred")
    await wait([held, erred])
    found = await api.locate(["held", "erred", "gone"], host=None, wait=0)
    assert found.holders == {"held": next(iter(s.tasks["held"].who_has)).address}
    assert list(found.erred) == ["erred"] and isinstance(found.erred["erred"], ValueError)
    assert str(found.erred["erred"]) == "no such block"
    assert found.unknown == ["gone"] and found.pending == [] and found.loading == {}


@gen_cluster(client=True)
async def test_open_blocks_claims_a_lazy_block_for_one_reader_until_it_leaves(c, s, a, b):
    api = await _api(c)
    keys = [INFO.block_key(0), INFO.block_key(1)]
    async with Client(s.address, asynchronous=True) as reader:
        first = await api.send(OpenBlocks([INFO], keys, reader.id))
        planned = s.extensions["dmdask"].datasets["fs-x"].planned
        assert first == BlocksOpened({}, dict(zip(keys, planned)))
        assert await api.send(OpenBlocks([INFO], keys, c.id)) == BlocksOpened({}, {})
        assert (await api.locate(keys, host=None, wait=0)).pending == keys  # claimed: waited for, not unknown
    # it left without handing them over: the next reader claims them
    assert await api.send(OpenBlocks([INFO], keys[:1], c.id)) == BlocksOpened({}, {keys[0]: planned[0]})


@gen_cluster(client=True)
async def test_file_infos_are_claimed_once_per_run_and_shared_with_their_first_blocks(c, s, a, b):
    api = await _api(c)
    claim = FsClaim("run-1", [("f|d", "d/z")])
    assert await api.send(claim) == InfoClaims({}, [], [])  # the caller reads it
    assert await api.send(claim) == InfoClaims({}, [], [("f|d", "d/z")])  # another process waits
    info = {"size": 7, "mtime": 1.0}
    opened = await api.send(FsOpenBlocks("run-1", [FileEntry("f|d", "info", "d/z", info)],
                                         OpenBlocks([INFO], [INFO.block_key(0)], c.id)))
    assert opened == BlocksOpened({}, {INFO.block_key(0): s.extensions["dmdask"].datasets["fs-x"].planned[0]})
    assert await api.send(claim) == InfoClaims({("f|d", "d/z"): info}, [], [])
    assert await api.send(FsClaim("run-2", [("f|d", "d/z")])) == InfoClaims({}, [("f|d", "d/z")], [])
    listing = [{"name": "d/z", "size": 7}]
    assert await api.send(FsMetadata("run-2", put=[FileEntry("f|d", "listing", "d", listing)])) == Folders({})
    assert await api.send(FsMetadata("run-2", get=["f|d", "f|e"])) == Folders({"f|d": FolderEntries(listing, {})})
    assert await api.send(FsMetadata("run-1", get=["f|d"])) == Folders({"f|d": FolderEntries(None, {"d/z": info})})


@gen_cluster(client=True)
async def test_a_released_claim_lets_the_next_reader_read_at_once(c, s, a, b):
    """A claimant whose read failed (a missing file) releases its claim: the next process
    of the run claims it at once, not after PROBE_SECONDS."""
    api = await _api(c)
    claim = FsClaim("run-1", [("f|d", "d/missing")])
    assert await api.send(claim) == InfoClaims({}, [], [])
    assert await api.send(claim) == InfoClaims({}, [], [("f|d", "d/missing")])
    assert await api.send(FsMetadata("run-1", release=[("f|d", "d/missing"), ("f|e", "e/never")])) == Folders({})
    assert await api.send(claim) == InfoClaims({}, [], [])  # claimed again, by this caller


BAD = [  # (request, the field its refusal names)
    (GetOrClaim(None, "me"), "name"),
    (GetOrClaim("fs-x", ""), "claimant"),
    (Register("fs-x", "me", dataclasses.replace(INFO, num_samples=-1)), "info.num_samples"),
    (Register("fs-x", "me", dataclasses.replace(INFO, block_len=0)), "info.block_len"),
    (Register("fs-x", "me", dataclasses.replace(INFO, fields="x")), "info.fields"),
    (Register("fs-x", "me", dataclasses.replace(INFO, nbytes=-5)), "info.nbytes"),
    (Register("fs-x", "me", dataclasses.replace(INFO, identity="")), "info.identity"),
    (Register("fs-x", "me", {"name": "fs-x"}), "info"),
    (Register("fs-x", "me", dataclasses.replace(INFO, field_types=(("y", "<i8", ()),))), "info.field_types"),
    (Register("fs-x", "me", dataclasses.replace(INFO, field_types=(("x", "no-dtype", ()),))), "info.field_types"),
    (Register("fs-x", "me", dataclasses.replace(INFO, field_types=(("x", "<i8", (-1,)),))), "info.field_types"),
    (Register("fs-x", "me", dataclasses.replace(INFO, field_types=())), "info.field_types"),
    (Register("fs-x", "me", INFO, order=[0, 0]), "order"),
    (Register("fs-x", "me", INFO, order=["a", "b"]), "order"),
    (Register("fs-x", "me", INFO, lazy="yes"), "lazy"),
    (GetOrRegister(dataclasses.replace(INFO, num_samples="10")), "info.num_samples"),
    # a registry entry bound to its source: another dataset's blocks under this name, a name not its own
    (Register("fs-x", "me", dataclasses.replace(INFO, identity="y")), "info.identity"),
    (Register("fs-x", "me", dataclasses.replace(INFO, name="fs-y", identity="y")), "info.name"),
    (Register("fs-x", "me", dataclasses.replace(INFO, name="ds-x"), lazy=True), "info.name"),
    (GetOrRegister(dataclasses.replace(INFO, name="ds-x")), "info.name"),  # only a file's dataset is lazy
    (OpenBlocks([NEW, dataclasses.replace(INFO, name="ds-x")], [], "c"), "info.name"),
    (GetOrRegister(dataclasses.replace(NEW, num_samples=10 ** 18)), "info.num_samples"),
    (GetOrRegister(dataclasses.replace(NEW, num_samples=3 * 10 ** 7, block_len=1)), "info.num_samples"),
    (GetOrRegister(dataclasses.replace(NEW, nbytes=2 ** 64)), "info.nbytes"),
    (Locate("dmdask-block-x-0"), "keys"),
    (Locate(["dmdask-block-x-0"], timeout=10 ** 9), "timeout"),
    (Locate(["dmdask-block-x-0"], timeout=-1), "timeout"),
    (Locate(["dmdask-block-x-0"], expect=[7]), "expect"),
    (OpenBlocks([NEW, dataclasses.replace(INFO, block_len=-1)], [], "c"), "info.block_len"),
    (OpenBlocks("fs-x", [], "c"), "datasets"),
    (OpenBlocks([INFO], "k", "c"), "keys"),
    (Release(7), "name"),
    (FsClaim("r", "x"), "claim"),
    (FsClaim("r", [("folder",)]), "claim"),
    (FsClaim("r", [("folder", 7)]), "claim"),
    (FsMetadata("r", put=[["f|d", "info", "d/z", {}]]), "put"),  # a list, not a FileEntry
    (FsMetadata("r", put=[FileEntry("f|d", "info", "d/z", 5)]), "put"),
    (FsMetadata("r", release=[("f|d",)]), "release"),
    (FsOpenBlocks("r", [FileEntry("f|d", "listing", "d/z", [])], OpenBlocks([NEW], [NEW.block_key(0)], "c")), "put"),
    (FsOpenBlocks("r", [FileEntry("f|d", "info", "d/z", {})], OpenBlocks([NEW], "k", "c")), "keys"),
    (FsOpenBlocks("r", [], None), "open"),
]


@gen_cluster(client=True)
async def test_handlers_refuse_what_they_do_not_take_and_change_nothing(c, s, a, b):
    api = await _api(c)
    assert await api.send(GetOrClaim("fs-x", "me")) == Claimed()
    for request, field in BAD:
        with pytest.raises(dmdask.HandlerArgumentError) as refused:
            await api.send(request)
        assert str(refused.value).startswith(f"{request.op}: {field}="), (request, str(refused.value))
    with pytest.raises(dmdask.HandlerArgumentError, match="dmdask_locate: request=.* expected a .*Locate"):
        await c.scheduler.dmdask_locate(request=ToPickle(Release("fs-x")))
    with pytest.raises(dmdask.HandlerArgumentError, match="dmdask_release: request=None"):
        await c.scheduler.dmdask_release(name="fs-x")  # the untyped call of before
    plugin = s.extensions["dmdask"]
    assert list(plugin.datasets) == ["fs-x"] and plugin.datasets["fs-x"].info is None  # still only claimed
    assert plugin.reads.claims == {} and len(plugin.files.folders) == 0
    await api.send(Abandon("fs-x", "me"))
    assert await api.send(Datasets()) == []


@gen_cluster(client=True)
async def test_submitted_makes_the_dataset_ready_and_names_the_blocks_ranks_waited_for(c, s, a, b):
    """A claimant's first chunk (block 0 of 2) in: ready, still submitting; a rank locating
    block 1 (not submitted) waits for it and it is named `Wanted`; once submitted, found.
    A bad count is refused naming the field; a stranger's `Submitted` answers `Busy`."""
    from dmdask.protocol.scheduler import Submitted, Wanted

    api = await _api(c)
    assert await api.send(GetOrClaim("fs-x", "me", client=c.id)) == Claimed()
    assert await api.send(Register("fs-x", "me", INFO)) == Registered()
    first = c.map(lambda k: k, [0], key=[INFO.block_key(0)])
    assert await api.send(Submitted("fs-x", "me", 1, client=c.id)) == Wanted([])
    ready = await asyncio.wait_for(api.send(GetOrClaim("fs-x", "other")), 5)  # ready: no wait for block 1
    assert isinstance(ready, Ready) and ready.info == INFO
    found = await api.locate([INFO.block_key(1)], None, wait=0.2)
    assert found.unknown == [] and found.pending == [INFO.block_key(1)]  # waited for, not unknown
    assert await api.send(Submitted("fs-x", "me", 1, client=c.id)) == Wanted([1])
    second = c.map(lambda k: k, [1], key=[INFO.block_key(1)])
    assert await api.send(Submitted("fs-x", "me", 2, done=True, client=c.id)) == Wanted([])
    found = await api.locate([INFO.block_key(1)], None, wait=10)
    assert list(found.holders) == [INFO.block_key(1)]
    assert await api.send(Submitted("fs-x", "stranger", 2)) == Busy()
    with pytest.raises(Exception, match="count"):
        await api.send(Submitted("fs-x", "me", -1))
    del first, second


@gen_cluster(client=True)
async def test_submitted_with_ahead_waits_until_few_enough_loads_are_unfinished(c, s, a, b):
    """Both blocks submitted, block 1's load held: `Submitted` with `ahead` 0 answers after
    its timeout that one load too many is unfinished (room -1), and, asked again, as soon as
    block 1 is loaded (room 0), long before its timeout; without `ahead`, no room named."""
    from dmdask.protocol.scheduler import Submitted, Wanted

    api = await _api(c)
    assert await api.send(GetOrClaim("fs-x", "me", client=c.id)) == Claimed()
    assert await api.send(Register("fs-x", "me", INFO)) == Registered()
    loads = c.map(_load_when_told, [0, 1], key=[INFO.block_key(0), INFO.block_key(1)])
    await loads[0]
    assert await api.send(Submitted("fs-x", "me", 2, done=True, client=c.id, ahead=0, timeout=0.5)) == Wanted([], -1)
    waiting = asyncio.ensure_future(api.send(Submitted("fs-x", "me", 2, done=True, client=c.id, ahead=0, timeout=30)))
    await asyncio.sleep(0.2)
    assert not waiting.done()
    await Event("block-1-comes", client=c).set()
    assert await asyncio.wait_for(waiting, 20) == Wanted([], 0)
    assert await api.send(Submitted("fs-x", "me", 2, done=True, client=c.id)) == Wanted([])
    del loads
