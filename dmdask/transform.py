"""What a `Spec.transform` is given and how it travels: `per_sample`, `transform_context`, pickling."""
from __future__ import annotations

import contextlib
import contextvars
import dataclasses
import pickle
from typing import Callable, Iterator, Optional

import numpy as np

Transform = Callable[[dict], dict]


def per_sample(fn: Callable[[dict], dict]) -> Transform:
    """Turn a per-sample function (dict of one sample's values -> dict) into a batch transform.

    The result is picklable when `fn` is. Samples are stacked with `numpy.stack` when
    they share a shape, else kept as an object array.
    """
    return _PerSample(fn)


class _PerSample:
    def __init__(self, fn):
        self.fn = fn

    def __call__(self, batch: dict) -> dict:
        n = len(batch["index"])
        rows = [self.fn({k: v[i] for k, v in batch.items()}) for i in range(n)]
        out = {}
        for name in rows[0] if rows else batch:
            values = [r[name] for r in rows]
            try:
                out[name] = np.stack(values) if values else batch[name][:0]
            except ValueError:
                arr = np.empty(len(values), dtype=object)
                arr[:] = values
                out[name] = arr
        out.setdefault("index", batch["index"])
        return out


@dataclasses.dataclass(frozen=True)
class TransformContext:
    """What a running `Spec.transform` may know besides its batch: the `epoch` the batch
    belongs to and the spec's `seed` (`dmdask.transform_context()`)."""

    epoch: int
    seed: int


_context: contextvars.ContextVar = contextvars.ContextVar("dmdask_transform_context", default=None)


def transform_context() -> Optional[TransformContext]:
    """The `TransformContext` of the batch being transformed, inside a `Spec.transform`
    that dmdask runs (on a worker, or in the child process of an isolated retry);
    None anywhere else. A transform draws its randomness from it so that, say, a
    random crop is fresh every epoch yet the same when an epoch is resumed::

        def jitter(batch):
            ctx = dmdask.transform_context()
            rng = np.random.default_rng([ctx.seed, ctx.epoch, int(batch["index"][0])])
            ...
    """
    return _context.get()


@contextlib.contextmanager
def using_context(context: Optional[TransformContext]) -> Iterator[None]:
    """Run the enclosed code with `transform_context()` returning `context`."""
    token = _context.set(context)
    try:
        yield
    finally:
        _context.reset(token)


def dumps_transform(fn) -> Optional[bytes]:
    import cloudpickle

    return None if fn is None else cloudpickle.dumps(fn)


def loads_transform(blob: Optional[bytes]):
    return None if blob is None else pickle.loads(blob)
