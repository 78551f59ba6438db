"""The GPU benchmark (benchmarks/gpu.py) is registered and, without CUDA, records why it
measured nothing and says on the page that it has not run on a GPU yet."""
import pytest

from benchmarks import gpu, report
from benchmarks.__main__ import SCENARIOS, run


def test_gpu_scenario_is_registered():
    assert "gpu" in SCENARIOS and "gpu" in report.TITLES


@pytest.mark.skipif(not gpu.unavailable(), reason="this machine can run the GPU benchmark")
def test_without_cuda_the_gpu_scenario_records_why_and_the_page_says_so(tmp_path):
    results = run("tiny", ["gpu"], out_dir=str(tmp_path), write_doc=False)
    result = results["scenarios"]["gpu"]
    assert "error" not in result and result["skipped"] == gpu.unavailable()
    assert result["goals"][0]["met"] is False and "not run on a GPU yet" in result["goals"][0]["measured"]
    page = report.write(dict(results, scenarios={"gpu": result}), path=str(tmp_path / "benchmarks.md"),
                        plots_dir=str(tmp_path / "plots"), peers={"scenarios": {}, "command": "-", "date": "-",
                                                                  "file": "-"})
    text = open(page).read()
    assert "## 11. GPUs fed from the cache" in text and "Not run on a GPU yet" in text
