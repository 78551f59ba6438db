"""The scheduler plugin's handlers (`dmdask.scheduler`): a request and a reply dataclass each,
both sent as `ToPickle` so they keep their types, and `SchedulerAPI`, which sends them. A
handler checks its request once (`Message.check`: by the fields' types and declared ranges,
`dmdask.protocol.message`) before it changes anything. Outcomes that are not errors
(`NoWorkers`, `Busy`) are replies."""
from __future__ import annotations

import dataclasses
import functools
import inspect
from typing import Callable, ClassVar, Dict, List, NamedTuple, Optional, Sequence, Tuple, Type, Union

from distributed.protocol import ToPickle

from .. import arguments as check
from ..internals import reraise
from ..source.base import DatasetInfo, parse_block_key
from .message import Message, checked, ranged

LOCATE_LONGEST = 60.0  # the longest a `Locate` may wait
LOCATE_SECONDS = 2.0  # one wait on the scheduler for blocks still loading
HOLDERS_BLOCKS = 1 << 16  # datasets up to this many blocks: `Ready` can name every block's holder
DESCRIBE_SECONDS = 2.0  # the longest the scheduler waits for a worker's `dmdask_describe` for `Ready`
message = dataclasses.dataclass(frozen=True)


class FileEntry(NamedTuple):
    """What a process read from the store: a folder's `listing` (path: the folder) or a
    file's `info`; `folder` names the store and its options too (`fsid|folder`)."""
    folder: str
    kind: str  # "listing" or "info"
    path: str
    value: Union[list, dict]


def _entries(op: str, name: str, value, kinds=("listing", "info")) -> None:
    check.tuples(op, name, value, 4, leading_texts=3)
    for e in value:
        if not isinstance(e, FileEntry) or e.kind not in kinds or not isinstance(e.value, _VALUES[e.kind]):
            raise check.refuse(op, name, f"FileEntry values of the kinds {kinds}", e)


def _infos(op: str, name: str, value) -> None:
    """Datasets registered lazily when new (`OpenBlocks.datasets`)."""
    if not isinstance(value, (list, tuple)):
        raise check.refuse(op, name, "a list of DatasetInfo", value)
    for info in value:
        check.dataset_info(op, info, lazy=True)


_VALUES = {"listing": (list, tuple), "info": dict}
_PAIRS = functools.partial(check.tuples, width=2, leading_texts=2)  # (folder, path) pairs


@message
class Request(Message):
    op: ClassVar[str]  # the handler's name on the scheduler


@message
class GetOrClaim(Request):
    """The dataset `name` (`Ready`), or the claim to create it (`Claimed`); `host`: its
    `Ready` also names where its blocks held now are, a holder on `host` preferred;
    `client`: the caller's Dask client id, a holder of the dataset from now on (`Release`)."""
    op = "dmdask_get_or_claim"
    name: str
    claimant: str
    host: Optional[str] = None
    client: Optional[str] = None


@message
class Register(Request):
    """Plan the blocks of a claimed dataset (`Registered`, `Busy` or `NoWorkers`): `order`, the
    order they are first needed (None: index order); `lazy`: ready now, each loaded when wanted."""
    op = "dmdask_register"
    name: str
    claimant: str
    info: DatasetInfo
    order: Optional[List[int]] = checked(None, None)  # checked with `info`, below
    lazy: bool = False

    def check(self, op: Optional[str] = None) -> None:
        super().check(op)
        if self.info.name != self.name:
            raise check.refuse(self.op, "info.name", f"the name registered, {self.name!r}", self.info.name)
        if self.lazy:
            check.dataset_info(self.op, self.info, lazy=True)
        check.block_order(self.op, self.order, self.info.num_blocks)


@message
class Submitted(Request):
    """The claimant of dataset `name` submitted `count` of its blocks' loads (in chunks, the
    first of them before the dataset is ready): once the scheduler has them (or after
    `timeout` s), the dataset is ready (`done`: every block submitted); reply `Wanted`.
    `client`: the Dask client id submitting the rest (if it leaves first, the dataset is
    created again at the next open). `ahead` (None: no bound): the reply also waits (up to
    `timeout`) until at most `ahead` of the submitted loads are unfinished, or a rank
    wants a block not submitted yet (`Wanted.room`)."""
    op = "dmdask_submitted"
    name: str
    claimant: str
    count: int = ranged(0, None)
    done: bool = False
    client: Optional[str] = None
    timeout: float = ranged(0, LOCATE_LONGEST, LOCATE_LONGEST)
    ahead: Optional[int] = None


@message
class GetOrRegister(Request):
    """A lazy dataset under `info.name`: `Ready`, else registered now (`Registered`) unless
    another caller creates it (`Busy`) or the cluster has no workers (`NoWorkers`)."""
    op = "dmdask_get_or_register"
    info: DatasetInfo = checked(lambda op, name, value: check.dataset_info(op, value, lazy=True))


