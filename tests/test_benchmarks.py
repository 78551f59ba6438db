"""Smoke test of the benchmark harness at tiny sizes, so it cannot rot.

It checks that every scenario runs and reports what its goals are judged on (bytes at the
bound, every sample once, each goal met or not); it asserts no speed (the figures live in
docs/benchmarks.md)."""
import importlib
import os

import pytest

from benchmarks import report
from benchmarks.__main__ import run


@pytest.mark.slow
def test_harness_runs_every_scenario_and_writes_the_page(tmp_path):
    results = run("tiny", ["traffic", "throughput", "control_plane", "scale"], out_dir=str(tmp_path), write_doc=False)
    assert os.path.exists(tmp_path / "tiny-latest.json")
    scenarios = results["scenarios"]
    assert not [n for n, s in scenarios.items() if "error" in s], scenarios
    for row in scenarios["traffic"]["rows"]:
        # counted by the store: dmdask never reads more than the baseline, and meets the bound
        assert row["dmdask"]["bytes"] == row["bound"]
        assert row["baseline"]["bytes"] == row["epochs"] * row["dataset"]
        assert row["bound"] <= row["monarch"]["bytes"] <= row["baseline"]["bytes"]
    throughput = scenarios["throughput"]
    assert throughput["goals"] and all(isinstance(g["met"], bool) and g["measured"] for g in throughput["goals"])
    for row in throughput["rows"]:
        assert row["memory"]["worker_cache_mib"] <= row["memory"]["capacity_mib"]
    for row in scenarios["control_plane"]["rows"]:
        assert row["epochs"][0]["tasks"] == row["blocks"]
        assert all(e["tasks"] == 0 for e in row["epochs"][1:])
    scale = scenarios["scale"]
    assert scale["work_stealing"] is True  # a stock scheduler
    for row in scale["planning"]:
        assert row["loaded"] and row["batch_ok"]  # the rank's first batch came, with its rows' data
    assert [r["blocks"] for r in scale["creation"]] == scale["config"]["blocks"]
    page = report.write(results, path=str(tmp_path / "benchmarks.md"), plots_dir=str(tmp_path / "plots"))
    text = open(page).read()
    assert "## Goals" in text and "| 1 |" in text and "| 4 |" in text
    assert sorted(os.listdir(tmp_path / "plots")) == ["control_plane.png", "scale.png", "throughput.png", "traffic.png"]


@pytest.mark.slow
def test_cold_scenario_runs_and_reports(tmp_path):
    """Scenario 10 at tiny size: both loaders deliver every sample once an epoch, dmdask reads the
    store once over both epochs, and every warm-cache point is reported."""
    results = run("tiny", ["cold"], out_dir=str(tmp_path), write_doc=False)
    cold = results["scenarios"]["cold"]
    assert "error" not in cold, cold
    for loader in ("baseline", "dmdask"):
        assert all(e["exactly_once"] for e in cold["loaders"][loader]["epochs"]), loader
    assert cold["loaders"]["dmdask"]["store_d"] == pytest.approx(1.0, abs=0.02)
    assert cold["loaders"]["baseline"]["store_d"] == pytest.approx(2.0, abs=0.02)  # 2 epochs, no cache
    points = cold["warm"]["points"]
    assert [(p["samples"], p["ranks"]) for p in points] == [(4000, 1), (4000, 2)]
    assert all(p["exactly_once"] and len(p["ratios"]) == 2 for p in points)  # the tiny preset's 2 runs a point
    page = report.write(results, path=str(tmp_path / "benchmarks.md"), plots_dir=str(tmp_path / "plots"))
    assert "| 10 |" in open(page).read() and os.listdir(tmp_path / "plots") == ["cold.png"]


