"""Applying `Spec.transform` on a worker, in its transform threads or in a child process.

The batches' `TransformContext` is set around each call (`dmdask.transform_context()`).
Every failure of the transform (any BaseException) is a `TransformError`, never an
OSError a client would take for a lost worker.
"""
from __future__ import annotations

import contextlib
import os
import pickle
import subprocess
import sys

from ..errors import TransformError
from ..spec import TransformContext, loads_transform, using_context


def transform_in_order(transform, batches: list, context: TransformContext | None = None) -> tuple:
    """(transformed batches, None), or those before the first that failed and its
    `TransformError`: the batches before a failure are still delivered."""
    done = []
    for batch in batches:
        try:
            done.append(_apply(transform, batch, context))
        except TransformError as exc:
            return done, exc
    return done, None


def describe_samples(batch: dict) -> str:
    index = batch["index"]
    return f"{index[:4].tolist()}{'...' if len(index) > 4 else ''} ({len(index)} samples)"


def _apply(transform, batch: dict, context: TransformContext | None = None) -> dict:
    try:
        with using_context(context):
            out = transform(batch)
    except BaseException as exc:  # SystemExit too; never mistaken for a lost worker (an OSError) by the client
        raise TransformError(f"Spec.transform failed on the batch of samples {describe_samples(batch)}: "
                             f"{type(exc).__name__}: {exc}") from exc
    if not isinstance(out, dict):
        raise TransformError(f"Spec.transform must return a dict of arrays, got {type(out).__name__} on the "
                             f"batch of samples {describe_samples(batch)}")
    out.setdefault("index", batch["index"])
    return out


def transform_isolated(blob: bytes, batches: list[dict], context: TransformContext | None = None) -> tuple:
    """`transform_in_order` in a child process, for a group whose previous try lost a
    worker (the transform may have killed it): a batch the child dies on gets a
    `TransformError` and the worker lives on. The child is a plain subprocess (`main()`,
    the worker's `sys.path`: Dask workers are daemonic, and multiprocessing lets those
    have no children); nothing is left behind."""
    env = dict(os.environ, PYTHONPATH=os.pathsep.join(p for p in sys.path if p))
    child = subprocess.Popen([sys.executable, "-c", "from dmdask.worker.transforms import main; main()"],
                             stdin=subprocess.PIPE, stdout=subprocess.PIPE, env=env)
    done: list = []
    try:
        with contextlib.suppress(BrokenPipeError):  # the child died: its exit code tells why
            pickle.dump((blob, batches, context), child.stdin, protocol=pickle.HIGHEST_PROTOCOL)
            child.stdin.close()
        while len(done) < len(batches):
            try:
                out, error = pickle.load(child.stdout)
            except (EOFError, pickle.UnpicklingError):
                code = child.wait()
                return done, TransformError(
                    f"Spec.transform killed its process (exit code {code}: os._exit, a crash, out of memory?) on "
                    f"the batch of samples {describe_samples(batches[len(done)])}; the batch is not retried")
            if error is not None:
                return done, error
            done.append(out)
        return done, None
    finally:
        if child.poll() is None:
            child.kill()
        child.wait()
        child.stdout.close()


def main() -> None:
    """The child: read (transform, batches, context) from stdin, write each result to stdout."""
    blob, batches, context = pickle.load(sys.stdin.buffer)
    out = sys.stdout.buffer
    sys.stdout = sys.stderr  # the transform's prints must not corrupt the results
    transform = loads_transform(blob)
    for batch in batches:
        done, error = transform_in_order(transform, [batch], context)
        pickle.dump((done[0] if done else None, error), out, protocol=pickle.HIGHEST_PROTOCOL)
        out.flush()
        if error is not None:
            return
