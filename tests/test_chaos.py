"""Chaos: training goes on over several epochs while workers are killed one at a time
and all at once (and restarted by their nannies), an SSD file disappears and a
poisoned transform kills its process. Every epoch delivers every sample exactly once
with the right values; the poisoned batch is one named error, resumed past; the
cluster is usable after."""
import os
import shutil
import signal
import threading
import time

import distributed
import numpy as np
import pytest

import dmdask
from dmdask.plan.order import EpochOrder, RankShare
from dmdask.testing.datasets import write_zarr, zarr_sample

from conftest import wait_until

N, CHUNK, RANKS = 1200, 50, 2


class Step:
    """The transform: x + 1; on the batch holding sample `poison` it kills its process."""

    def __init__(self, poison: int = -1):
        self.poison = poison

    def __call__(self, batch):
        if self.poison in batch["index"]:
            os._exit(3)
        return dict(batch, x=batch["x"] + 1)


def _wait_for_workers(client, count: int, timeout: float = 120) -> None:
    wait_until(lambda: len(client.scheduler_info()["workers"]) >= count, timeout, "the nannies restarted the workers",
               pause=0.2)


def _epoch(client, spec, epoch: int, chaos=None, resume=None):
    """Every rank's batches of `epoch` (ranks are threads; `chaos()` runs once both
    ranks have their first batches). Returns (ids per rank, errors per rank, states)."""
    got = [[] for _ in range(RANKS)]
    errors, states = [None] * RANKS, [None] * RANKS
    going = [threading.Event() for _ in range(RANKS)]  # set after a rank's third batch, or when it ends

    def rank(r):
        it = dmdask.batches(client, spec.replace(rank=r, world_size=RANKS), epoch=epoch,
                            resume=None if resume is None else resume[r])
        try:
            for i, b in enumerate(it):
                np.testing.assert_array_equal(b["x"], zarr_sample(b["index"]) + (spec.transform is not None))
                got[r].append(b["index"])
                if i == 2:
                    going[r].set()
                time.sleep(0.005)  # a training step
        except dmdask.TransformError as exc:
            errors[r] = exc
        finally:
            states[r] = it.state_dict()
            going[r].set()

    threads = [threading.Thread(target=rank, args=(r,)) for r in range(RANKS)]
    for t in threads:
        t.start()
    for event in going:
        assert event.wait(120), "a rank got no batch"
    if chaos is not None:
        chaos()
    for t in threads:
        t.join(300)
        assert not t.is_alive(), "a rank hung"
    return got, errors, states


def _all(got) -> np.ndarray:
    return np.concatenate([i for per_rank in got for i in per_rank])


@pytest.mark.slow
def test_training_survives_kills_restarts_a_lost_ssd_file_and_a_poisoned_transform(tmp_path):
    rng = np.random.default_rng(2026)
    path = write_zarr(str(tmp_path / "d.zarr"), N, sample_shape=(8,), chunk=CHUNK)
    ssd = tmp_path / "ssd"
    # blocks of 2,000 bytes: a few in each worker's RAM, the rest on its SSD
    with dmdask.LocalCluster(n_workers=3, ram="6 KiB", ssd="1 MiB", ssd_dir=str(ssd)) as cluster, \
            distributed.Client(cluster) as client:
        spec = dmdask.Spec(path, batch_size=20, seed=11, prefetch=4, transform=Step())

        def kill_one():
            pids = client.run(os.getpid)
            os.kill(pids[rng.choice(sorted(pids))], signal.SIGKILL)

        def kill_all():
            for pid in client.run(os.getpid).values():
                os.kill(pid, signal.SIGKILL)

        for epoch, chaos in enumerate([None, kill_one, kill_all]):
            got, errors, _ = _epoch(client, spec, epoch, chaos)
            assert errors == [None] * RANKS
            assert np.array_equal(np.sort(_all(got)), np.arange(N)), f"epoch {epoch}"
            _wait_for_workers(client, 3)
        assert dmdask.stats(client)["total"]["ssd"]["blocks"] > 0

        # an SSD block's files vanish, and the transform is poisoned on one sample of rank 0
        shutil.rmtree(next(ssd.glob("dmdask-ssd-*/b*")))
        poison = int(RankShare(EpochOrder(N, CHUNK, shuffle=True, seed=11, epoch=3), 0, RANKS, 20, False).batch(10)[3])
        got, errors, states = _epoch(client, spec.replace(transform=Step(poison)), 3)
        assert isinstance(errors[0], dmdask.TransformError) and "killed its process" in str(errors[0])
        assert str(poison) in str(errors[0]) or "samples" in str(errors[0])
        assert errors[1] is None and states[0]["position"] == 10 == len(got[0])
        _wait_for_workers(client, 3)
        # the job resumes rank 0 from its state with the transform fixed; rank 1 is done
        rest, errors, _ = _epoch(client, spec, 3, resume=[states[0], states[1]])
        assert errors == [None] * RANKS
        ids = np.concatenate([_all(got), _all(rest)])
        assert len(ids) == N and np.array_equal(np.sort(ids), np.arange(N))

        # the cluster is usable after, and no more than one worker was lost to the poison
        got, errors, _ = _epoch(client, spec, 4)
        assert errors == [None] * RANKS and np.array_equal(np.sort(_all(got)), np.arange(N))
        assert len(client.scheduler_info()["workers"]) == 3
