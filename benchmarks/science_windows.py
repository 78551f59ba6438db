"""Scenario 15: time windows of a (time, lat, lon) Zarr for science models (issue 40).

An xarray Dataset of two float32 variables on a lat/lon grid and a datetime "time"
coordinate, written by xarray to Zarr v3 (chunks of `chunk` steps) and served by a
`benchmarks.store_server` process with a per-request latency and a bandwidth cap: an
object store or a parallel file system shared with other jobs. A sample is a window of
`length` consecutive steps every `stride` steps (inputs and targets of a forecast model),
batches of `batch` windows, shuffled.

Side by side in one run, in this process, each reading the same store:

- dmdask: `Spec(url, window=dmdask.Window(length, stride, dim="time"))` on a
  `dmdask.LocalCluster` whose RAM holds the dataset; `passes` epochs, the first cold.
- xbatcher: `BatchGenerator(xr.open_zarr(url), input_dims={time: length, lat, lon},
  input_overlap={time: length - stride})`, the windows taken in a new random order each
  pass (as a `DataLoader(shuffle=True)` over its `MapDataset` does) and stacked into
  batches of `batch`; every pass reads the store.

xbatcher's own `cache=` (a dict the batches are written to as Zarr) was tried as a third
row: with zarr-python 3 its passes 2+ read the store as much as its first and ran 1.6-2x
slower than it, so it is not shown.

Recorded per pass: seconds, the bytes of chunks the store sent (x the dataset's), the
windows delivered. Every pass of every loader checks that each window came exactly once
and compares sampled windows with the generated values (a wrong window fails the run).
"""
from __future__ import annotations

import os
import time

import numpy as np

from .common import ratio, workdir
from .store_server import StoreProcess

PRESETS = {
    "tiny": {"steps": 240, "lat": 8, "lon": 16, "chunk": 24, "length": 8, "stride": 4, "batch": 8, "passes": 3,
             "latency": 0.002, "bandwidth": "64MB"},
    "quick": {"steps": 2920, "lat": 32, "lon": 64, "chunk": 32, "length": 8, "stride": 4, "batch": 16, "passes": 3,
              "latency": 0.01, "bandwidth": "128MB"},  # 4 years of 6-hourly steps, 47 MiB
    "full": {"steps": 14600, "lat": 90, "lon": 180, "chunk": 32, "length": 8, "stride": 4, "batch": 16, "passes": 3,
             "latency": 0.01, "bandwidth": "256MB"},  # 10 years at 2 degrees, 1.8 GiB
}
VARIABLES = ("t2m", "u10")
GOAL_WARM_SPEEDUP = 10.0  # passes 2+ at least this many times faster than the cold pass
GOAL_STORE_BOUND = 1.02  # chunk bytes over every pass, x the dataset


def _values(name: str, steps: np.ndarray, lat: int, lon: int) -> np.ndarray:
    """The generated values of variable `name` at time steps `steps`: float32 noise seeded by
    the variable and the step (about as hard to compress as measured fields)."""
    salt = VARIABLES.index(name)
    return np.stack([np.random.default_rng([salt, int(t)]).standard_normal((lat, lon), dtype=np.float32)
                     for t in steps])


def _write(path: str, cfg) -> int:
    """Write the dataset with xarray (its default codecs), 16 chunks of steps at a time;
    returns the bytes of its chunks as stored (what a pass that reads each chunk once sends)."""
    import pandas as pd
    import xarray as xr

    steps, lat, lon, chunk = cfg["steps"], cfg["lat"], cfg["lon"], cfg["chunk"]
    coords = {"time": pd.date_range("2000-01-01", periods=steps, freq="6h"),
              "lat": np.linspace(-90, 90, lat), "lon": np.linspace(0, 360, lon, endpoint=False)}
    for start in range(0, steps, chunk * 16):
        part = np.arange(start, min(steps, start + chunk * 16))
        ds = xr.Dataset({v: (("time", "lat", "lon"), _values(v, part, lat, lon)) for v in VARIABLES},
                        coords=dict(coords, time=coords["time"][part]))
        encoding = {v: {"chunks": (chunk, lat, lon)} for v in VARIABLES} | {"time": {"chunks": (chunk,)}}
        if start == 0:
            ds.to_zarr(path, zarr_format=3, consolidated=False, encoding=encoding)
        else:
            ds.to_zarr(path, zarr_format=3, consolidated=False, append_dim="time")
    return sum(os.path.getsize(os.path.join(folder, name)) for folder, _, names in os.walk(path)
               for name in names if _is_chunk(os.path.relpath(os.path.join(folder, name), path)))


