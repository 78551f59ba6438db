"""What the framework adapter tests (test_torch, test_tensorflow, test_mxnet, test_jax) share.

The datasets, the cluster fixture and the checks of exactly-once delivery, resumption
and training. Each test module passes its framework's array-to-numpy conversion
(`to_numpy`) where a check reads batch values. This module imports no framework.

    from framework_cases import env_fixture
    env = env_fixture("jaxdata")      # the module's `env` fixture
"""

from __future__ import annotations

import ast
import socket
import warnings
from pathlib import Path

import numpy as np
import pytest

import dmdask

REPO_ROOT = Path(__file__).resolve().parents[1]
N = 1003        # not a multiple of the chunk (64) nor of the batch size (50)
FEATURES = 8
BATCH = 50
FOLDER_BATCH_SIZES = [4, 4, 4, 4, 4, 1]  # the folder dataset (21 files) in batches of 4


# --- datasets and the cluster ------------------------------------------------------------

def write_zarr(path: Path):
    """N samples: "x" float32 (N, FEATURES), "y" int64 labels, linearly separable."""
    import zarr

    rng = np.random.default_rng(42)
    x = rng.normal(size=(N, FEATURES)).astype("f4")
    w = rng.normal(size=FEATURES)
    y = (x @ w > 0).astype("i8")  # linearly separable, two classes
    g = zarr.open_group(str(path), mode="w")
    g.create_array("x", shape=x.shape, chunks=(64, FEATURES), dtype="f4")
    g.create_array("y", shape=y.shape, chunks=(64,), dtype="i8")
    g["x"][:] = x
    g["y"][:] = y
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # "consolidated metadata is not part of the v3 spec"
        zarr.consolidate_metadata(str(path))
    return x, y


def write_folder(path: Path, lowest_byte: int = 0):
    """Class-per-subfolder files of different sizes: bytes and labels in sample order.

    lowest_byte=1 keeps NUL bytes out (a numpy bytes array drops trailing NULs)."""
    rng = np.random.default_rng(7)
    files = {}
    for cls in ("a", "b", "c"):
        (path / cls).mkdir(parents=True)
        for i in range(7):
            data = rng.integers(lowest_byte, 256, size=int(rng.integers(1, 300)), dtype=np.uint8).tobytes()
            (path / cls / f"{i:03d}.bin").write_bytes(data)
            files[(cls, i)] = data
    return [files[k] for k in sorted(files)], [ord(c) - ord("a") for c, _ in sorted(files)]


def env_fixture(name: str, lowest_byte: int = 0):
    """A module-scoped `env` fixture: one real cluster (two worker processes), a client
    and two small datasets, in a temporary folder named after `name`.

    env: {"client", "root", "zarr", "x", "y", "folder", "blobs", "labels"}."""

    @pytest.fixture(scope="module")
    def env(tmp_path_factory):
        import distributed

        root = tmp_path_factory.mktemp(name)
        x, y = write_zarr(root / "train.zarr")
        blobs, labels = write_folder(root / "files", lowest_byte)
        cluster = dmdask.LocalCluster(n_workers=2, ram="64 MiB")
        client = distributed.Client(cluster)
        try:
            yield {"client": client, "zarr": str(root / "train.zarr"), "x": x, "y": y, "root": root,
                   "folder": str(root / "files"), "blobs": blobs, "labels": labels}
        finally:
            for source, block_size in ((str(root / "train.zarr"), None), (str(root / "files"), 5)):
                dmdask.release(client, dmdask.Spec(source=source, batch_size=1, block_size=block_size))
            client.close()
            cluster.close()

    return env


def zarr_spec(env, **kw) -> dmdask.Spec:
    """A spec of the zarr dataset, batch_size BATCH unless given."""
    kw.setdefault("batch_size", BATCH)
    return dmdask.Spec(source=env["zarr"], **kw)


def folder_spec(env) -> dmdask.Spec:
    return dmdask.Spec(source=env["folder"], batch_size=4, shuffle=False, block_size=5)


# --- reading batches ---------------------------------------------------------------------