@pytest.mark.slow
def test_transparent_scenario_runs_and_reports(tmp_path):
    """Its tiny preset runs in a fresh interpreter: its DataLoader forks worker processes, which must not
    inherit the threads and locks earlier tests left in this one (zarr's IO thread)."""
    import json
    import subprocess
    import sys

    root = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    code = ("import json, sys\nfrom benchmarks.__main__ import run\n"
            "json.dump(run('tiny', ['transparent'], out_dir=sys.argv[1], write_doc=False), open(sys.argv[2], 'w'),"
            " default=float)\n")
    out = tmp_path / "results.json"
    env = dict(os.environ, PYTHONPATH=os.pathsep.join([root, os.environ.get("PYTHONPATH", "")]))
    subprocess.run([sys.executable, "-c", code, str(tmp_path), str(out)], env=env, check=True, timeout=240, cwd=root)
    results = json.loads(out.read_text())
    result = results["scenarios"]["transparent"]
    assert "error" not in result, result
    rows = result["rows"]
    assert all(r["samples"] == result["config"]["samples"] * result["config"]["epochs"] for r in rows.values())
    assert rows["dmdask"]["store"]["bytes"] == result["dataset"]  # each byte once over the epochs
    assert rows["store"]["store"]["bytes"] == result["config"]["epochs"] * result["dataset"]
    page = report.write(results, path=str(tmp_path / "benchmarks.md"), plots_dir=str(tmp_path / "plots"))
    assert "Transparent mode" in open(page).read()
    assert os.listdir(tmp_path / "plots") == ["transparent.png"]


@pytest.fixture(scope="module")
def peers_tiny(tmp_path_factory):
    """`run --peers` at tiny size, once for the tests that read it: (results, its folder)."""
    pytest.importorskip("torch", reason="the ranks join a torch.distributed (gloo) process group")
    out = tmp_path_factory.mktemp("peers")
    return run("tiny", [], out_dir=str(out), write_doc=False, peers=True), out


@pytest.mark.slow
def test_peers_and_simulation_run_at_tiny_size_and_merge_into_the_page(peers_tiny):
    """`run --peers` at tiny size: dmdask, the DataLoader baseline and WebDataset run (the peers that
    `make test` does not install are reported as not run, with the reason); the simulation runs."""
    from benchmarks.peers import LOADERS
    from benchmarks.peers.goals import bound

    results, tmp_path = peers_tiny
    assert os.path.exists(tmp_path / "peers-tiny-latest.json")
    peers, simulation = results["scenarios"]["peers"], results["scenarios"]["simulate"]
    assert "error" not in peers and "error" not in simulation, (peers.get("error"), simulation.get("error"))
    size = peers["dataset_bytes"]
    for point in peers["points"]:
        epochs = point["epochs"]  # the preset's, or the point's own
        rows = point["loaders"]
        assert set(rows) == {m.NAME for m in LOADERS}  # every loader has a row, run or not
        for name, r in rows.items():
            assert r["status"] == "ok" or r["reason"], (name, r)
        for name in ("dmdask", "transparent", "dataloader", "webdataset"):
            r = rows[name]
            assert r["status"] == "ok", (name, r)
            assert len(r["epochs"]) == epochs and all(0 <= e["stall"] <= 1 for e in r["epochs"])
            assert r["memory"]["processes"] >= point["nodes"] * peers["config"]["ranks_per_node"]
        mine = rows["dmdask"]
        assert mine["exactly_once"] and all(e["samples"] == peers["config"]["samples"] for e in mine["epochs"])
        assert abs(mine["store_bytes"] / bound(peers, point) - 1) <= 0.02
        assert rows["dataloader"]["store_bytes"] >= epochs * size  # no cache
        assert rows["webdataset"]["disk_written"] > 0  # its shards cached on the nodes' disks
        # transparent mode reads each file's bytes from the store once (the dataset fits the cluster's cache)
        assert rows["transparent"]["store_bytes"] <= 1.02 * bound(peers, point), rows["transparent"]
    assert {g["goal"] for g in peers["goals"]} and all(isinstance(g["met"], bool) for g in peers["goals"])
    assert simulation["rows"] and all(r["messages_per_batch"] > 0 for r in simulation["rows"])
    assert all(t["dmdask"] <= t["per_node"] for t in simulation["traffic"])
    page = report.write(dict(results, scenarios={}), path=str(tmp_path / "benchmarks.md"),
                        plots_dir=str(tmp_path / "plots"), peers=results)
    text = open(page).read()
    assert "## 8. Beside the loaders users pick today" in text and "## 9. " in text and "| 8 |" in text
    assert "transparent" in text
    assert sorted(os.listdir(tmp_path / "plots")) == ["peers.png", "simulate.png"]