def _is_chunk(path: str) -> bool:
    """Whether `path` (in the group) is a chunk of a variable or of the time coordinate."""
    return path.split("/")[0] in VARIABLES + ("time",) and "/c/" in path


def _chunk_bytes(store) -> int:
    """Bytes the store sent for chunks (the variables' and the time coordinate's)."""
    return sum(v["bytes"] for p, v in store.stats()["by_path"].items() if _is_chunk(p.split("/", 1)[-1]))


def _check(ids: list, count: int, windows: dict, cfg, who: str) -> None:
    if sorted(ids) != list(range(count)):
        raise AssertionError(f"{who}: {len(ids)} windows delivered, {len(set(ids))} distinct, of {count}")
    for w, fields in windows.items():
        steps = np.arange(w * cfg["stride"], w * cfg["stride"] + cfg["length"])
        for v in VARIABLES:
            np.testing.assert_array_equal(fields[v], _values(v, steps, cfg["lat"], cfg["lon"]), err_msg=f"{who} {v} {w}")


def _dmdask_passes(url: str, cfg, store, count: int) -> list:
    import distributed

    import dmdask

    window = dmdask.Window(cfg["length"], cfg["stride"], dim="time")
    ram = f"{max(64, 4 * cfg['dataset_bytes'] // 2**20)} MiB"
    out = []
    with dmdask.LocalCluster(n_workers=2, ram=ram) as cluster, distributed.Client(cluster) as client:
        for epoch in range(cfg["passes"]):
            store.reset_stats()
            spec = dmdask.Spec(url, batch_size=cfg["batch"], seed=0, window=window)
            started, ids, sampled = time.perf_counter(), [], {}
            for batch in dmdask.batches(client, spec, epoch=epoch, progress=False):
                ids += batch["index"].tolist()
                if len(sampled) < 8:
                    sampled[int(batch["index"][0])] = {v: batch[v][0] for v in VARIABLES}
            seconds = time.perf_counter() - started
            _check(ids, count, sampled, cfg, f"dmdask pass {epoch + 1}")
            out.append({"seconds": seconds, "store_bytes": _chunk_bytes(store), "windows": len(ids)})
    return out


def _xbatcher_passes(url: str, cfg, store, count: int) -> list:
    """xbatcher reading the store directly, with Dask's threads whatever the process's
    default scheduler (a `distributed.Client` made earlier in it would otherwise be asked)."""
    import dask
    import xarray as xr
    import xbatcher

    out = []
    rng = np.random.default_rng(0)
    with dask.config.set(scheduler="threads"):
        for epoch in range(cfg["passes"]):
            store.reset_stats()
            started, ids, sampled = time.perf_counter(), [], {}
            ds = xr.open_zarr(url, consolidated=False)  # a new trainer process each pass would open it again too
            dims = {"time": cfg["length"], "lat": cfg["lat"], "lon": cfg["lon"]}
            generator = xbatcher.BatchGenerator(ds[list(VARIABLES)], input_dims=dims,
                                                input_overlap={"time": cfg["length"] - cfg["stride"]})
            if len(generator) != count:
                raise AssertionError(f"xbatcher makes {len(generator)} windows, dmdask {count}")
            order = rng.permutation(count)
            for at in range(0, count, cfg["batch"]):
                chosen = order[at:at + cfg["batch"]].tolist()
                windows = [generator[w] for w in chosen]
                batch = {v: np.stack([w[v].values for w in windows]) for v in VARIABLES}
                ids += chosen
                if len(sampled) < 8:
                    sampled[chosen[0]] = {v: batch[v][0] for v in VARIABLES}
            seconds = time.perf_counter() - started
            _check(ids, count, sampled, cfg, f"xbatcher pass {epoch + 1}")
            out.append({"seconds": seconds, "store_bytes": _chunk_bytes(store), "windows": len(ids)})
    return out


