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