def cat(batches, field: str, to_numpy=np.asarray) -> np.ndarray:
    """`field` of `batches`, concatenated as one numpy array."""
    return np.concatenate([to_numpy(b[field]) for b in batches])


def ids(numpy_batches) -> np.ndarray:
    """The sample ids of dmdask's own batches (numpy), in order."""
    return np.concatenate([b["index"] for b in numpy_batches])


def dmdask_ids(env, spec: dmdask.Spec, epoch: int) -> np.ndarray:
    """The sample ids `dmdask.batches` itself gives for `spec` and `epoch`."""
    return ids(dmdask.batches(env["client"], spec, epoch=epoch))


def take(iterable, n: int) -> list:
    """The first `n` items of `iterable`; the loop is then left (the pass abandoned)."""
    head = []
    for item in iterable:
        head.append(item)
        if len(head) == n:
            break
    return head


# --- checks ------------------------------------------------------------------------------

def imported_modules(relative_path: str) -> set:
    """The top-level names of the modules a source file of the repository imports."""
    tree = ast.parse((REPO_ROOT / relative_path).read_text())
    imported = {alias.name.split(".")[0] for node in ast.walk(tree) if isinstance(node, ast.Import)
                for alias in node.names}
    imported |= {node.module.split(".")[0] for node in ast.walk(tree)
                 if isinstance(node, ast.ImportFrom) and node.module}
    return imported


def assert_loss_falls(losses) -> None:
    """The last epoch's loss is under half the first's."""
    assert losses[-1] < 0.5 * losses[0], losses


def assert_accurate(env, predicted_labels) -> None:
    """Over 95% of all samples classified right."""
    accuracy = (np.asarray(predicted_labels) == env["y"]).mean()
    assert accuracy > 0.95, accuracy


def assert_content(env, batches, to_numpy=np.asarray) -> None:
    """Each batch's "x" and "y" are the source's rows at its "index"."""
    for b in batches:
        idx = to_numpy(b["index"])
        np.testing.assert_array_equal(to_numpy(b["x"]), env["x"][idx])
        np.testing.assert_array_equal(to_numpy(b["y"]), env["y"][idx])


def check_exactly_once(env, rank_batches, to_numpy=np.asarray, ranks: int = 3, seed: int = 5,
                       epoch: int = 2) -> None:
    """`rank_batches(rank)` (a loader's batches of `epoch` for rank of `ranks`, spec
    seed `seed`) holds the source's rows at each index, in exactly `dmdask.batches`'
    order for that rank, and the ranks together give every sample once."""
    seen = []
    for rank in range(ranks):
        batches = rank_batches(rank)
        assert_content(env, batches, to_numpy)
        seen.append(cat(batches, "index", to_numpy))
        direct = dmdask_ids(env, zarr_spec(env, seed=seed, rank=rank, world_size=ranks), epoch)
        np.testing.assert_array_equal(seen[-1], direct)  # neither dropped, repeated nor reordered
    allidx = np.concatenate(seen)
    assert len(allidx) == N and len(np.unique(allidx)) == N
    assert sorted(allidx.tolist()) == list(range(N))


def assert_resumed(head, tail, reference, per_epoch: int, to_numpy=np.asarray) -> None:
    """The batches before a checkpoint (`head`) and after resuming from it (`tail`) are
    together the uninterrupted pass (`reference`): the same index, x and y."""
    assert len(head) + len(tail) == len(reference) == per_epoch
    for field in ("index", "x", "y"):
        np.testing.assert_array_equal(cat(head + tail, field, to_numpy), cat(reference, field, to_numpy))


