"""Megatron indexed datasets (`.bin` + `.idx`, the MMIDIDX layout) over the counting HTTP store, on
real worker processes: the source contract, token windows over the documents laid end to end
(as Megatron's GPTDataset concatenates them) equal to numpy slicing, the dataset named by its
prefix, its `.bin` or its `.idx`, the `.idx` read once where the dataset is opened, and a
named error for each way an index can be wrong. The writer here follows the documented layout."""
import concurrent.futures
import struct

import numpy as np
import pytest

import dmdask
from dmdask.source import open_source
from dmdask.testing.sources import SourceTests

CODES = {np.dtype(np.uint16): 8, np.dtype(np.int32): 4}  # Megatron's dtype codes


def documents(count: int, dtype, seed: int) -> list:
    """`count` documents of 1..300 token ids that differ from their neighbours."""
    rng = np.random.default_rng(seed)
    lengths = rng.integers(1, 300, count)
    start = np.concatenate([[0], np.cumsum(lengths)])
    return [((np.arange(a, b) * 7919) % 50257).astype(dtype) for a, b in zip(start[:-1], start[1:])]


def write_indexed(prefix, docs, version=1, code=None, pointers=None, cut=0, doc_idx=None) -> None:
    """`prefix`.bin (the documents' tokens end to end) and `prefix`.idx: magic, version (uint64),
    dtype code (uint8), sequence and document counts (uint64), sizes (int32), pointers (int64: byte
    offsets in the .bin), document indices (int64: 0, then each document's end in sequences);
    `cut` bytes dropped from the end of the .idx."""
    dtype = docs[0].dtype
    sizes = np.array([len(d) for d in docs], dtype="<i4")
    if pointers is None:
        pointers = np.concatenate([[0], np.cumsum(sizes[:-1], dtype=np.int64) * dtype.itemsize])
    doc_idx = np.arange(len(docs) + 1, dtype="<i8") if doc_idx is None else np.asarray(doc_idx, "<i8")  # one a doc
    header = b"MMIDIDX\x00\x00" + struct.pack("<QBQQ", version, code or CODES[dtype], len(sizes), len(doc_idx))
    index = header + sizes.tobytes() + np.asarray(pointers, dtype="<i8").tobytes() + doc_idx.tobytes()
    with open(f"{prefix}.idx", "wb") as f:
        f.write(index[:len(index) - cut])
    with open(f"{prefix}.bin", "wb") as f:
        for doc in docs:
            f.write(doc.astype(dtype.newbyteorder("<")).tobytes())


DOCS = documents(60, np.uint16, seed=1)
TOKENS = np.concatenate(DOCS)
DOCUMENT = np.repeat(np.arange(len(DOCS)), [len(d) for d in DOCS])  # each token's document


def write_store(root):  # the `store` fixture's files (conftest.py)
    write_indexed(root / "corpus_text_document", DOCS)
    write_indexed(root / "wide", documents(40, np.int32, seed=2))


class TestMegatronSource(SourceTests):
    @pytest.fixture
    def spec(self, store):
        return dmdask.Spec(store[0].url + "/corpus_text_document", batch_size=64, block_size=1500, seed=3)

    def check(self, batch):
        assert set(batch) == {"tokens", "index"} and batch["tokens"].dtype == np.uint16
        np.testing.assert_array_equal(batch["tokens"], TOKENS[batch["index"]])


class TestMegatronSourceWithDocuments(SourceTests):
    @pytest.fixture
    def spec(self, store):
        return dmdask.Spec(store[0].url + "/corpus_text_document", batch_size=64, block_size=1500, seed=3,
                           keys=["tokens", "document"])

    def check(self, batch):
        assert set(batch) == {"tokens", "document", "index"} and batch["document"].dtype == np.int64
        np.testing.assert_array_equal(batch["tokens"], TOKENS[batch["index"]])
        np.testing.assert_array_equal(batch["document"], DOCUMENT[batch["index"]])