def run(preset: str) -> dict:
    cfg = dict(PRESETS[preset])
    count = (cfg["steps"] - cfg["length"]) // cfg["stride"] + 1
    with workdir("science-windows") as root:
        path = os.path.join(root, "era.zarr")
        cfg["dataset_bytes"] = _write(path, cfg)
        rows = {}
        load = [os.getloadavg()[0]]
        with StoreProcess("benchmarks.store_server:main", root, "--latency", cfg["latency"], "--bandwidth",
                          cfg["bandwidth"]) as store:
            url = store.url + "/era.zarr"
            rows["xbatcher"] = _xbatcher_passes(url, cfg, store, count)
            load.append(os.getloadavg()[0])
            rows["dmdask"] = _dmdask_passes(url, cfg, store, count)
            load.append(os.getloadavg()[0])
    result = {"config": cfg, "windows": count, "rows": rows, "load": [min(load), max(load)]}
    result["goals"] = goals(result)
    return result


def goals(result: dict) -> list:
    passes, d = result["rows"]["dmdask"], result["config"]["dataset_bytes"]
    warm = min(passes[0]["seconds"] / p["seconds"] for p in passes[1:])
    store = sum(p["store_bytes"] for p in passes) / d
    load = f" (load {result['load'][0]:.1f}-{result['load'][1]:.1f})"
    return [
        {"goal": "every window once per pass (checked; sampled windows equal the generated values)", "met": True,
         "measured": f"{result['windows']} windows a pass, every loader and pass"},
        {"goal": f"dmdask: store bytes over all passes <= {GOAL_STORE_BOUND}x the dataset", "met": store <= GOAL_STORE_BOUND,
         "measured": f"{store:.3f}x{load}"},
        {"goal": f"dmdask: passes 2+ >= {GOAL_WARM_SPEEDUP:g}x faster than the cold pass", "met": warm >= GOAL_WARM_SPEEDUP,
         "measured": f"{warm:.1f}x (the slowest warm pass){load}"},
    ]


def report(result: dict, plots_dir: str) -> str:
    cfg, d = result["config"], result["config"]["dataset_bytes"]
    text = (f"A (time, lat, lon) dataset written by xarray to Zarr v3: {cfg['steps']} six-hourly steps of "
            f"{cfg['lat']} x {cfg['lon']} float32 for {len(VARIABLES)} variables ({', '.join(VARIABLES)}) and the "
            f"time coordinate, chunks of {cfg['chunk']} steps ({d / 2**20:.1f} MiB as stored), on a store process with "
            f"{cfg['latency'] * 1000:g} ms a request and {cfg['bandwidth']}/s in all. Windows of {cfg['length']} "
            f"steps every {cfg['stride']} ({result['windows']} a pass), batches of {cfg['batch']}, a new random "
            f"order each pass; no training step. dmdask: `Window({cfg['length']}, {cfg['stride']}, dim=\"time\")` "
            "on a 2-worker `LocalCluster` (RAM tier), the first pass cold. xbatcher: `BatchGenerator` over "
            "`xr.open_zarr(url)` (dask chunks), the windows taken in random order and stacked. Store bytes: "
            "chunk bytes the store sent in the pass, x the chunks' bytes as stored (xarray's default codecs). "
            "Each pass checks every window once and compares sampled windows with the generated values. "
            f"Load average (1 min): {result['load'][0]:.1f}-{result['load'][1]:.1f} on {os.cpu_count()} cores.")
    lines = ["| loader | pass | seconds | windows/s | / its first pass | / xbatcher's same pass | store bytes "
             "(x dataset) |", "|---|--:|--:|--:|--:|--:|--:|"]
    plain = result["rows"]["xbatcher"]
    for name, passes in result["rows"].items():
        for i, p in enumerate(passes):
            lines.append(f"| {name} | {i + 1} | {p['seconds']:.2f} | {p['windows'] / p['seconds']:,.0f} | "
                         f"{ratio(p['seconds'], passes[0]['seconds']):.3f} | "
                         f"{ratio(p['seconds'], plain[i]['seconds']):.3f} | {p['store_bytes'] / d:.2f} |")
    return text + "\n\n" + "\n".join(lines) + "\n"
