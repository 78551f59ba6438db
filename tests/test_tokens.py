"""Raw token files (`dmdask.Tokens(path, dtype)`, nanoGPT's `train.bin`) over the counting HTTP
store, on real worker processes: the source contract, windows of seq_len + 1 tokens at a stride
of seq_len across block boundaries equal to numpy slicing of the same file, each block read
from the store once per run while the cache holds it, and the errors of a wrong dtype or file."""
import concurrent.futures
import os
import re
import subprocess
import sys

import numpy as np
import pytest

import dmdask
from dmdask.source import open_source
from dmdask.testing.sources import SourceTests


def token_ids(n: int, dtype: str, vocab: int) -> np.ndarray:
    """Token ids that differ from their neighbours (so a window off by one shows)."""
    return (np.arange(n, dtype=np.int64) * 7919 % vocab).astype(dtype)


def write_store(root):  # the `store` fixture's files (conftest.py)
    token_ids(12_000, "uint16", 50257).tofile(root / "train.bin")  # as nanoGPT's prepare.py writes it
    token_ids(9_001, "uint32", 100_277).tofile(root / "windows.bin")
    token_ids(1001, "uint16", 50257).tofile(root / "odd.bin")


class TestTokenSource(SourceTests):
    @pytest.fixture
    def spec(self, store):
        return dmdask.Spec(dmdask.Tokens(store[0].url + "/train.bin", "uint16"), batch_size=64, block_size=1000,
                           seed=1)

    def check(self, batch):
        assert set(batch) == {"tokens", "index"} and batch["tokens"].dtype == np.uint16
        np.testing.assert_array_equal(batch["tokens"], token_ids(12_000, "uint16", 50257)[batch["index"]])


def test_windows_across_blocks_are_numpy_slices_and_each_block_is_read_once(client, store):
    server, root = store
    memmap = np.memmap(root / "windows.bin", dtype=np.uint32, mode="r")  # what a nanoGPT user slices
    seq_len = 64
    window = dmdask.Window(seq_len + 1, stride=seq_len)
    count = (len(memmap) - seq_len - 1) // seq_len + 1
    spec = dmdask.Spec(dmdask.Tokens(server.url + "/windows.bin", "uint32"), batch_size=8, block_size=1000,
                       seed=4, window=window)  # 1000 is no multiple of 64: windows span two blocks
    needed = ((count - 1) * seq_len + seq_len) // 1000 + 1  # blocks holding a window's token (read ahead: all 10)
    server.reset_stats()
    for epoch in (0, 1):
        specs = [spec.replace(rank=r, world_size=2) for r in range(2)]
        with concurrent.futures.ThreadPoolExecutor(2) as pool:
            ranks = list(pool.map(lambda s: list(dmdask.batches(client, s, epoch=epoch)), specs))
        ids = []
        for batch in (b for batches in ranks for b in batches):
            assert batch["tokens"].shape == (len(batch["index"]), seq_len + 1) and batch["tokens"].dtype == np.uint32
            for w, tokens in zip(batch["index"].tolist(), batch["tokens"]):
                np.testing.assert_array_equal(tokens, memmap[w * seq_len:w * seq_len + seq_len + 1])
            ids += batch["index"].tolist()
        assert sorted(ids) == list(range(count))  # every window once
        read = server.stats()["by_path"]["windows.bin"]
        # each block at most once in the run (one ranged read of its bytes), every needed one in epoch 0
        assert needed <= read["requests"] <= 10 and 4 * needed * 1000 <= read["bytes"] <= memmap.nbytes, (epoch, read)
        assert read["bytes"] == 4000 * read["requests"] - 3996 * (read["requests"] == 10), read  # whole blocks


def test_a_wrong_dtype_or_file_is_a_clear_error(client, store, tmp_path):
    server = store[0]
    with pytest.raises(dmdask.SourceError, match="not a whole number of <u4 tokens.*dtype"):
        open_source(dmdask.Spec(dmdask.Tokens(server.url + "/odd.bin", "uint32"), batch_size=4))
    with pytest.raises(dmdask.SourceNotFoundError, match="missing.bin"):
        open_source(dmdask.Spec(dmdask.Tokens(server.url + "/missing.bin", "uint16"), batch_size=4))
    (tmp_path / "empty.bin").write_bytes(b"")
    with pytest.raises(dmdask.SourceError, match="holds no tokens"):
        open_source(dmdask.Spec(dmdask.Tokens(tmp_path / "empty.bin", "uint16"), batch_size=4))
    for bad in ("float32", "text", None):
        with pytest.raises(dmdask.SpecError, match="dtype.*integer numpy dtype"):
            dmdask.Tokens("train.bin", bad)
    with pytest.raises(dmdask.SpecError, match="keys"):
        open_source(dmdask.Spec(dmdask.Tokens(server.url + "/odd.bin", "uint16"), batch_size=4, keys=["x"]))


def test_tokens_name_their_dtype_and_local_path():
    tokens = dmdask.Tokens("train.bin", "uint16")
    assert tokens.dtype == "<u2" and tokens.path.startswith("/") and tokens.path.endswith("/train.bin")
    assert dmdask.Tokens("a.bin", np.dtype(">u4")).dtype == ">u4"
    from dmdask.source import dataset_name

    spec = dmdask.Spec(tokens, batch_size=2)
    assert dataset_name(spec) != dataset_name(spec.replace(source=dmdask.Tokens("train.bin", "uint32")))


