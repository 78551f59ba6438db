"""dmdask's errors; each also subclasses the builtin a caller would catch."""
from __future__ import annotations

import re

_URL = re.compile(r"([A-Za-z][A-Za-z0-9+.\-]*://)([^\s'\"<>]*)")


def redact(text: str) -> str:
    """`text` with what may be a credential left out of every URL in it: a user and password
    (`user:password@`) and a query string (a presigned URL's signature), which becomes `?...`."""
    def one(match: re.Match) -> str:
        authority, slash, rest = match.group(2).partition("/")
        rest, query, _ = rest.partition("?")
        if not slash:
            authority, query, _ = authority.partition("?")
        return f"{match.group(1)}{authority.rsplit('@', 1)[-1]}{slash}{rest}{'?...' if query else ''}"

    return _URL.sub(one, text)


class DmdaskError(Exception):
    """Base of every error dmdask raises on purpose. Every subclass pickles (a worker's error
    reaches the client): it is rebuilt from its message and attributes, not its `__init__`.
    Its message never holds a URL's credentials (`redact`)."""

    def __init__(self, *args):
        super().__init__(*(redact(a) if isinstance(a, str) else a for a in args))

    def __reduce__(self):
        return (_rebuild, (type(self), self.args, dict(self.__dict__)))


def _rebuild(cls, args, state):
    err = cls.__new__(cls, *args)
    err.args = args
    err.__dict__.update(state)
    return err


class SpecError(DmdaskError, ValueError):
    """A field of a `Spec`, or a capacity, has a value outside its allowed range."""

    def __init__(self, field: str, allowed: str, value):
        self.field = field
        super().__init__(f"{field}={value!r} is invalid: expected {allowed}")


class SourceNotFoundError(DmdaskError, FileNotFoundError):
    """The dataset URL does not exist or holds nothing dmdask can read."""


class SourceError(DmdaskError, ValueError):
    """The dataset exists but its layout cannot be used (say, arrays of unequal length)."""


class BlockReadError(DmdaskError, OSError):
    """A block could not be read or decoded from the shared store (nothing cached is affected);
    the message names the URL and the sample range (and `detail`, such as the retries made)."""

    def __init__(self, url: str, block: int, start: int, stop: int, cause: BaseException, detail: str = ""):
        self.url, self.block, self.start, self.stop = redact(url), block, start, stop
        super().__init__(
            f"cannot read block {block} (samples {start}..{stop - 1}) of {url}{detail}: "
            f"{type(cause).__name__}: {cause}"
        )


class TransformError(DmdaskError, RuntimeError):
    """`Spec.transform` raised on a worker; the message names the batch's first samples."""


class NotADmdaskWorker(DmdaskError, RuntimeError):
    """The cluster's workers do not carry dmdask's tiers."""


def plain_worker(address: str) -> NotADmdaskWorker:
    """The error of a dmdask request (a task, a handler) that reached worker `address`,
    which has no dmdask tiers (a plain Dask worker)."""
    return NotADmdaskWorker(
        f"worker {address} has no dmdask tiers (a plain Dask worker): start the cluster's workers with "
        "`dask worker SCHEDULER --worker-class dmdask.Worker` (or `dask worker SCHEDULER --nanny-class dmdask.Nanny "
        "--worker-class dmdask.Worker`), or use dmdask.LocalCluster")
class DatasetHeldError(DmdaskError, PermissionError):
    """`dmdask.release` of a dataset that other connected clients opened, from a client that did not."""


class WorkerKilledError(DmdaskError, RuntimeError):
    """Workers died while they loaded a block (Dask's `KilledWorker`); the message names
    the block, the likely cause (out of memory) and the evidence the workers reported."""


class NoWorkersError(NotADmdaskWorker):
    """The cluster had no workers for longer than `dmdask.client.recovery-seconds`."""


_START_WORKERS = "`dask worker SCHEDULER --worker-class dmdask.Worker`"


def no_workers(seconds: float, cluster: str = "the cluster") -> NoWorkersError:
    """The error of a wait for workers that lasted `seconds` in vain."""
    return NoWorkersError(f"{cluster} has had no workers for {seconds:.0f} s (dmdask.client.recovery-seconds): "
                          f"start {_START_WORKERS} on the nodes")


def waiting_for_workers(seconds: float, cluster: str = "the cluster") -> str:
    """What a wait for workers logs once, as it starts."""
    return (f"{cluster} has no workers: waiting up to {seconds:.0f} s (dmdask.client.recovery-seconds) for "
            f"dmdask workers to join ({_START_WORKERS})")


class SchedulerLostError(DmdaskError, ConnectionError):
    """The client lost its scheduler for longer than `dmdask.client.scheduler-seconds`;
    resume from the last `state_dict()` once a scheduler runs again."""


class NoClusterError(DmdaskError, RuntimeError):
    """Transparent mode (`dmdask::`) found no cluster to read through."""


class SourceNotAllowedError(DmdaskError, ValueError):
    """A source outside the workers' `dmdask.worker.allowed-sources` (the message names
    the URL and the allowed prefixes). A `ValueError` like `SpecError`: bad input, never
    retried (an `OSError` would read as a lost worker)."""


class HandlerArgumentError(DmdaskError, ValueError):
    """A request to one of dmdask's scheduler or worker handlers had an argument of the
    wrong type, outside its range, or unknown; the request changed nothing."""
