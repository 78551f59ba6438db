"""The workers' handlers (`dmdask.worker.plugin`) and their typed messages
(`dmdask.protocol.worker`), called with injected parts (a cache, peers) where a cluster
isn't the point, and the plugin's installation through `gen_cluster`."""
import asyncio
import re
import types
from concurrent.futures import ThreadPoolExecutor

import numpy as np
import pytest
from distributed.comm.core import CommClosedError
from distributed.core import Status
from distributed.protocol.serialize import Serialize
from distributed.utils_test import gen_cluster

import dmdask
from dmdask.protocol.rows import RowChannels, asked_of
from dmdask.protocol.worker import (Batches, BatchRequest, Channel, DescribeRequest, HitsReport, Missing, Moved,
                                    WorkerAPI, handler, to_wire)
from dmdask.scheduler import DatasetsPlugin
from dmdask.spec import dumps_transform
from dmdask.worker.cache import BlockCache
from dmdask.worker.holdings import Block, FileBlock
from dmdask.worker.plugin import WorkerPlugin

ME, PEER = "tcp://me:1", "tcp://peer:2"


def block(start, n):
    return Block({"x": np.arange(start, start + n, dtype=np.int64) * 10}, start, start + n)


class Cache:
    """The parts of a `BlockCache` the handlers use: `serve` over a dict of blocks."""

    def __init__(self, blocks):
        self.blocks, self.served = blocks, []
        self.peer_bytes_out = self.peer_bytes_in = 0
        self.transforms = ThreadPoolExecutor(1)
        self.store = types.SimpleNamespace(shared_folder=lambda: None)

    async def serve(self, requests, priority, wait):
        self.served.append((sorted(requests), priority, wait))
        missing = [k for k in requests if k not in self.blocks]
        if missing:
            raise Moved(missing)
        taken = [self.blocks[k].take(np.asarray(rows)) for k, rows in requests.items()]
        return {"x": np.concatenate([t["x"] for t in taken])}, 1


class Channels:
    """The other workers' row channels (`RowChannels.fetch`) over a dict of blocks."""

    def __init__(self, blocks):
        self.cache, self.asked = Cache(blocks), []

    async def fetch(self, executor, address, asked):
        self.asked.append((address, asked))
        wanted = {key: asked.rows[asked.blocks == b] for b, key in enumerate(asked.keys)}
        return await self.cache.serve(wanted, asked.priority, asked.wait)  # Moved for blocks not held


def delivered(request) -> dict:
    """`request` as a handler receives it: its wire form, deserialised."""
    return {k: v.data if isinstance(v, Serialize) else v for k, v in to_wire(request).items()}


def plugin(mine, theirs):
    p = WorkerPlugin()
    p.cache, p.address, p.channels = Cache(mine), ME, Channels(theirs)
    return p


def group_request(**more):
    # samples 0..5 of block a (held here) and 10..15 of block b (held by the peer), interleaved
    return BatchRequest(requests={ME: {"a": np.array([4, 0, 2])}, PEER: {"b": np.array([1, 3])}},
                        positions={ME: np.array([0, 2, 4]), PEER: np.array([1, 3])},
                        index=np.array([4, 11, 0, 13, 2]), sizes=[2, 3], fields=["x"], priority=7, wait=1.5, **more)


def test_batch_puts_rows_of_every_holder_in_place_and_splits_the_batches():
    p = plugin({"a": block(0, 5)}, {"b": block(10, 5)})
    reply = asyncio.run(p.batch(group_request(extra={"source": np.array([0, 1, 0, 1, 0])})))
    assert isinstance(reply, Batches) and reply.from_store == 2 and reply.error is None and reply.shared is None
    assert [b["x"].tolist() for b in reply.batches] == [[40, 110], [0, 130, 20]]
    assert [b["index"].tolist() for b in reply.batches] == [[4, 11], [0, 13, 2]]
    assert [b["source"].tolist() for b in reply.batches] == [[0, 1], [0, 1, 0]]
    assert list(reply.batches[0]) == ["x", "source", "index"]
    assert p.cache.served == [(["a"], 7.0, 1.5)]  # its own rows without a request
    (address, asked), = p.channels.asked
    assert address == PEER and asked.keys == ["b"] and asked.rows.tolist() == [1, 3]
    assert (asked.priority, asked.wait) == (7, 1.5)
    assert p.cache.peer_bytes_in == 16


