"""One training rank in a process of its own, for tests and benchmarks that pause or kill
cluster processes around it (tests/test_paused.py, benchmarks/faults.py):

    python -m dmdask.testing.rank_process SCHEDULER SOURCE RANK WORLD EPOCH BATCH STEP_SECONDS OUT

The source is a `write_zarr` dataset: every batch's "x" is checked against `zarr_sample`
of its ids. It sleeps STEP_SECONDS per batch (a training step), writes the number of
batches delivered so far to OUT.count after each, and at the end the epoch's sample ids
to OUT (.npy) and its seconds (from the iterator's creation to its end) to OUT.seconds;
an error goes to stderr, exit status 1. Settings come from the environment (`DASK_DMDASK__...`).
"""
import sys
import time

import distributed
import numpy as np

import dmdask
from dmdask.testing.datasets import zarr_sample


def main(scheduler, source, rank, world, epoch, batch, step, out) -> None:
    ids = []
    with distributed.Client(scheduler, timeout=60) as client:
        spec = dmdask.Spec(source, batch_size=int(batch), seed=11, rank=int(rank), world_size=int(world))
        started = time.perf_counter()
        for b in dmdask.batches(client, spec, epoch=int(epoch)):
            np.testing.assert_array_equal(b["x"], zarr_sample(b["index"], b["x"].shape[1:]))
            ids.append(b["index"])
            with open(out + ".count", "w") as f:
                f.write(str(len(ids)))
            time.sleep(float(step))
        seconds = time.perf_counter() - started
    np.save(out, np.concatenate(ids) if ids else np.zeros(0, np.int64))
    with open(out + ".seconds", "w") as f:
        f.write(repr(seconds))


if __name__ == "__main__":
    main(*sys.argv[1:])