def test_the_quickstart_recipe_runs(tmp_path):
    """docs/quickstart.md's raw-token recipe, as written, in an empty folder (it checks its windows
    against numpy.memmap itself). Not a `runnable` block: the docs' check of those refuses any
    warning, and a LocalCluster's exit leaves ResourceWarnings of distributed's sockets."""
    root = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    text = open(os.path.join(root, "docs", "quickstart.md")).read()
    code, = re.findall(r"\*\*Raw token files\*\*.*?```python\n(.*?)```", text, flags=re.S)
    (tmp_path / "recipe.py").write_text(code)
    env = dict(os.environ, PYTHONPATH=os.pathsep.join([root, os.environ.get("PYTHONPATH", "")]).rstrip(os.pathsep),
               DASK_DMDASK__PROGRESS="false")
    done = subprocess.run([sys.executable, "recipe.py"], cwd=tmp_path, env=env, capture_output=True, text=True,
                          timeout=240)
    assert done.returncode == 0 and "Traceback" not in done.stderr, done.stderr
    assert (tmp_path / "train.bin").stat().st_size == 200_000


def test_token_files_mix_as_other_sources_do(client, store):
    """Two token files in a `dmdask.Mix` (rows, in proportion to their sizes): every token of
    both once per epoch, each row its file's."""
    server, root = store
    files = {"train.bin": np.fromfile(root / "train.bin", dtype=np.uint16),
             "odd.bin": np.fromfile(root / "odd.bin", dtype=np.uint16)}
    mix = dmdask.Mix([dmdask.Tokens(f"{server.url}/{name}", "uint16") for name in files])
    seen = {0: [], 1: []}
    for batch in dmdask.batches(client, dmdask.Spec(mix, batch_size=500, block_size=1000, seed=2)):
        for s, name in enumerate(files):
            mine = batch["source"] == s
            np.testing.assert_array_equal(batch["tokens"][mine], files[name][batch["index"][mine]])
            seen[s] += batch["index"][mine].tolist()
    assert [sorted(seen[s]) for s in (0, 1)] == [list(range(len(f))) for f in files.values()]


def test_requests_of_token_windows_count_what_each_row_costs_besides_its_token(client, store):
    """A request of small batches holds about REQUEST_BYTES, counting per row what the fetch keeps
    beside it (int64 ids and places), not only its 4 bytes: batches of 8 windows of 4,097 uint32
    tokens go one a request (by their tokens alone, 32 a request: 63 MiB of a rank's memory
    measured at 1,025-token windows, 15 MiB since)."""
    from dmdask.client.iterator import REQUEST_BYTES, ROW_INDEX_BYTES

    server = store[0]
    spec = dmdask.Spec(dmdask.Tokens(server.url + "/windows.bin", "uint32"), batch_size=8, block_size=1000,
                       window=dmdask.Window(4097, stride=1024))
    it = dmdask.batches(client, spec)
    try:
        assert it.group == max(1, REQUEST_BYTES // (8 * 4097 * (4 + ROW_INDEX_BYTES))) == 1
        assert sorted(np.concatenate([b["index"] for b in it]).tolist()) == list(range((9001 - 4097) // 1024 + 1))
    finally:
        it.close()


def test_a_file_cut_short_after_opening_is_a_block_read_error_naming_the_bytes(tmp_path):
    """A block whose bytes the store no longer has in full (the file truncated since the dataset
    was opened) is never returned short: a BlockReadError names the URL, the bytes and why."""
    token_ids(3000, "uint16", 50257).tofile(tmp_path / "t.bin")
    source = open_source(dmdask.Spec(dmdask.Tokens(tmp_path / "t.bin", "uint16"), batch_size=4, block_size=1000))
    with open(tmp_path / "t.bin", "r+b") as f:
        f.truncate(2 * 2500)  # the last block loses half its tokens
    np.testing.assert_array_equal(source.reader(1).read()["tokens"], token_ids(3000, "uint16", 50257)[1000:2000])
    with pytest.raises(dmdask.BlockReadError, match=r"1000 bytes for bytes 4000..5999 .* shorter than when"):
        source.reader(2).read()


def test_a_blend_of_corpora_of_other_dtypes_is_refused_from_their_metadata(client, store):
    """A `Mix` of a uint16 and a uint32 corpus: `SpecError` from `batches`, naming the field, both
    dtypes and both files; the check reads the dtypes the sources' metadata declares
    (`DatasetInfo.field_types`), never a block's rows (it would wait for their first loads)."""
    from dmdask.client.mixture import MixedInfo, check_fields_match

    server = store[0]
    corpora = [dmdask.Tokens(f"{server.url}/{name}", dtype) for name, dtype in
               (("train.bin", "uint16"), ("windows.bin", "uint32"), ("odd.bin", "uint16"))]
    window = dmdask.Window(65, stride=64)
    with pytest.raises(dmdask.SpecError, match=r"field 'tokens' is uint16 of sample shape \(\) in "
                       rf"{re.escape(server.url)}/train.bin but uint32 of sample shape \(\) in "
                       rf"{re.escape(server.url)}/windows.bin") as info:
        dmdask.batches(client, dmdask.Spec(dmdask.Mix(corpora[:2]), batch_size=8, block_size=1000, window=window))
    assert info.value.field == "source"

    def no_rows():
        raise AssertionError("the first rows were read")

    for chosen, fails in (([0, 2], False), ([2, 1], True)):
        mix = dmdask.Mix([corpora[i] for i in chosen])
        spec = dmdask.Spec(mix, batch_size=8, block_size=1000, window=window)
        infos = [open_source(s).info for s in mix.specs(spec)]
        assert [i.field_types for i in infos] == [(("tokens", np.dtype(corpora[i].dtype).str, ()),) for i in chosen]
        if fails:
            with pytest.raises(dmdask.SpecError, match="is uint16 .* but uint32"):
                check_fields_match(MixedInfo(mix, infos, window), no_rows)
        else:
            check_fields_match(MixedInfo(mix, infos, window), no_rows)
