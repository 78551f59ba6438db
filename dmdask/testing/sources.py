"""`SourceTests`: the contract of a source format, a pytest suite each format's tests inherit.

Subclass it and provide the fixtures `spec` (a `dmdask.Spec` of the format's dataset on an
HTTP store, several blocks), `fail_reads` (a function `(n, status)`: the store answers
`status` to the next n requests for the dataset's files, until the test ends) and `client`
(of a dmdask cluster), and the method `check(batch)`, asserting that every field holds the
values of the samples `batch["index"]`.
"""
from __future__ import annotations

import concurrent.futures
import importlib
import pickle

import numpy as np
import pytest

import dmdask
from dmdask.errors import BlockReadError
from dmdask.source import BlockReader, Source, dataset_name, open_source


class SourceTests:
    def check(self, batch: dict) -> None:
        raise NotImplementedError

    def test_dataset_name_does_no_io(self, spec, monkeypatch):
        def no_io(*args, **kwargs):
            raise AssertionError("dataset_name made a filesystem")

        for module in ("fsspec.core", "fsspec.registry"):
            monkeypatch.setattr(importlib.import_module(module), "get_filesystem_class", no_io)
        assert dataset_name(spec) == dataset_name(spec.replace(seed=spec.seed + 1)) != dataset_name(
            spec.replace(block_size=(spec.block_size or 0) + 10**6))

    def test_every_sample_once_per_epoch(self, client, spec):
        orders = []
        for epoch in (0, 1):
            specs = [spec.replace(rank=r, world_size=2) for r in range(2)]
            with concurrent.futures.ThreadPoolExecutor(2) as pool:
                ranks = list(pool.map(lambda s: list(dmdask.batches(client, s, epoch=epoch)), specs))
            batches = [b for per_rank in ranks for b in per_rank]
            for batch in batches:
                self.check(batch)
            orders.append(np.concatenate([b["index"] for b in batches]))
            assert np.array_equal(np.sort(orders[-1]), np.arange(open_source(spec).info.num_samples))
        assert not spec.shuffle or not np.array_equal(*orders)

    def test_readers_cover_the_blocks_and_read_rows_is_read_indexed(self, spec):
        source = open_source(spec)
        assert isinstance(source, Source) and source.info.num_blocks > 1
        assert source.info.bound, "identity not made with Place.identity: the scheduler refuses it"
        readers = [source.reader(k) for k in range(source.info.num_blocks)]
        for k, reader in enumerate(readers):
            assert isinstance(reader, BlockReader) and (reader.start, reader.stop) == source.info.block_range(k)
            block = reader.read()
            self.check(dict(block, index=np.arange(reader.start, reader.stop)))
            rows = np.unique([0, (reader.stop - reader.start) // 2, reader.stop - reader.start - 1])
            assert_same(reader.read_rows(rows), {field: values[rows] for field, values in block.items()})
        assert len({reader.key for reader in readers}) == len(readers)

    def test_readers_pickle(self, spec):
        reader = open_source(spec).reader(1)
        clone = pickle.loads(pickle.dumps(reader))
        assert [getattr(clone, a) for a in ("key", "start", "stop", "nbytes")] == [
            getattr(reader, a) for a in ("key", "start", "stop", "nbytes")]
        assert_same(clone.read(), reader.read())

    def test_transient_errors_are_retried(self, spec, fail_reads):
        reader, retries = open_source(spec).reader(0), []
        fail_reads(1, 503)
        block = reader.read(on_retry=retries.append)
        assert retries
        self.check(dict(block, index=np.arange(reader.start, reader.stop)))

    def test_a_404_is_a_block_read_error(self, spec, fail_reads):
        reader, retries = open_source(spec).reader(0), []
        fail_reads(10**6, 404)
        with pytest.raises(BlockReadError, match=f"samples {reader.start}"):
            reader.read(on_retry=retries.append)
        assert retries == []  # a 404 is not retried

    def test_nbytes_is_exact(self, spec):
        """Each reader's nbytes, and the dataset's, is the decoded size (the arrays, and
        the arrays an object array points to), or None where unknown before reading."""
        source = open_source(spec)
        readers = [source.reader(k) for k in range(source.info.num_blocks)]
        sizes = [sum(v.nbytes + (sum(x.nbytes for x in v) if v.dtype == object else 0) for v in r.read().values())
                 for r in readers]
        assert [r.nbytes for r in readers] in ([None] * len(sizes), sizes)
        assert source.info.nbytes in (None, sum(sizes))


    def test_field_types_are_what_blocks_give(self, spec):
        """`DatasetInfo.field_types`, where the source declares it (a mixture checks its
        sources' fields from it with no block read): each field's dtype and sample shape as
        every block gives them, in `fields`' order."""
        info = open_source(spec).info
        if info.field_types is None:
            return
        assert [name for name, _, _ in info.field_types] == list(info.fields)
        source = open_source(spec)
        for k in range(info.num_blocks):
            block = source.reader(k).read()
            assert [(name, block[name].dtype.str, tuple(block[name].shape[1:])) for name in info.fields] == \
                [(name, np.dtype(dtype).str, tuple(shape)) for name, dtype, shape in info.field_types]


def assert_same(block: dict, expected: dict) -> None:
    assert block.keys() == expected.keys()
    for field, values in expected.items():
        assert len(block[field]) == len(values) and all(np.array_equal(a, b) for a, b in zip(block[field], values))
