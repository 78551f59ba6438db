"""The per-epoch progress bar of dmdask.batches: when it shows, what it says, and that
its hit rate costs no per-batch round trip."""
import io
import re
import time

import dask
import numpy as np

import dmdask
from dmdask.client import progress

N = 1003


class Terminal(io.StringIO):
    def isatty(self):
        return True


ZARR = dict(n=N, sample_shape=(4,), chunk=64)  # the `zarr_path` fixture's dataset (conftest.py)


def test_when_the_bar_shows(monkeypatch):
    assert progress.wanted(True) and not progress.wanted(False)
    assert progress.wanted({"file": io.StringIO()})
    assert progress.wanted(None, rank=0, stream=Terminal())
    assert not progress.wanted(None, rank=1, stream=Terminal())  # one bar per job, not one per rank
    assert not progress.wanted(None, rank=0, stream=io.StringIO())  # a log file, a pipe, pytest
    monkeypatch.setattr("sys.stderr", Terminal())
    assert progress.wanted(None)
    with dask.config.set({"dmdask.progress": False}):
        assert not progress.wanted(None) and progress.wanted(True)
    with dask.config.set({"dmdask.progress": True}):
        assert progress.wanted(None, stream=io.StringIO())


def test_hit_text():
    before = {"ram": 10, "ssd": 0, "stream": 5}
    assert progress.hit_text(before, before) is None
    assert progress.hit_text(before, {"ram": 91, "ssd": 16, "stream": 8}) == \
        "hit 97% (RAM 81%, SSD 16%, streamed 3%)"
    assert progress.hit_text(before, {"ram": 0, "ssd": 0, "stream": 9}) == \
        "hit 0% (RAM 0%, SSD 0%, streamed 100%)"  # a restarted worker counts from 0 again
    from dmdask.protocol.metric import empty_metric

    metric = empty_metric()
    metric["ram"]["hits"], metric["ssd"]["hits"], metric["stream"]["hits"] = 1, 2, 3
    partial = {"ram": {"hits": 5}, "ssd": {"hits": 5}, "stream": {"hits": 5}}  # not a dmdask metric: left out
    assert progress.served([metric, None, {}, partial]) == {"ram": 1, "ssd": 2, "stream": 3}


def test_no_bar_by_default_when_not_a_terminal(client, zarr_path):
    it = dmdask.batches(client, dmdask.Spec(zarr_path, batch_size=50))
    assert it.progress is None  # pytest's captured stderr is not a terminal
    assert sum(len(b["index"]) for b in it) == N


def test_bar_shows_rate_and_hit_rate_without_per_batch_requests(client, zarr_path, monkeypatch):
    monkeypatch.setattr(progress, "STATS_INTERVAL", 0.2)
    calls, real = [], progress.served_now

    def served_now(client):  # called as each stats request is sent
        calls.append(time.monotonic())
        return real(client)

    monkeypatch.setattr(progress, "served_now", served_now)
    out = io.StringIO()
    spec = dmdask.Spec(zarr_path, batch_size=50, seed=4)
    it = dmdask.batches(client, spec, epoch=0, progress={"file": out, "mininterval": 0})
    assert it.progress is not None and it.progress.bar.total == len(it) == 21
    ids = []
    for batch in it:
        ids.append(batch["index"])
        time.sleep(0.12)  # a training step: the heartbeats carry the counters meanwhile
    assert np.array_equal(np.sort(np.concatenate(ids)), np.arange(N))
    assert it.progress is None  # closed at the end of the epoch
    text = out.getvalue()
    final = text.replace("\r", "\n").strip().splitlines()[-1]
    assert final.startswith("epoch 0: 100%") and "21/21" in final
    assert re.search(r"\d+\.\d+batch/s", final)
    # every sample of this epoch came from a tier (all blocks were read before being served)
    assert "hit 100% (RAM 100%, SSD 0%, streamed 0%)" in final
    assert len(calls) >= 2 and np.diff(calls).min() >= 0.2  # at most one request per interval, whatever the pace


def test_bar_starts_at_the_resumed_position_and_closes_with_the_iterator(client, zarr_path):
    spec = dmdask.Spec(zarr_path, batch_size=100, seed=5)
    first = dmdask.batches(client, spec, progress=False)
    for _ in range(3):
        next(first)
    state = first.state_dict()
    first.close()
    out = io.StringIO()
    it = dmdask.batches(client, spec, resume=state, progress={"file": out, "mininterval": 0})
    assert it.progress.bar.n == 3
    next(it)
    it.close()
    assert it.progress is None
    assert "4/11" in out.getvalue().replace("\r", "\n").strip().splitlines()[-1]