@pytest.mark.slow
def test_peers_loader_bound_point_has_no_step_and_a_same_host_run_to_compare_with(peers_tiny):
    """The loader-bound point (issue 36): no emulated step; dmdask also runs there with the point's
    ranks all on one node, one worker holding the cluster's cache (the same-host path), every
    sample once at the same store bytes; the per-rank samples/s of every loader that ran, the
    goal judged with the load average and the same-host figure, and the page's table."""
    from benchmarks.peers.goals import bound

    peers_report = importlib.import_module("benchmarks.peers.report")  # the package's `report` is its function
    results, tmp_path = peers_tiny
    peers = results["scenarios"]["peers"]
    cfg, n = peers["config"], peers["config"]["samples"]
    unbound = [p for p in peers["points"] if p["rate"] == 0]
    assert len(unbound) == 1 and all(p["rate"] == cfg["rate"] for p in peers["points"] if p not in unbound)
    point = unbound[0]
    assert point["epochs"] == 3 != cfg["epochs"]  # its own epochs, every loader ran them
    assert all(len(r["epochs"]) == 3 for r in point["loaders"].values() if r["status"] == "ok")
    ranks = point["nodes"] * cfg["ranks_per_node"]
    same, mine = point["same_host"], point["loaders"]["dmdask"]
    assert same["status"] == "ok", same
    assert (same["nodes"], same["ranks"]) == (1, ranks)
    roles = [p["role"] for p in same["processes"]]
    assert roles.count("dmdask worker") == 1 and roles.count("rank") == ranks  # every rank beside the one worker
    assert [p["node"] for p in same["processes"] if p["role"] == "rank"] == [0] * ranks
    assert [p["role"] for p in mine["processes"]].count("dmdask worker") == point["nodes"]
    assert same["exactly_once"] and len(same["epochs"]) == point["epochs"]
    assert all(e["samples"] == n and len(e["per_rank"]) == ranks for e in same["epochs"])
    assert abs(same["store_bytes"] / bound(peers, point) - 1) <= 0.02  # its one node caches what the cluster did
    for name, r in point["loaders"].items():
        if r["status"] == "ok":
            assert len(r["load_1min"]) == 2
            assert r["later_per_rank_samples_per_s"] == pytest.approx(
                sum(e["samples"] / e["wall_s"] / ranks for e in r["epochs"][1:]) / (len(r["epochs"]) - 1))
    goal = next(g for g in peers["goals"] if g["goal"].startswith("#36: loader-bound"))
    assert isinstance(goal["met"], bool) and "no step" in goal["measured"] and "same host" in goal["measured"]
    assert "load " in goal["measured"]
    table = "\n".join(peers_report.per_rank(peers))
    assert "dmdask, same host" in table and "dmdask remote / same host, per rank" in table
    text = open(report.write(dict(results, scenarios={}), path=str(tmp_path / "page.md"),
                             plots_dir=str(tmp_path / "plots2"), peers=results)).read()
    assert "no emulated step (loader-bound)" in text and table in text