def test_batch_runs_the_transform_and_reports_blocks_a_holder_lacks():
    p = plugin({"a": block(0, 5)}, {"b": block(10, 5)})
    transform = dumps_transform(lambda batch: {"y": batch["x"] + 1})
    reply = asyncio.run(p.batch(group_request(transform=transform)))
    assert [b["y"].tolist() for b in reply.batches] == [[41, 111], [1, 131, 21]]
    p = plugin({"a": block(0, 5)}, {})  # the peer let block b go
    assert asyncio.run(p.batch(group_request())) == Missing(["b"])


def test_a_request_that_reaches_a_closing_worker_is_a_lost_worker():
    """While the worker closes, a request whose work can no longer be handed to its threads
    (shut down) fails as a lost worker (CommClosedError), which the rank recovers from; while
    it runs, the same RuntimeError is the caller's to see."""
    p = plugin({"a": block(0, 5)}, {"b": block(10, 5)})
    p.worker = types.SimpleNamespace(status=Status.running)
    handle = p._lost_once_closed(p.batch)
    request = group_request(transform=dumps_transform(lambda batch: {"y": batch["x"] * 2}))
    p.cache.transforms.shutdown()
    with pytest.raises(RuntimeError, match="after shutdown"):
        asyncio.run(handle(request))
    p.worker.status = Status.closing
    with pytest.raises(CommClosedError, match=f"worker {ME} is closing"):
        asyncio.run(handle(request))


def test_describe_and_count_hits(tmp_path):
    held = FileBlock.write(str(tmp_path), block(0, 5), "ssd")
    hits = []
    p = WorkerPlugin()
    p.cache = types.SimpleNamespace(store=_Store({"a": block(0, 5), "b": held, "other": 3}, hits))
    described = p.describe(DescribeRequest(["a", "b", "other", "not-held"])).blocks
    assert described == {"a": None, "b": held.describe(), "other": None}
    assert described["b"]["path"] == held.path
    held.release()  # its files gone: rows come through the worker, which reads it again
    assert p.describe(DescribeRequest(["b"])).blocks == {"b": None}
    p.count_hits(HitsReport({"ram": [2, 16], "ssd": [1, 8]}))
    assert hits == [("ram", 2, 16), ("ssd", 1, 8)]


class _Store(dict):
    def __init__(self, items, hits):
        super().__init__(items)
        self.hits = hits

    def count_hit(self, *args):
        self.hits.append(args)


@pytest.mark.parametrize("request_, name", [
    (BatchRequest({}, {}, np.zeros(0, int), [], [], wait=60), "wait="),
    (BatchRequest({}, {}, np.zeros(0, int), [], [], priority=-1), "priority="), (DescribeRequest("k"), "keys="),
    (HitsReport({"ram": [1, -1]}), "hits['ram'] bytes="), (HitsReport({"gpu": [1, 1]}), "unknown: ['gpu']")])
def test_a_handler_refuses_a_bad_field_by_name(request_, name):
    called = []
    handle = handler(type(request_), called.append)
    with pytest.raises(dmdask.HandlerArgumentError, match="dmdask_") as info:
        asyncio.run(handle(**delivered(request_)))
    assert name in str(info.value) and not called


def test_a_handler_refuses_what_is_not_its_request():
    handle = handler(BatchRequest, lambda request: None)
    with pytest.raises(dmdask.HandlerArgumentError, match="message=None"):
        asyncio.run(handle(msg={"k": [0]}))  # the dicts of before
    with pytest.raises(dmdask.HandlerArgumentError, match="message='DescribeRequest'"):
        asyncio.run(handle(**delivered(DescribeRequest(["k"]))))


@gen_cluster(client=True, Worker=dmdask.Worker, nthreads=[("127.0.0.1", 1)],
             worker_kwargs={"ram": "1 MiB", "ssd": 0, "shm_dir": ""})
