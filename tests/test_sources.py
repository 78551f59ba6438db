"""The source contract (`dmdask.testing.sources.SourceTests`) for Zarr groups and folders of class
subfolders, over the counting HTTP store; Parquet, HDF5 and WebDataset inherit it in
their own modules."""
import numpy as np
import pytest

import dmdask
from dmdask.source import open_source
from dmdask.testing.sources import SourceTests
from dmdask.testing.datasets import folder_sample, write_folder, write_zarr, zarr_label, zarr_sample


def write_store(root):  # the `store` fixture's datasets (conftest.py)
    write_zarr(str(root / "train.zarr"), 300, sample_shape=(4,), chunk=64)
    write_folder(str(root / "images"), classes=3, per_class=20)


class TestZarrSource(SourceTests):
    @pytest.fixture
    def spec(self, store):
        return dmdask.Spec(store[0].url + "/train.zarr", batch_size=32, seed=1)

    def check(self, batch):
        assert set(batch) == {"x", "label", "index"}
        np.testing.assert_array_equal(batch["x"], zarr_sample(batch["index"], (4,)))
        np.testing.assert_array_equal(batch["label"], zarr_label(batch["index"]))

    # Zarr stores no chunk equal to the fill value: a missing chunk is that value, no error.
    test_a_404_is_a_block_read_error = None

    def test_a_missing_chunk_reads_as_the_fill_value(self, spec, fail_reads):
        reader = open_source(spec).reader(0)
        reader.read()  # the arrays' metadata, read once per process
        fail_reads(10**6, 404)
        assert all(not values.any() for values in reader.read().values())


class TestFolderSource(SourceTests):
    @pytest.fixture
    def spec(self, store):
        return dmdask.Spec(store[0].url + "/images", batch_size=8, block_size=16, seed=2)

    def check(self, batch):
        assert set(batch) == {"data", "label", "index"}
        assert [d.tobytes() for d in batch["data"]] == [folder_sample(int(i)) for i in batch["index"]]
        np.testing.assert_array_equal(batch["label"], batch["index"] // 20)
