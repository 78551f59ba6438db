"""The front door: the README's runnable code, `dmdask --help`, a quiet LocalCluster close,
the packaging metadata, and the PyTorch example under torchrun."""
import logging
import os
import re
import subprocess
import sys

import distributed
import pytest

import dmdask
from dmdask.testing.datasets import write_zarr

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
RUNNABLE = "<!-- runnable -->"


def _env():
    return dict(os.environ, PYTHONPATH=os.pathsep.join([ROOT, os.environ.get("PYTHONPATH", "")]).rstrip(os.pathsep),
                DASK_DMDASK__PROGRESS="false")


def runnable_blocks(path):
    """The ```python blocks of a Markdown file that follow a `<!-- runnable -->` line."""
    text = open(path).read()
    return re.findall(re.escape(RUNNABLE) + r"\s*```python\n(.*?)```", text, flags=re.S)


def test_a_normal_local_cluster_close_logs_no_lost_blocks(tmp_path):
    """Closing a LocalCluster releases dmdask's datasets first: the scheduler has no
    computed blocks to lose (and warn about) as each worker leaves."""
    path = write_zarr(str(tmp_path / "train.zarr"), 300, chunk=32)
    records = []
    handler = logging.Handler(logging.WARNING)
    handler.emit = records.append
    logger = logging.getLogger("distributed.scheduler")
    logger.addHandler(handler)
    try:
        with dmdask.LocalCluster(n_workers=2, ram="16 MiB") as cluster, distributed.Client(cluster) as client:
            assert sum(len(b["index"]) for b in dmdask.batches(client, dmdask.Spec(path, batch_size=64))) == 300
            assert dmdask.stats(client)["datasets"]
    finally:
        logger.removeHandler(handler)
    assert not [r.getMessage() for r in records if "dmdask-block" in r.getMessage()]


def test_readme_first_code_block_is_runnable_and_runs(tmp_path):
    blocks = runnable_blocks(os.path.join(ROOT, "README.md"))
    assert blocks, "README.md has no block marked runnable"
    readme = open(os.path.join(ROOT, "README.md")).read()
    first = re.search(r"```(\w*)\n(.*?)```", readme, flags=re.S)
    assert first.group(1) == "python" and first.group(2) == blocks[0], "the README's first code block is runnable"
    for i, code in enumerate(blocks):
        script = tmp_path / f"readme_{i}.py"
        script.write_text(code)
        done = subprocess.run([sys.executable, str(script)], cwd=tmp_path, env=_env(), capture_output=True,
                              text=True, timeout=240)
        assert done.returncode == 0, f"README block {i} failed:\n{done.stdout}\n{done.stderr}"
        assert "Traceback" not in done.stderr


def test_docs_runnable_blocks_run_without_warnings(tmp_path):
    """Every block marked runnable in docs/ runs as written, in an empty folder, and warns
    about nothing (say, Zarr v3 on consolidated metadata)."""
    blocks = []
    for top, _, names in os.walk(os.path.join(ROOT, "docs")):
        for name in sorted(names):
            if name.endswith(".md"):
                blocks += [(os.path.relpath(os.path.join(top, name), ROOT), b)
                           for b in runnable_blocks(os.path.join(top, name))]
    assert blocks, "docs/ has no block marked runnable"
    for i, (doc, code) in enumerate(blocks):
        script = tmp_path / f"doc_{i}.py"
        script.write_text(code)
        done = subprocess.run([sys.executable, "-W", "default", str(script)], cwd=tmp_path, env=_env(),
                              capture_output=True, text=True, timeout=240)
        assert done.returncode == 0, f"{doc} block failed:\n{done.stdout}\n{done.stderr}"
        assert "Traceback" not in done.stderr and "Warning" not in done.stderr, f"{doc}: {done.stderr}"


def test_cli_help_lists_the_subcommands():
    done = subprocess.run([sys.executable, "-m", "dmdask.cli", "--help"], env=_env(), capture_output=True,
                          text=True, timeout=60)
    assert done.returncode == 0, done.stderr
    for word in ("demo", "status", "usage"):
        assert word in done.stdout
    assert subprocess.run([sys.executable, "-m", "dmdask.cli", "status", "--help"], env=_env(),
                          capture_output=True, timeout=60).returncode == 0
    assert subprocess.run([sys.executable, "-m", "dmdask.cli", "nonsense"], env=_env(),
                          capture_output=True, timeout=60).returncode == 2