@message
class Abandon(Request):
    """Drop the claim of a dataset its holder could not create (no reply)."""
    op = "dmdask_abandon"
    name: str
    claimant: str


@message
class Locate(Request):
    """Where blocks are (`Located`), once each is held or erred or after `timeout` s: keys
    the scheduler does not have are unknown, but keys in `expect` (just submitted by the
    caller) and blocks a live reader claimed are waited for like blocks loading; a holder
    on `host` preferred. `planned`: a block loading now is named with its worker instead."""
    op = "dmdask_locate"
    keys: Sequence[str]
    host: Optional[str] = None
    timeout: float = ranged(0, LOCATE_LONGEST, LOCATE_SECONDS)
    expect: Sequence[str] = ()
    planned: bool = False


@message
class OpenBlocks(Request):
    """A reader's first look at blocks of lazy datasets (`BlocksOpened` or `NoWorkers`):
    `datasets` registered when new, the blocks nobody holds, loads or reads claimed for
    `client`, which reads them from the store and submits their loads."""
    op = "dmdask_open_blocks"
    datasets: Sequence[DatasetInfo] = checked(_infos)
    keys: Sequence[str]
    client: str
    host: Optional[str] = None


@message
class Release(Request):
    """Forget the dataset `name` (True if the registry had it), unless other clients hold it
    (`Held`): only a client that holds it (`GetOrClaim.client`), or any client once none of
    its holders is connected, releases it."""
    op = "dmdask_release"
    name: str
    client: Optional[str] = None


@message
class Datasets(Request):
    """A `DatasetSummary` of each registered dataset."""
    op = "dmdask_datasets"


@message
class Workers(Request):
    """Which of `addresses` are workers of the cluster (a list of them): a worker asks before
    it dials a holder a rank named (`dmdask.worker.peers`)."""
    op = "dmdask_workers"
    addresses: Sequence[str]


@message
class LeftOnPurpose(Request):
    """Whether `worker` left the cluster on purpose (True: it said it was closing, or the
    scheduler retired it) rather than being lost (killed, unreachable): a rank asks before it
    blames a lost worker on the transform it was running."""
    op = "dmdask_left_on_purpose"
    worker: str


@message
class FsMetadata(Request):
    """Share `put`, read from the store by `run`; drop `run`'s claims (`FsClaim`) on the
    (folder, path) of `release` (their reads failed: a missing file); get what `run` read
    of the folders `get` (`Folders`)."""
    op = "dmdask_fs_metadata"
    run: str
    get: Sequence[str] = ()
    put: Sequence[FileEntry] = checked(_entries, ())
    release: Sequence[Tuple[str, str]] = checked(_PAIRS, ())


@message
class FsClaim(Request):
    """(folder, path) of file infos the caller is to read from the store unless `run`
    knows them or another of its processes reads them (`InfoClaims` or `NoWorkers`)."""
    op = "dmdask_fs_claim"
    run: str
    claim: Sequence[Tuple[str, str]] = checked(_PAIRS)


@message
class FsOpenBlocks(Request):
    """`open` and the sharing of the infos read with its blocks (`put`, which ends their
    claims), in one request: `BlocksOpened` or `NoWorkers`."""
    op = "dmdask_fs_open_blocks"
    run: str
    put: Sequence[FileEntry] = checked(functools.partial(_entries, kinds=("info",)))
    open: OpenBlocks


@message
class FsHeld(Request):
    """Blocks that workers placed from a reader's hand-over without a load task each
    (`dmdask_place_blocks`): worker -> block key -> its size in bytes. The scheduler keeps each
    as that worker's data (as Dask keeps scattered data), wanted by its dataset, and ends the
    reader's claims; a block it already has elsewhere stays a replica, one loading elsewhere is
    dropped from that worker. Reply: `BlocksHeld`."""
    op = "dmdask_fs_held"
    held: Dict[str, Dict[str, int]]


@message
class BlocksHeld:
    holders: Dict[str, str]  # key -> a worker holding it (those the scheduler kept)


@message
class ArenaBlocks:
    """Blocks of one dataset a worker holds in one arena: the arena's fields, as each
    block's `ArenaBlock.describe` names them, said once; each block's index and first row
    in the arena, in step."""
    arena: dict
    blocks: List[int]
    first_rows: List[int]


@message
class Layouts:
    """How a process on a worker's host maps blocks the worker holds, as it described them
    (`dmdask_describe`): those in arenas, one `ArenaBlocks` per arena (a few values
    however many blocks); any other by key (None: not mappable, its rows come by request)."""
    arenas: List[ArenaBlocks] = dataclasses.field(default_factory=list)
    files: Dict[str, Optional[dict]] = dataclasses.field(default_factory=dict)

    @classmethod
    def of(cls, described: Dict[str, Optional[dict]]) -> Layouts:
        """From a worker's descriptions of block keys."""
        arenas: Dict[tuple, ArenaBlocks] = {}
        files = {}
        for key, found in described.items():
            parsed = parse_block_key(key)
            if found is None or "arena" not in found or parsed is None:
                files[key] = found
                continue
            files_of_arena = tuple(path for path, *_ in found["arena"].values())
            taken = arenas.setdefault(files_of_arena, ArenaBlocks(found["arena"], [], []))
            taken.blocks.append(parsed[1])
            taken.first_rows.append(found["first_row"])
        return cls(list(arenas.values()), files)


