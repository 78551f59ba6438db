"""fsspec's contract through `dmdask::`: read-only calls (ls, info, glob, find, walk,
cat ranges, open/seek/read) answer as the target filesystem does, over an HTTP store
and local files, every name spelt `dmdask://` and the target's URL; and fsspec's own
abstract `get` suite (`fsspec.tests.abstract`), with the scenarios written through the target."""
import os

import distributed
import fsspec
import pytest
from fsspec.tests.abstract import AbstractFixtures, AbstractGetTests

import dmdask
from dmdask.fs import DmdaskFileSystem
from benchmarks.store_server import StoreServer

GLOBS = ["*", "*/", "**", "**/", "*/*", "*/*.bin", "sub*", "sub*/*", "**/*.bin", "*.bin", "[ab]*", "sub/**",
         "sub/*/", "nothing*", "a.bin"]
TREE = []  # the tree's local folder
RANGES = [(None, None), (0, 10), (5, None), (-7, None), (3, -2), (10, 15), (0, 0)]  # (not past either end: HTTP and local files differ there)


@pytest.fixture(scope="module")
def cluster():
    with dmdask.LocalCluster(n_workers=2, ram="64 MiB", dashboard_address=None) as c, distributed.Client(c):
        yield c
        dmdask.fs.close()


@pytest.fixture(scope="module")
def tree(tmp_path_factory):
    root = tmp_path_factory.mktemp("tree") / "d"
    for name, size in [("a.bin", 3000), ("b.bin", 17), ("sub/c.bin", 70_000), ("sub/deep/e.bin", 5),
                       ("sub2/f.txt", 1), ("empty.bin", 0)]:
        path = root / name
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_bytes(bytes((i * 7 + len(name)) % 256 for i in range(size)))
    TREE[:] = [str(root)]
    return root


@pytest.fixture(scope="module", params=["http", "file"])
def pair(request, tree, cluster):
    """(the target filesystem, dmdask:: over it, the tree's root in target naming)."""
    if request.param == "file":
        yield fsspec.filesystem("file"), fsspec.filesystem("dmdask", target_protocol="file"), str(tree)
        return
    with StoreServer(str(tree.parent)) as store:
        yield fsspec.filesystem("http"), fsspec.filesystem("dmdask", target_protocol="http"), f"{store.url}/d"


def same(call, target, through, rename=None):
    """call(target) and call(through), each its value or the type of what it raised;
    rename(value, name) makes the target's value name its paths as `through` does
    (`name`: a target path -> dmdask://URL)."""
    def outcome(fs):
        try:
            return call(fs)
        except Exception as exc:  # noqa: BLE001 - the contract covers errors too
            return type(exc)
    want = outcome(target)
    if rename is not None and not isinstance(want, type):
        want = rename(want, through.unstrip_protocol)
    return want, outcome(through)


def names(value, name):
    """A list of paths, or a dict keyed by them, as `name` spells them."""
    return {name(k): v for k, v in value.items()} if isinstance(value, dict) else [name(p) for p in value]


def test_listings_and_infos_answer_as_the_target(pair):
    target, through, root = pair
    for folder in [root, f"{root}/sub", f"{root}/sub/deep"]:
        want, got = same(lambda fs: sorted(fs.ls(folder, detail=False)), target, through, names)
        assert got == want, folder
        want, got = same(lambda fs: sorted((e["name"], e["type"], e.get("size")) for e in fs.ls(folder, detail=True)),
                         target, through, lambda v, name: [(name(n), *rest) for n, *rest in v])
        assert got == want, folder
    for name in ["a.bin", "sub/c.bin", "empty.bin", "missing.bin"]:
        want, got = same(lambda fs: {k: fs.info(f"{root}/{name}").get(k) for k in ("name", "size", "type")},
                         target, through, lambda v, name: dict(v, name=name(v["name"])))
        assert got == want, name
    for kwargs in [{}, {"withdirs": True}, {"maxdepth": 1}, {"maxdepth": 2, "withdirs": True}, {"detail": True}]:
        want, got = same(lambda fs: fs.find(root, **kwargs), target, through, names)
        assert (list(got) if kwargs.get("detail") else got) == list(want), kwargs
    want, got = same(lambda fs: [(d, sorted(ds), sorted(fs_)) for d, ds, fs_ in fs.walk(root)], target, through,
                     lambda v, name: [(name(d), ds, fs_) for d, ds, fs_ in v])
    assert got == want


def test_glob_answers_as_the_target_folders_included(pair):
    target, through, root = pair
    for pattern in GLOBS:
        want, got = same(lambda fs: fs.glob(f"{root}/{pattern}"), target, through, names)
        assert got == want, pattern
    assert any(p.rstrip("/").endswith("/sub") for p in through.glob(f"{root}/*"))  # class folders found by glob