def check_elastic_resume(env, make_loader, save=lambda state: state, to_numpy=np.asarray,
                         worlds=((3, 2), (2, 4)), epoch: int = 1) -> None:
    """Ranks of one world size stop part-way (rank r after 2 + r batches), every rank's
    state goes through the framework's checkpoint idiom (`save`: state -> state read
    back), and loaders of another world size load the list and finish the epoch:
    over both runs every sample of the epoch comes exactly once, with its own x and y.

    make_loader(spec): a new loader at `epoch` (set_epoch done by the caller's idiom)."""
    for before, after in worlds:
        seen, states = [], []
        for rank in range(before):
            loader = make_loader(zarr_spec(env, rank=rank, world_size=before, seed=21, drop_last=False))
            seen += take(loader, 2 + rank)
            states.append(save(loader.state_dict()))
        for rank in range(after):
            loader = make_loader(zarr_spec(env, rank=rank, world_size=after, seed=21, drop_last=False))
            loader.load_state_dict(states)
            seen += take(loader, len(loader))
        index = cat(seen, "index", to_numpy)
        assert len(index) == N and np.array_equal(np.sort(index), np.arange(N)), (before, after)
        np.testing.assert_array_equal(cat(seen, "x", to_numpy), env["x"][index])
        np.testing.assert_array_equal(cat(seen, "y", to_numpy), env["y"][index])


def check_other_epoch_and_spec(env, make_loader, spec: dmdask.Spec, state: dict, epoch: int,
                               batches_of=list, to_numpy=np.asarray) -> None:
    """A `state` of `spec`, loaded, is dropped by `set_epoch` to another `epoch` (which
    then gives every sample), and a loader of another spec refuses it (ValueError).

    make_loader(spec): a new loader; batches_of(loader): the batches of one pass."""
    other = make_loader(spec)
    other.load_state_dict(state)
    other.set_epoch(epoch)
    assert other.state_dict() == {"epoch": epoch, "iterator": None}
    assert len(cat(batches_of(other), "index", to_numpy)) == N
    with pytest.raises(ValueError):
        make_loader(zarr_spec(env, seed=12)).load_state_dict(state)


def check_folder_batches(env, batches, to_numpy=np.asarray) -> None:
    """Batches of `folder_spec`: sizes 4,4,4,4,4,1; each sample's "data" holds its
    file's bytes and "label" its class."""
    indices = [to_numpy(b["index"]).tolist() for b in batches]
    assert [len(i) for i in indices] == FOLDER_BATCH_SIZES
    for b, idx in zip(batches, indices):
        for i, sample in zip(idx, b["data"]):
            assert bytes(to_numpy(sample)) == env["blobs"][i]
        assert to_numpy(b["label"]).tolist() == [env["labels"][i] for i in idx]


# --- several processes -------------------------------------------------------------------

def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def wait_all(procs, timeout: float) -> None:
    """Wait for `procs` in order (killing any left when it fails); each must exit 0."""
    try:
        outputs = [p.communicate(timeout=timeout)[0] for p in procs]
    finally:
        for p in procs:
            if p.poll() is None:
                p.kill()
    for p, output in zip(procs, outputs):
        assert p.returncode == 0, output[-3000:]


def check_worker_results(env, results) -> None:
    """Three training processes' results ({"rank", "world_size", "epoch", "ids",
    "weights"}, sorted by rank), over two epochs of spec seed=5, drop_last: each took
    its rank, read exactly dmdask's batches for it, and their weights agree."""
    assert [(r["rank"], r["world_size"], r["epoch"]) for r in results] == [(i, 3, 2) for i in range(3)]
    for epoch in (0, 1):
        per_rank = [np.array(r["ids"][str(epoch)]) for r in results]
        for rank, got in enumerate(per_rank):  # exactly dmdask's batches for that rank and epoch
            spec = zarr_spec(env, seed=5, drop_last=True, rank=rank, world_size=3)
            np.testing.assert_array_equal(got, dmdask_ids(env, spec, epoch))
        together = np.concatenate(per_rank)
        assert len(np.unique(together)) == len(together) == 3 * (N // 3 // BATCH) * BATCH
    for r in results[1:]:  # the workers stayed in sync
        for a, b in zip(r["weights"], results[0]["weights"]):
            np.testing.assert_allclose(a, b, rtol=1e-6)


__all__ = ["REPO_ROOT", "N", "FEATURES", "BATCH", "write_zarr", "write_folder", "env_fixture", "zarr_spec",
           "folder_spec", "cat", "ids", "dmdask_ids", "take", "imported_modules", "assert_loss_falls",
           "assert_accurate", "assert_content", "check_exactly_once", "assert_resumed", "check_elastic_resume",
           "check_other_epoch_and_spec", "check_folder_batches", "free_port", "wait_all",
           "check_worker_results"]