@pytest.mark.slow
def test_peer_path_scenario_runs_and_checks_that_every_remote_row_crossed_tcp(tmp_path):
    """Scenario 12 at tiny size: the link, Dask's gather and every dmdask configuration are measured in each
    repetition; each remote epoch read the whole dataset and the worker's `peer.bytes_out` rose by at least
    the bytes it read (nothing mapped); every goal of issue 36 is judged."""
    from benchmarks.peer_path import SIZES, HOLDER_HOST, READER_HOST

    results = run("tiny", ["peer_path"], out_dir=str(tmp_path), write_doc=False)
    result = results["scenarios"]["peer_path"]
    assert "error" not in result, result
    cfg = result["config"]
    assert (READER_HOST, HOLDER_HOST) == ("127.0.0.1", "127.0.0.2")
    for summary in (result["link"], result["gather"]):
        assert len(summary["reps"]) == cfg["reps"] and summary["mb_per_s"] > 0
    assert all(r["bytes"] == r["transfers"] * cfg["tcp_bytes"] for r in result["link"]["reps"])
    assert all(r["bytes"] == r["gathers"] * cfg["gather"] * 8 * 2**20 for r in result["gather"]["reps"])
    expected = [("remote", s, True) for s in SIZES] + [("remote", s, False) for s in SIZES] + \
        [("same_host", s, True) for s in SIZES]
    assert sorted((r["path"], r["size"], r["shuffle"]) for r in result["rows"]) == sorted(expected)
    for row in result["rows"]:
        assert len(row["reps"]) == cfg["reps"]
        n = cfg["samples"][row["size"]]
        for rep in row["reps"]:  # every sample of the dataset each epoch, each with its bytes and its label
            assert rep["epochs"] >= 1 and rep["samples"] == rep["epochs"] * n
            assert rep["bytes"] == rep["epochs"] * n * (row["sample_bytes"] + 8)
        assert row["to_raw_tcp"] > 0 and set(row["cpu_per_gb"]) == {"reader", "holder", "softirq", "scheduler", "total"}
        assert set(row["faults_per_mb"]) == {"reader", "holder"}
        if row["path"] == "remote":
            check = row["bytes_out_check"]
            assert check["every_row_crossed_tcp"], check
            assert all(out >= read for out, read in zip(check["bytes_out"], check["bytes_read"]))
    addresses = result["addresses"]
    assert addresses["only_the_two_addresses"] and addresses["holders_listen_on_holder_host"], addresses
    assert addresses["readers"]["connected"] == ["127.0.0.1"] and addresses["worker"]["listen"] == ["127.0.0.2"]
    assert result["worker_ram_bytes"] >= sum(n * (SIZES[s][0] + 8) for s, n in cfg["samples"].items())
    judged = [g["goal"] for g in result["goals"]]
    assert len(judged) == 7 and all(isinstance(g["met"], bool) and "load" in g["measured"] for g in result["goals"])
    page = report.write(results, path=str(tmp_path / "benchmarks.md"), plots_dir=str(tmp_path / "plots"))
    text = open(page).read()
    assert "## 12. The peer path" in text and "| 12 | remote >= 0.8x raw TCP (110KB, shuffled) |" in text


@pytest.mark.slow
def test_faults_scenario_delivers_every_sample_once_with_a_paused_worker_and_a_flaky_store(tmp_path):
    """Scenario 13 at tiny size: a worker SIGSTOPped mid-epoch (cold and warm) with a store that
    answers 503 to every 20th GET and holds every 100th: every epoch delivers every sample once
    (the scenario itself fails otherwise), the store sends the dataset once without faults and its
    503s are counted with them; the page gets its section."""
    results = run("tiny", ["faults"], out_dir=str(tmp_path), write_doc=False)
    faults = results["scenarios"]["faults"]
    assert "error" not in faults, faults
    rows = {row["name"]: row for row in faults["rows"]}
    assert list(rows) == ["none", "paused+flaky"]
    assert all(e["exactly_once"] for row in rows.values() for e in row["epochs"])
    cold, warm = rows["none"]["epochs"]
    assert cold["store_bytes"] == faults["dataset_bytes"] and warm["store_bytes"] == 0  # the dataset, once
    faulty_cold = rows["paused+flaky"]["epochs"][0]
    assert faulty_cold["failed"] > 0 and faulty_cold["store_bytes"] >= faults["dataset_bytes"]