def test_license_is_an_spdx_string_with_a_setuptools_that_takes_it():
    try:
        import tomllib
    except ImportError:  # Python 3.10
        tomllib = pytest.importorskip("tomli")
    with open(os.path.join(ROOT, "pyproject.toml"), "rb") as f:
        meta = tomllib.load(f)
    assert meta["project"]["license"] == "BSD-3-Clause"
    requires = " ".join(meta["build-system"]["requires"])
    version = re.search(r"setuptools>=(\d+)", requires)
    assert version and int(version.group(1)) >= 77  # the first setuptools that takes an SPDX license string
    assert "scikit-learn" in " ".join(meta["project"]["optional-dependencies"]["demo"])


@pytest.mark.slow
def test_torch_example_under_torchrun_writes_the_dataset_once(tmp_path):
    """Without --source, rank 0 writes the synthetic dataset and the other rank reads
    the same path (not a copy of its own): the two ranks share one dmdask dataset."""
    torchrun = os.path.join(os.path.dirname(sys.executable), "torchrun")
    if not os.path.exists(torchrun):
        pytest.skip("torchrun is not installed")
    with dmdask.LocalCluster(n_workers=2, ram="64 MiB") as cluster, distributed.Client(cluster) as client:
        done = subprocess.run([torchrun, "--standalone", "--nproc-per-node", "2",
                               os.path.join(ROOT, "integrations", "examples", "torch_train.py"),
                               "--scheduler", cluster.scheduler_address, "--epochs", "1"],
                              cwd=tmp_path, env=_env(), capture_output=True, text=True, timeout=240)
        out = done.stdout + done.stderr
        assert done.returncode == 0, out
        assert out.count("wrote a synthetic dataset") == 1, out
        assert out.count("epoch 0: loss") == 2, out
        stats = dmdask.stats(client)
        assert stats["datasets"] == []  # rank 0 released it once every rank was done
        # one dataset read once (write_blobs: 5000 samples of 16 float32 and an int64 label), not a copy per rank
        assert stats["total"]["shared_store"]["bytes"] == 5000 * (16 * 4 + 8)


def every_dmdask_error():
    """Every subclass of DmdaskError in dmdask's modules."""
    import importlib
    import pkgutil

    for module in pkgutil.walk_packages(dmdask.__path__, "dmdask."):
        try:
            importlib.import_module(module.name)
        except ImportError:  # a framework adapter without its framework
            pass
    found, todo = set(), [dmdask.DmdaskError]
    while todo:
        cls = todo.pop()
        found.add(cls)
        todo += cls.__subclasses__()
    return sorted(found, key=lambda c: c.__name__)


def test_every_dmdask_error_pickles_with_its_message_and_attributes():
    import pickle

    made = {dmdask.SpecError: dmdask.SpecError("ram", 'a size such as "4 GiB"', "lots"),
            dmdask.BlockReadError: dmdask.BlockReadError("s3://b/x.zarr", 3, 150, 200, ValueError("bad"), " (2 tries)")}
    errors = every_dmdask_error()
    assert {dmdask.SpecError, dmdask.SourceNotAllowedError, dmdask.HandlerArgumentError} <= set(errors)
    for cls in errors:
        err = made.get(cls) or cls(f"a {cls.__name__} message")
        back = pickle.loads(pickle.dumps(err))
        assert type(back) is cls and str(back) == str(err) and back.__dict__ == err.__dict__, cls
    assert made[dmdask.SpecError].field == "ram"


def test_a_worker_with_a_bad_size_dies_with_that_error_not_a_pickling_one():
    """`DASK_DMDASK__WORKER__RAM=lots dask worker ... --worker-class dmdask.Worker`: the nanny
    reports the SpecError itself (it used to fail to unpickle it: "missing 2 required
    positional arguments")."""
    with distributed.LocalCluster(n_workers=0, dashboard_address=":0") as cluster:
        done = subprocess.run([sys.executable, "-m", "dask", "worker", cluster.scheduler_address, "--worker-class",
                               "dmdask.Worker", "--no-dashboard"], env=dict(_env(), DASK_DMDASK__WORKER__RAM="lots"),
                              capture_output=True, text=True, timeout=120)
    assert done.returncode != 0
    assert "missing 2 required positional arguments" not in done.stderr
    assert "dmdask.errors.SpecError: ram='lots' is invalid" in done.stderr


