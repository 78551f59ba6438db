"""dmdask.jobqueue without a batch system: the job scripts run dmdask workers, the
scheduler gets dmdask's plugin and dashboard page, and the errors say what to do.
(tests/test_slurm.py runs SLURMCluster jobs under a real Slurm.)"""
import sys

import pytest

import dmdask.jobqueue as jobqueue


def test_options_add_the_worker_class_and_the_dashboard_preload():
    options = jobqueue.dmdask_options({"cores": 1, "worker_extra_args": ["--lifetime", "1h"],
                                       "scheduler_options": {"preload": ["mine"]}})
    assert options["worker_extra_args"] == ["--lifetime", "1h", "--worker-class", "dmdask.Worker"]
    assert options["scheduler_options"]["preload"] == ["mine", "dmdask.dashboard"]
    with pytest.raises(ValueError, match="remove it from worker_extra_args"):
        jobqueue.dmdask_options({"worker_extra_args": ["--worker-class", "other.Worker"]})


def test_without_dask_jobqueue_the_error_names_the_extra(monkeypatch):
    monkeypatch.setitem(sys.modules, "dask_jobqueue", None)
    monkeypatch.delitem(jobqueue.__dict__, "SLURMCluster", raising=False)
    with pytest.raises(ImportError, match=r'pip install "dmdask\[jobqueue\]"'):
        jobqueue.SLURMCluster


@pytest.mark.parametrize("name", ["SLURMCluster", "PBSCluster"])
def test_job_scripts_start_dmdask_workers_and_the_scheduler_has_the_plugin(name):
    pytest.importorskip("dask_jobqueue")
    cls = getattr(jobqueue, name)
    with cls(cores=1, memory="1500MiB", processes=1, scheduler_options={"dashboard_address": ":0"}) as cluster:
        script = cluster.job_script()
        assert "--worker-class dmdask.Worker" in script
        assert "dmdask" in cluster.scheduler.extensions  # the dashboard preload installed the plugin
    assert cls.__name__ == name and cls.__module__ == "dmdask.jobqueue"
