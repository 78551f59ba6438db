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
