"""Transparent mode in one process: its own connection to each cluster it reads through,
shared by file metadata (`fs.metadata`), first reads (`fs.claims`) and range reads (`fs.blocks`).

Guarantees: a process never uses a connection made by another one. A forked child (a
`DataLoader` worker) keeps what its parent knew and makes its own `distributed.Client`;
a spawned one finds the scheduler through `DMDASK_FS_SCHEDULER`.
"""
from __future__ import annotations

import atexit
import logging
import multiprocessing.util
import os
import threading
from collections.abc import Callable

import dask.config
import distributed
from distributed.comm.core import CommClosedError

from ..client.contact import Contact
from ..client.datasets import ensure_plugin
from ..client.gather import Gatherer
from ..client.locate import my_host
from ..errors import DmdaskError, NoClusterError, SchedulerLostError, no_workers, waiting_for_workers
from ..protocol.scheduler import NoWorkers, Request, SchedulerAPI
from ..recovery import Tries
from .blocks import Blocks
from .claims import HANDOVER_EXIT_SECONDS, Claims
from .inside import serving
from .metadata import Metadata

logger = logging.getLogger(__name__)

SCHEDULER_ENV = "DMDASK_FS_SCHEDULER"  # set for child processes: the scheduler their parent read through
EXIT_SECONDS = 2.0  # the most a process's exit waits to report its last hits


class Session:
    """One process's connection to one cluster and its parts; thread-safe (they share `lock`)."""

    def __init__(self, address: str, parent: Session | None = None):
        self.address = address
        self.lock = threading.Lock()
        self.connected: distributed.Client | None = None  # made by `client`, in this process
        self.my_host: str | None = None
        self.gatherer: Gatherer | None = None
        self.contact: Contact | None = None  # the fetch engine's view of the cluster (`dmdask.client.engine`)
        self.metadata = Metadata(self, parent.metadata if parent else None)
        self.claims = Claims(self)
        self.blocks = Blocks(self, parent.blocks.holders if parent else {})
        self._exit_hook = False
        self._said_waiting = False
        self.refused: Exception | None = None  # a worker's NotADmdaskWorker: every later read raises it
        self.borrowed = False  # `connected` is the Dask worker's own client (this process is a worker)

    def check_workers(self) -> None:
        """Raise the `NotADmdaskWorker` a plain Dask worker answered a request of this
        process with (a hand-over of blocks read here): reads through it are not cached."""
        if self.refused is not None:
            raise self.refused

    @property
    def client(self) -> distributed.Client:
        if self.connected is None:
            with self.lock:
                if self.connected is None:
                    connect = dask.config.get("distributed.comm.timeouts.connect")
                    worker = serving()
                    try:
                        if worker is not None and worker.scheduler.address == self.address:
                            client, self.borrowed = worker.client, True  # the worker's own connection
                        else:
                            client = distributed.Client(self.address, set_as_default=False, timeout=connect)
                    except OSError as exc:
                        raise SchedulerLostError(
                            f"dmdask:: cannot reach the scheduler at {self.address} (waited {connect}, "
                            "distributed.comm.timeouts.connect): is the cluster running? Name it with the storage "
                            "option scheduler=ADDRESS or the dask config dmdask.fs.scheduler") from exc
                    ensure_plugin(client)
                    self.my_host = my_host(client)
                    self.gatherer = Gatherer(client, self.my_host, {})
                    self.contact = Contact(client, 0, who=f"dmdask:: (process {os.getpid()})")
                    self.connected = client
                    if not self._exit_hook:
                        self._exit_hook = True
                        # forked and spawned processes of multiprocessing run finalizers, not atexit
                        multiprocessing.util.Finalize(self, self.at_exit, exitpriority=100)
                        atexit.register(self.at_exit)
        return self.connected

    def at_exit(self) -> None:
        """Let the reads ahead under way end, hand over the blocks read here, share the infos
        read here with the run and report the rows taken from workers' files; each bounded in time."""
        client, claims = self.connected, self.claims
        if client is not None:
            claims.wait_read_ahead(HANDOVER_EXIT_SECONDS)
        if client is not None and (claims.to_hand or claims.to_open):
            client.loop.add_callback(claims.hand_over)
        claims.wait_handed_over(HANDOVER_EXIT_SECONDS)
        if self.metadata.to_tell:
            self._best_effort(self.metadata.tell_queued)
        if self.gatherer is not None and self.gatherer.has_hits():
            self._best_effort(self.gatherer.flush_hits)

    def _best_effort(self, call: Callable) -> None:
        """`call()` on the client's loop, given up on failure or after `EXIT_SECONDS`."""
        client = self.connected
        if client is None or client.status != "running":
            return
        try:
            client.sync(call, callback_timeout=EXIT_SECONDS)
        except Exception:  # noqa: BLE001 - an optimisation or counters: never fail an exit
            pass

    def close(self) -> None:
        """Hand over, report the last hits and close the connection."""
        self.at_exit()
        with self.lock:
            client, self.connected = self.connected, None
        if client is not None and not self.borrowed:
            client.close(timeout=EXIT_SECONDS)

    def forget(self) -> None:
        self.metadata.forget()
        self.blocks.located.clear()

    def sync(self, op: str, call: Callable):
        """`call()`'s result (a coroutine function of the scheduler request `op`), waiting at
        most `dmdask.client.recovery-seconds`, then `SchedulerLostError`."""
        client = self.client
        limit = float(dask.config.get("dmdask.client.recovery-seconds"))

        async def checked():
            if client.scheduler is None or client.status != "running":
                raise CommClosedError(f"client status {client.status!r}")
            return await call()

        try:
            return client.sync(checked, callback_timeout=limit)
        except DmdaskError:
            raise
        except (OSError, AttributeError) as exc:  # comms closed, a timeout; AttributeError: scheduler gone meanwhile
            raise SchedulerLostError(
                f"dmdask:: lost the scheduler at {self.address}: {op} got no answer within {limit:.0f} s "
                f"(dmdask.client.recovery-seconds; {type(exc).__name__}: {exc}). Is the scheduler still "
                "running? dmdask.fs.close() drops this process's connection; the next read makes a new one") from exc

    def call(self, request: Request):
        """The scheduler plugin's reply to `request` (see `sync`)."""
        return self.sync(request.op, lambda: SchedulerAPI(self.client).send(request))

    def call_with_workers(self, request: Request):
        """The scheduler plugin's reply to `request`; while it answers `NoWorkers`, waits up to
        `dmdask.client.recovery-seconds` for a worker to join (a warning once per process), then
        `NoWorkersError`."""
        limit = float(dask.config.get("dmdask.client.recovery-seconds"))
        for _ in Tries(limit, pause=0.5):
            reply = self.call(request)
            if not isinstance(reply, NoWorkers):
                return reply
            if not self._said_waiting:
                self._said_waiting = True
                logger.warning("dmdask:: %s", waiting_for_workers(limit, f"the cluster at {self.address}"))
        raise no_workers(limit, f"the cluster at {self.address}")