async def test_the_scheduler_plugin_installs_the_worker_plugin(c, s, a):
    assert "dmdask_batch" not in a.handlers and "dmdask" not in a.extensions  # only tiers until then
    # which its metric reports from the start: the scheduler reads a joining worker's room there
    assert a.metrics["dmdask"](a)["ram"]["capacity"] == 2**20 and a.metrics["dmdask"](a)["peer"]["bytes_in"] == 0
    await c.register_plugin(DatasetsPlugin())
    assert isinstance(a.extensions["dmdask"], BlockCache)
    ops = {"dmdask_channel", "dmdask_batch", "dmdask_describe", "dmdask_count_hits", "dmdask_hand_over"}
    assert ops <= set(a.handlers)
    workers = WorkerAPI(c.rpc)
    channel = await workers.channel(a.address)
    assert isinstance(channel, Channel) and channel.host == "127.0.0.1" and len(channel.secret) == 32
    channels = RowChannels(workers, None, 10)
    with pytest.raises(Moved) as info:
        await channels.fetch(None, a.address, asked_of({"dmdask-block-x-0": np.array([0])}))
    assert info.value.keys == ["dmdask-block-x-0"]
    assert await workers.describe(a.address, ["dmdask-block-x-0"]) == {}
    await workers.count_hits(a.address, {"ram": [3, 24]})
    assert a.extensions["dmdask"].stats()["ram"]["hits"] == 3
    cache = a.extensions["dmdask"]
    await a.plugin_add(WorkerPlugin(), name="dmdask")  # as a new scheduler adds it again
    assert a.extensions["dmdask"] is cache and cache.stats()["ram"]["hits"] == 3  # the same cache, still open
    assert await cache.in_thread(0, sum, [1, 2]) == 3


def test_scheduler_and_worker_messages_are_checked_by_one_base_from_their_type_hints():
    """Both sides' requests derive from `dmdask.protocol.message.Message`; fields are checked
    from `typing.get_type_hints` (a field typed `int` raised KeyError 'int' when the
    scheduler's checks looked up the annotation's text), with ranges declared with the field;
    a type with no check must declare one."""
    import dataclasses
    from typing import Optional

    from dmdask.errors import HandlerArgumentError
    from dmdask.protocol import scheduler, worker
    from dmdask.protocol.message import Message, checked, ranged

    assert issubclass(scheduler.Request, Message) and issubclass(worker.Message, Message)

    @dataclasses.dataclass(frozen=True)
    class Probe(Message):
        op = "dmdask_probe"
        count: int
        share: float = ranged(0, 1, 0.5)
        name: Optional[str] = None
        ids: list[int] = dataclasses.field(default_factory=list)
        blobs: dict[str, bytes] = dataclasses.field(default_factory=dict)

    Probe(3, 0.25, "x", [0, 7], {"a": b"1"}).check()
    for bad, field in ((Probe(-1), "count"), (Probe(True), "count"), (Probe(1, 1.5), "share"),
                       (Probe(1, float("nan")), "share"), (Probe(1, name=""), "name"),
                       (Probe(1, ids=[1, -2]), "ids[1]"), (Probe(1, blobs={"a": "text"}), "blobs['a']")):
        with pytest.raises(HandlerArgumentError, match=re.escape(f"dmdask_probe: {field}=")):
            bad.check()

    @dataclasses.dataclass
    class Unchecked(Message):
        where: complex

    with pytest.raises(TypeError, match="Unchecked.where: no check"):
        Unchecked(1j).check()

    @dataclasses.dataclass
    class Declared(Message):
        where: complex = checked(None)

    Declared(1j).check()
    # the worker's ranges come from their fields: wait in 0..MAX_WAIT
    with pytest.raises(HandlerArgumentError, match=r"dmdask_give_rows: wait="):
        worker.GiveRows({}, {}, "claim", wait=worker.MAX_WAIT + 1).check()
    with pytest.raises(HandlerArgumentError, match=r"dmdask_locate: timeout="):
        scheduler.Locate(["k"], timeout=scheduler.LOCATE_LONGEST + 1).check()


def test_block_layouts_are_typed_and_a_malformed_one_is_not_mapped():
    """`dmdask_describe`'s answers (a file block's folder and layout, an arena block's files and
    rows) are checked where they are received (`WorkerAPI.describe`): one of another shape is
    None, as for a block in no file (its rows then come by request)."""
    from dmdask.protocol.worker import read_layout

    files = {"path": "/dev/shm/b0", "layout": [["x", "fixed", "<f4", [4]], ["data", "ragged", "|u1", [90]]],
             "tier": "ram"}
    arena = {"arena": {"x": ["/dev/shm/ds.x", "<f4", [4]], "__id__": ["/dev/shm/ds.id", "<i8", []]},
             "first_row": 128, "start": 64, "tier": "ram"}
    assert read_layout(files) is files and read_layout(arena) is arena
    for bad in (None, {"path": "/x"}, dict(files, layout=[["x", "weird", "<f4", [4]]]),
                dict(files, layout=[["x", "fixed", "<f4", [-1]]]), dict(files, extra=1),
                dict(arena, first_row=-1), dict(arena, arena={"x": ["", "<f4", [4]]}), dict(arena, start="0")):
        assert read_layout(bad) is None, bad