def test_first_contact_scenario_runs_and_reports(tmp_path):
    """Scenario 14 at tiny size: both ranks get a first batch of their own rows (one-byte
    fill values), every block loads, and the scheduler's cost and stalls are reported."""
    results = run("tiny", ["first_contact"], out_dir=str(tmp_path), write_doc=False)
    result = results["scenarios"]["first_contact"]
    assert "error" not in result, result
    for row in result["rows"]:
        assert row["every_block_loaded_s"] is not None  # every block loaded within the timeout
        assert [r["rank"] for r in row["ranks"]] == [0, result["config"]["other"]]
        assert all(r["error"] is None and r["batch_ok"] for r in row["ranks"]), row["ranks"]
        assert row["scheduler_cpu_s"] > 0 and "scheduler" in row["stalls"]
    assert result["goals"] and all(isinstance(g["met"], bool) and g["measured"] for g in result["goals"])
    page = report.write(results, path=str(tmp_path / "benchmarks.md"), plots_dir=str(tmp_path / "plots"))
    assert "| 14 |" in open(page).read()


@pytest.mark.slow
def test_token_corpus_scenario_runs_and_reports(tmp_path):
    """Scenario 15 at tiny size: a sparse token file (nothing written), two ranks of their own
    processes each get a first batch of their windows (zeros, ids within the epoch), and the
    time and allocations of each are reported against the goal; then warm epochs on the same host
    against numpy slicing."""
    results = run("tiny", ["token_corpus"], out_dir=str(tmp_path), write_doc=False)
    result = results["scenarios"]["token_corpus"]
    assert "error" not in result, result
    assert result["on_disk_bytes"] < result["file_bytes"] // 100  # described, not written
    ranks = result["ranks"]
    assert [x["rank"] for x in ranks] == [result["config"]["first"], result["config"]["second"], result["config"]["first"]]
    assert [x["blend"] for x in ranks] == [1, 1, 3]  # a token file, then a blend of 3
    assert all(x["error"] is None and x["batch_ok"] and len(x["windows"]) == result["config"]["batch"] for x in ranks)
    assert all(x["allocated_peak_mib"] > 0 and x["first_batch_s"] > 0 for x in ranks)
    # warm tokens/s: every batch from the arenas on this host (no request), the last one's windows numpy's slices
    warm = result["warm"]
    assert [x["batch"] for x in warm] == result["config"]["warm_batches"]
    assert all(x["error"] is None and x["windows_right"] and x["requests"] == 0 and x["tokens_s"] > 0 for x in warm)
    assert result["goals"] and all(isinstance(g["met"], bool) and g["measured"] for g in result["goals"])
    page = report.write(results, path=str(tmp_path / "benchmarks.md"), plots_dir=str(tmp_path / "plots"))
    assert "| 15 |" in open(page).read() and "Warm tokens/s" in open(page).read()


def test_science_windows_scenario_reads_the_store_once_and_checks_every_window(tmp_path):
    """Scenario 16 at tiny size: dmdask's time windows of an xarray-written Zarr and
    xbatcher's, each pass every window once with sampled windows equal to the generated
    values (the scenario fails otherwise); dmdask's store bytes are the dataset's, once."""
    results = run("tiny", ["science_windows"], out_dir=str(tmp_path), write_doc=False)
    result = results["scenarios"]["science_windows"]
    assert "error" not in result, result
    dmdask_passes, xbatcher_passes = result["rows"]["dmdask"], result["rows"]["xbatcher"]
    assert all(p["windows"] == result["windows"] for p in dmdask_passes + xbatcher_passes)
    assert dmdask_passes[0]["store_bytes"] == result["config"]["dataset_bytes"]  # cold: every chunk once
    assert [p["store_bytes"] for p in dmdask_passes[1:]] == [0, 0]  # warm: from the cache
    assert all(p["store_bytes"] >= result["config"]["dataset_bytes"] for p in xbatcher_passes)  # every pass
    page = report.write(results, path=str(tmp_path / "benchmarks.md"), plots_dir=str(tmp_path / "plots"))
    assert "| 16 |" in open(page).read() and "xbatcher" in open(page).read()
