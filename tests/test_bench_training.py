"""Smoke test of benchmark scenario 2 (training time with a throttled store) at its
"tiny" size, so the harness cannot rot. It checks that the result is complete and its
numbers are sane; it asserts no speed (the figures live in docs/benchmarks.md)."""
import math
import os

import pytest

pytest.importorskip("torch", reason="the scenario's baseline and model need torch")

from benchmarks import training  # noqa: E402


@pytest.fixture(scope="module")
def result():
    return training.run("tiny")


def _check_loader(r, epochs, ranks, samples):
    assert len(r["epochs"]) == epochs
    for e in r["epochs"]:
        assert e["seconds"] > 0
        assert 0.0 <= e["stall"] <= 1.0
        assert len(e["wait_s"]) == ranks and all(0 <= w <= e["seconds"] for w in e["wait_s"])
        assert all(0 <= s <= w + 1e-9 for s, w in zip(e["start_s"], e["wait_s"]))
        assert e["samples"] >= samples  # every sample of the epoch was handed to a rank
    assert r["epoch1_s"] > 0 and r["later_s"] > 0
    assert 0.0 <= r["stall1"] <= 1.0 and 0.0 <= r["later_stall"] <= 1.0


@pytest.mark.slow
def test_tiny_preset_reports_complete_sane_numbers(result, tmp_path):
    cfg = training.PRESETS["tiny"]
    n = cfg["samples"]
    assert result["config"] == cfg
    assert result["dataset_bytes"] == n * cfg["sample_bytes"]
    assert result["store_floor_s"] > result["compute_s"] > 0  # the store is the bottleneck by design
    assert result["model_samples_per_s"] > 0
    parts = {"emulated": (cfg["world"], cfg["epochs"]), "model": (cfg["model"]["ranks"], cfg["model"]["epochs"])}
    for part, (ranks, epochs) in parts.items():
        rows = result[part]
        assert {"ideal", "dmdask"} <= set(rows)
        for name, r in rows.items():
            if r.get("status", "ok") != "ok":
                assert name == "ray" and r["reason"]
                continue
            _check_loader(r, cfg["ray_epochs"] if name == "ray" else epochs, ranks, n)
        # dmdask delivers each sample exactly once and reads each file from the store once
        assert all(e["samples"] == n for e in rows["dmdask"]["epochs"])
        assert rows["dmdask"]["store"]["bytes"] == result["dataset_bytes"]
        assert rows["dmdask"]["store"]["requests"] == n
        assert rows["dmdask"]["cache"]["blocks"] == math.ceil(n / cfg["block"])
        assert len(rows["dmdask"]["next_wait_s"]) == epochs
        if "baseline" in rows:  # no cache: the whole dataset every epoch
            assert rows["baseline"]["store"]["bytes"] == epochs * result["dataset_bytes"]
    assert "ray" in result["emulated"]

    goals = result["goals"]
    assert goals and all(set(g) == {"goal", "met", "measured"} for g in goals)
    assert all(isinstance(g["met"], bool) and g["measured"] for g in goals)

    text = training.report(result, str(tmp_path))
    assert os.path.getsize(tmp_path / "training.png") > 0
    assert "![training time](benchmarks/training.png)" in text
    assert "| dmdask |" in text and "| ideal (arrays in memory) |" in text
