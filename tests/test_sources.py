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


def folder_urls(url: str, order) -> list:
    """The URLs of the `images` folder's samples `order` (3 classes of 20), in that order."""
    return [f"{url}/images/class-{i // 20:02d}/s-{i:08d}.bin" for i in order]


ORDER = np.random.default_rng(5).permutation(60)  # the list's file i is the folder's sample ORDER[i]


class TestFileListSource(SourceTests):
    @pytest.fixture
    def spec(self, store):
        return dmdask.Spec(folder_urls(store[0].url, ORDER), batch_size=8, block_size=16, seed=2)

    def check(self, batch):
        assert set(batch) == {"data", "label", "index"}
        folder_ids = ORDER[batch["index"]]  # sample i is the list's file i
        assert [d.tobytes() for d in batch["data"]] == [folder_sample(int(i)) for i in folder_ids]
        np.testing.assert_array_equal(batch["label"], folder_ids // 20)  # its folder's place among the list's

    def test_opening_reads_nothing_from_the_store(self, store, spec):
        server = store[0]
        server.reset_stats()
        source = open_source(spec)
        assert server.stats()["requests"] == server.stats()["head_requests"] == 0
        assert source.info.num_samples == 60 and source.info.nbytes is None
        assert source.info.url == f"{folder_urls(server.url, ORDER[:1])[0]} and 59 more files"

    def test_a_missing_file_is_an_error_naming_it(self, client, store):
        urls = folder_urls(store[0].url, range(10)) + [store[0].url + "/images/class-00/no-such-file.bin"]
        with pytest.raises(dmdask.BlockReadError, match="no-such-file.bin"):
            list(dmdask.batches(client, dmdask.Spec(urls, batch_size=11)))


def test_a_list_of_tar_shards_and_files_is_a_clear_error(store):
    url = store[0].url
    with pytest.raises(dmdask.SpecError, match="a list of WebDataset .tar shards, or of sample files"):
        open_source(dmdask.Spec([f"{url}/a.tar", f"{url}/images/class-00/s-00000000.bin"], batch_size=2))