_sessions: dict[str, Session] = {}
_pid = os.getpid()
_lock = threading.Lock()


def _after_fork() -> None:
    """In a forked child: new locks, and sessions that keep what the parent knew but
    make their own connections."""
    global _lock, _pid
    _lock = threading.Lock()
    _pid = os.getpid()
    for address, parent in list(_sessions.items()):
        _sessions[address] = Session(address, parent)


os.register_at_fork(after_in_child=_after_fork)


def get_session(address: str | None = None) -> Session:
    """This process's session with the cluster at `address` (None: `default_address()`)."""
    if os.getpid() != _pid:  # a fork that did not run the hook (os.fork from C code)
        _after_fork()
    address = address or default_address()
    with _lock:
        found = _sessions.get(address)
        if found is None:
            found = _sessions[address] = Session(address)
        return found


def close() -> None:
    """Close this process's connections to clusters (`dmdask.fs.close`; the next read
    makes new ones). Call it when a cluster it read through is shut down, so that its
    client stops trying to reconnect in the background."""
    with _lock:
        sessions = list(_sessions.values())
        _sessions.clear()
    for found in sessions:
        found.close()


def default_address() -> str:
    """`dmdask.fs.scheduler` from dask config, else (in a Dask worker's process) the worker's
    scheduler, else the default client's scheduler (also put into the environment for
    spawned processes), else the parent process's."""
    configured = dask.config.get("dmdask.fs.scheduler", None)
    if configured:
        return str(configured)
    worker = serving()
    if worker is not None:  # a task on a worker of the cluster: its scheduler
        return worker.scheduler.address
    try:
        address = distributed.default_client().scheduler.address
    except ValueError:
        address = os.environ.get(SCHEDULER_ENV)
        if not address:
            raise NoClusterError(
                "dmdask:: reads through a dmdask cluster: make a distributed.Client first, set the dask config "
                "dmdask.fs.scheduler (or DASK_DMDASK__FS__SCHEDULER), or pass storage option scheduler=ADDRESS"
            ) from None
        return address
    os.environ[SCHEDULER_ENV] = address
    return address