@message
class Ready:
    """The dataset exists: its description, how many of its blocks were held then and, when
    asked (`GetOrClaim.host`) and it has at most `HOLDERS_BLOCKS` blocks, who held which
    and how to map those held on that host, as their workers described them then."""
    info: DatasetInfo
    loaded: int
    holders: Dict[str, List[int]] = dataclasses.field(default_factory=dict)  # worker -> block indices
    layouts: Dict[str, Layouts] = dataclasses.field(default_factory=dict)  # worker on that host -> its blocks'
    # (a worker that did not answer within DESCRIBE_SECONDS left out)


@message
class Claimed:
    """The caller is to list the source, `Register` it and submit its blocks."""


@message
class Registered:
    """Registered now: its blocks are planned, none of them exists yet."""


@message
class Wanted:
    """Blocks of a dataset still being submitted that ranks asked for (`Locate`) before their
    loads were submitted: the claimant submits them next; `room`: `Submitted.ahead` less
    the loads unfinished (below 0: still over, the wait timed out; None: no bound)."""
    blocks: List[int]
    room: Optional[int] = None


@message
class Busy:
    """Another caller holds the claim to create the dataset: ask again (in a moment)."""


@message
class Held:
    """Not released: `clients` other clients connected to the cluster hold the dataset."""
    clients: int


@message
class NoWorkers:
    """The cluster has no workers; nothing was changed."""


@message
class Located:
    holders: Dict[str, str]  # key -> a worker holding it
    erred: Dict[str, BaseException]  # key -> the error of its load
    unknown: List[str]  # keys the scheduler does not have (released, forgotten or never submitted)
    pending: List[str]  # keys still loading when the wait ended
    loading: Dict[str, str]  # `planned`: key -> the worker loading it right now (not waited for)


@message
class BlocksOpened:
    holders: Dict[str, str]  # key -> a worker holding it
    mine: Dict[str, str]  # key -> its planned worker: claimed for the caller, to read and hand over


@message
class FolderEntries:
    listing: Optional[list]  # None: the run did not read it
    infos: Dict[str, dict]  # path -> info


@message
class Folders:
    found: Dict[str, FolderEntries]  # folder -> what the run read of it (folders it read nothing of left out)


@message
class InfoClaims:
    known: Dict[Tuple[str, str], dict]  # (folder, path) -> the info the run read
    elsewhere: List[Tuple[str, str]]  # read by another run only: not claimed (its blocks may be cached)
    probing: List[Tuple[str, str]]  # being read by another process of the run: ask again shortly


@message
class DatasetSummary:
    name: str
    url: Optional[str]
    identity: Optional[str]
    samples: Optional[int]
    blocks: int
    nbytes: Optional[int]
    loaded: int
    erred: int
    ready: bool


def serve(handlers: Dict[Type[Request], Callable]) -> Dict[str, Callable]:
    """Scheduler handlers (op -> handler) that check their request, call `method` with it, reply typed."""

    def one(kind: Type[Request], method: Callable) -> Callable:
        async def handler(request: Request = None, **untyped):
            if untyped or not isinstance(request, kind):
                raise check.refuse(kind.op, "request", f"a {__name__}.{kind.__name__}", request)
            request.check()
            result = method(request)
            return ToPickle(await result if inspect.isawaitable(result) else result)

        return handler

    return {kind.op: one(kind, method) for kind, method in handlers.items()}


class SchedulerAPI:
    """The scheduler plugin's handlers as coroutines of the client's loop (from another
    thread: `client.sync(api.send, request)`). `client`: anything with a `scheduler` rpc."""

    def __init__(self, client):
        self.client = client

    async def send(self, request: Request):
        """`request`'s reply; `HandlerArgumentError` if refused, `OSError` if the connection is lost."""
        reply = await getattr(self.client.scheduler, request.op)(request=ToPickle(request))
        return reply.data if isinstance(reply, ToPickle) else reply  # an inproc comm passes a reply as it is

    async def locate(self, keys: Sequence[str], host: Optional[str], wait: float = LOCATE_SECONDS,
                     expect: Sequence[str] = (), planned: bool = False) -> Located:
        """Where `keys` are (`Locate`); `erred` holds the errors of their loads, ready to raise."""
        found = await self.send(Locate(list(keys), host, wait, list(expect), planned))
        return dataclasses.replace(found, erred={k: reraise(e) for k, e in found.erred.items()})