def test_reads_answer_as_the_target(pair):
    target, through, root = pair
    for name in ["a.bin", "b.bin", "sub/c.bin", "empty.bin"]:
        path = f"{root}/{name}"
        for start, end in RANGES if name != "empty.bin" else [(None, None), (0, 0)]:
            want, got = same(lambda fs: fs.cat_file(path, start=start, end=end), target, through)
            assert got == want, (name, start, end)
        want, got = same(lambda fs: fs.cat_ranges([path, path], [0, 2], [5, 9]), target, through)
        assert got == want, name

        def seeks(fs):
            out = []
            with fs.open(path, "rb") as f:
                out.append(f.read(10))
                f.seek(0, 2)
                out.append((f.tell(), f.read(5)))
                f.seek(-3, 2)
                out.append(f.read())
                f.seek(1)
                out += [f.read(4), f.tell(), f.read()]
            return out
        if name != "empty.bin":  # seeking before its start: an OSError from a local file, a ValueError here
            want, got = same(seeks, target, through)
            assert got == want, name
    want, got = same(lambda fs: fs.cat_file(f"{root}/missing.bin"), target, through)
    assert got == want and issubclass(got, FileNotFoundError)


def test_every_name_keeps_the_dmdask_prefix_and_opens_through_dmdask(pair):
    """A reader that re-opens what it listed (DuckDB, Hugging Face datasets) stays in
    dmdask: each name is `dmdask://URL`, opens by itself as a `DmdaskFileSystem` (also
    chained again as `dmdask::dmdask://URL`), and the target's times and keys answer."""
    target, through, root = pair
    listed = {
        "ls": through.ls(root, detail=False) + [e["name"] for e in through.ls(f"{root}/sub", detail=True)],
        "find": through.find(root, withdirs=True) + list(through.find(root, detail=True)),
        "glob": through.glob(f"{root}/**") + list(through.glob(f"{root}/*", detail=True)),
        "walk": [d for d, _, _ in through.walk(root)],
        "info": [through.info(f"{root}/a.bin")["name"], through.info(f"{root}/sub")["name"]],
        "unstrip_protocol": [through.unstrip_protocol(f"{root}/a.bin"),
                             through.unstrip_protocol(through.unstrip_protocol(f"{root}/a.bin"))],
    }
    for method, found in listed.items():
        assert found and all(p.startswith("dmdask://") and not p.startswith("dmdask://dmdask") for p in found), \
            (method, found)
    name = through.unstrip_protocol(f"{root}/sub/c.bin")
    want = target.cat_file(f"{root}/sub/c.bin")
    for spelling in [name, f"dmdask::{name}"]:
        fs, path = fsspec.core.url_to_fs(spelling)
        assert isinstance(fs, DmdaskFileSystem) and fs.target_protocol == through.target_protocol, spelling
        with fsspec.open(spelling, "rb") as f:
            assert f.read() == want, spelling
    anywhere = fsspec.filesystem("dmdask")  # no target: each URL names its own (DuckDB registers it so)
    assert anywhere.ls(through.unstrip_protocol(root), detail=False) == through.ls(root, detail=False)
    assert anywhere.cat_file(name) == want and anywhere.glob(f"{root}/*.bin") == through.glob(f"{root}/*.bin")
    assert through.cat(f"{root}/a.bin") == target.cat_file(f"{root}/a.bin")
    # several files: keyed in the caller's spelling, as the target keys the paths it is given
    assert through.cat([f"{root}/a.bin"]) == target.cat([f"{root}/a.bin"])
    named = through.unstrip_protocol(f"{root}/a.bin")
    assert through.cat([named]) == {named: target.cat_file(f"{root}/a.bin")}
    path = f"{root}/a.bin"
    name = through.unstrip_protocol(path)
    assert through.ukey(name) == through.ukey(path) and through.ukey(path) != through.ukey(f"{root}/b.bin")
    assert isinstance(through.checksum(path), int)
    when = through.modified(name)
    assert when.tzinfo is not None and abs(when.timestamp() - os.path.getmtime(os.path.join(TREE[0], "a.bin"))) < 1.5
    if through.target_protocol == "file":
        assert through.created(path) == target.created(path)


class ThroughLocal(DmdaskFileSystem):
    """dmdask:: over local files whose writes (only the suite's scenarios make them) go
    to the target, each starting a new run (so listings are read again)."""

    protocol = "dmdask-writable-for-tests"

    def _write(self, op, path, *args, **kwargs):
        out = getattr(self.fs, op)(self.target_path(path), *args, **kwargs)
        self.invalidate_cache()
        return out

    def mkdir(self, path, create_parents=True, **kwargs):
        return self._write("mkdir", path, create_parents=create_parents, **kwargs)

    def makedirs(self, path, exist_ok=False):
        return self._write("makedirs", path, exist_ok=exist_ok)

    def touch(self, path, truncate=True, **kwargs):
        return self._write("touch", path, truncate=truncate, **kwargs)

    def pipe_file(self, path, value, **kwargs):
        return self._write("pipe_file", path, value, **kwargs)

    def rm(self, path, recursive=False, maxdepth=None):
        return self._write("rm", path, recursive=recursive, maxdepth=maxdepth)


@pytest.mark.usefixtures("cluster")
class TestFsspecAbstractGet(AbstractFixtures, AbstractGetTests):
    """fsspec's own `get` suite: copies from `dmdask::` (over local files) to local disk."""

    @pytest.fixture
    def fs(self, cluster):
        return ThroughLocal(target_protocol="file", target_options={"auto_mkdir": True}, scheduler=cluster.scheduler_address)

    @pytest.fixture
    def fs_path(self, tmpdir):
        return str(tmpdir)

    @pytest.fixture
    def fs_join(self):
        return os.path.join