def test_windows_carry_each_tokens_document_for_the_attention_mask(client, store):
    """With keys=["tokens", "document"], a window says which document each token is in (documents of
    one sequence each, some empty), so a trainer masks attention across documents and restarts
    positions at each, as Megatron's reset_attention_mask and reset_position_ids do."""
    server, root = store
    docs = documents(50, np.uint16, seed=4)
    docs[7] = docs[7][:0]  # an empty document, then one of a single token
    docs[8] = docs[8][:1]
    write_indexed(root / "with_empty", docs)
    tokens, document = np.concatenate(docs), np.repeat(np.arange(len(docs)), [len(d) for d in docs])
    spec = dmdask.Spec(f"{server.url}/with_empty", batch_size=4, block_size=333, seed=6, keys=["tokens", "document"],
                       window=dmdask.Window(257, stride=256))
    ids = []
    for batch in dmdask.batches(client, spec):
        assert batch["document"].shape == batch["tokens"].shape == (len(batch["index"]), 257)
        for w, window, doc in zip(batch["index"].tolist(), batch["tokens"], batch["document"]):
            np.testing.assert_array_equal(window, tokens[w * 256:w * 256 + 257])
            np.testing.assert_array_equal(doc, document[w * 256:w * 256 + 257])
        assert (np.diff(batch["document"], axis=1) >= 0).all()  # a mask: document[:, :, None] == document[:, None]
        ids += batch["index"].tolist()
    assert sorted(ids) == list(range((len(tokens) - 257) // 256 + 1))
    with pytest.raises(dmdask.SpecError, match="keys"):
        open_source(spec.replace(keys=["document"]))


@pytest.mark.parametrize("name", ["wide", "wide.bin", "wide.idx"])
def test_windows_over_the_documents_end_to_end_named_by_prefix_bin_or_idx(client, store, name):
    server, root = store
    tokens = np.fromfile(root / "wide.bin", dtype="<i4")  # the documents end to end
    spec = dmdask.Spec(f"{server.url}/{name}", batch_size=4, block_size=700, seed=5,
                       window=dmdask.Window(129, stride=128))  # windows cross blocks and documents
    server.reset_stats()
    specs = [spec.replace(rank=r, world_size=2) for r in range(2)]
    with concurrent.futures.ThreadPoolExecutor(2) as pool:
        ranks = list(pool.map(lambda s: list(dmdask.batches(client, s, epoch=1)), specs))
    ids = []
    for batch in (b for batches in ranks for b in batches):
        assert batch["tokens"].dtype == np.int32
        for w, window in zip(batch["index"].tolist(), batch["tokens"]):
            np.testing.assert_array_equal(window, tokens[w * 128:w * 128 + 129])
        ids += batch["index"].tolist()
    assert sorted(ids) == list(range((len(tokens) - 129) // 128 + 1))
    read = server.stats()["by_path"]
    probe = {"wide.bin": (0, 0), "wide.idx": (0, 0), name: (1, 8)}  # a named file's first 8 bytes: is it HDF5?
    index = (root / "wide.idx").stat().st_size
    # the index read once, whole, where the dataset was opened
    assert read["wide.idx"] == {"requests": 1 + probe["wide.idx"][0], "bytes": index + probe["wide.idx"][1]}
    assert read["wide.bin"]["bytes"] - probe["wide.bin"][1] <= tokens.nbytes  # each block at most once
    assert read["wide.bin"]["requests"] - probe["wide.bin"][0] <= -(-len(tokens) // 700)
    restarted = dmdask.batches(client, spec.replace(rank=1, world_size=3), epoch=2)  # a restart at another size
    next(restarted)
    restarted.close()
    assert server.stats()["by_path"]["wide.idx"] == read["wide.idx"]  # plans without reading the index again


@pytest.mark.parametrize("broken, message", [
    (dict(version=2), "version 2; dmdask reads version 1"),
    (dict(code=7), "dtype code 7"),
    (dict(cut=9), "truncated"),
    (dict(pointers=[0] * 5), "not laid end to end"),
    (dict(doc_idx=[0, 3, 2, 5]), "document indices must rise from 0 to its 5 sequences"),
])
def test_a_broken_index_is_a_source_error_naming_what_is_wrong(tmp_path, broken, message):
    write_indexed(tmp_path / "c", documents(5, np.uint16, seed=3), **broken)
    with pytest.raises(dmdask.SourceError, match=message) as error:
        open_source(dmdask.Spec(str(tmp_path / "c"), batch_size=2))
    assert "c.idx" in str(error.value)


def test_a_wrong_magic_or_short_bin_is_a_source_error(tmp_path):
    write_indexed(tmp_path / "c", documents(5, np.uint16, seed=3))
    with open(tmp_path / "c.bin", "r+b") as f:
        f.truncate(10)
    with pytest.raises(dmdask.SourceError, match="truncated, or not the index's"):
        open_source(dmdask.Spec(str(tmp_path / "c.bin"), batch_size=2))
    (tmp_path / "c.idx").write_bytes(b"NOTANIDX" * 8)
    with pytest.raises(dmdask.SourceError, match="not a Megatron index.*MMIDIDX"):
        open_source(dmdask.Spec(str(tmp_path / "c.idx"), batch_size=2))


def test_a_bin_without_its_index_points_at_tokens(tmp_path):
    np.arange(100, dtype=np.uint16).tofile(tmp_path / "train.bin")  # nanoGPT's: no .idx
    with pytest.raises(dmdask.SourceNotFoundError, match=r"train.idx does not exist.*dmdask.Tokens\("):
        open_source(dmdask.Spec(str(tmp_path / "train.bin"), batch_size=2))