def test_relative_paths_are_the_clients_and_every_spelling_is_one_dataset(tmp_path, monkeypatch):
    """Workers started elsewhere: `data/train.zarr` is resolved in the client's working
    directory, and the absolute, ./ and ../ spellings read one dataset, once."""
    elsewhere = tmp_path / "elsewhere"
    elsewhere.mkdir()
    here = tmp_path / "job"
    write_zarr(str(here / "data" / "train.zarr"), 300, chunk=50)
    monkeypatch.chdir(elsewhere)
    with dmdask.LocalCluster(n_workers=2, ram="16 MiB") as cluster, distributed.Client(cluster) as client:
        monkeypatch.chdir(here)
        spellings = ["data/train.zarr", "./data/train.zarr", "../job/data/train.zarr",
                     str(here / "data" / "train.zarr"), f"file://{here}/data/./train.zarr"]
        for source in spellings:
            assert sum(len(b["index"]) for b in dmdask.batches(client, dmdask.Spec(source, batch_size=64))) == 300
        stats = dmdask.stats(client)
        assert [d["url"] for d in stats["datasets"]] == [str(here / "data" / "train.zarr")]
        assert stats["total"]["shared_store"]["bytes"] == 300 * (8 * 4 + 8)  # read once


def run_status(*args, **env):
    done = subprocess.run([sys.executable, "-m", "dmdask.cli", "status", *args], env=dict(_env(), **env),
                          capture_output=True, text=True, timeout=120)
    assert "Traceback" not in done.stderr, done.stderr
    return done


def test_status_takes_the_scheduler_in_every_form_and_summarises_transparent_files(tmp_path):
    import fsspec

    import dmdask.fs
    from dmdask.testing.datasets import write_folder

    folder = write_folder(str(tmp_path / "images"), classes=2, per_class=30)
    with dmdask.LocalCluster(n_workers=1, ram="16 MiB") as cluster, distributed.Client(cluster) as client:
        try:
            for d in sorted(os.listdir(folder)):
                for name in sorted(os.listdir(os.path.join(folder, d))):
                    with fsspec.open(f"dmdask::file://{folder}/{d}/{name}", "rb") as f:
                        f.read()
        finally:
            dmdask.fs.close()
        address = cluster.scheduler_address  # tcp://127.0.0.1:PORT
        host_port = address.split("://", 1)[1]
        outputs = [run_status(address), run_status(host_port), run_status("--scheduler", host_port),
                   run_status(DASK_SCHEDULER_ADDRESS=host_port), run_status(DASK_DMDASK__FS__SCHEDULER=address)]
        for done in outputs:
            assert done.returncode == 0, done.stderr
            assert "total" in done.stdout
            lines = [line for line in done.stdout.splitlines() if "(dmdask::)" in line]
            assert len(lines) == 2 and all(line.startswith("30 files") for line in lines), done.stdout  # per folder
            assert len(done.stdout.splitlines()) < 15
        dashboard = client.dashboard_link.rsplit("/", 1)[0]
    done = run_status(dashboard)
    assert done.returncode == 2 and len(done.stderr.strip().splitlines()) == 1
    assert "dashboard" in done.stderr and ":8786" in done.stderr
    for unreachable in ("127.0.0.1", "tls://127.0.0.1:1"):  # HOST alone: the default port 8786
        done = run_status(unreachable, "--timeout", "1")
        if done.returncode == 0:  # some other cluster listens on 8786 here
            continue
        assert done.returncode == 1 and len(done.stderr.strip().splitlines()) == 1, done.stderr
        assert ("tcp://127.0.0.1:8786" if "://" not in unreachable else unreachable) in done.stderr
    done = run_status(DASK_DMDASK__FS__SCHEDULER="", DASK_SCHEDULER_ADDRESS="")
    assert done.returncode == 2 and "no scheduler given" in done.stderr
