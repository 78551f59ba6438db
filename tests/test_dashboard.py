"""The dmdask dashboard: the /dmdask page in headless Chromium, /dmdask/tiers.json and the
dmdask_* Prometheus metrics against dmdask.stats and the data loaded, `dmdask status`,
and the preload on a scheduler started with the stock CLI.

The browser test needs Chromium (`scripts/install-browser.sh`; or DMDASK_CHROMIUM=path)
and skips without it. DMDASK_UPDATE_SCREENSHOT=1 also writes docs/dashboard.png.
"""
import asyncio
from collections import deque
import base64
import importlib
import io
import json
import logging
import os
import re
import shutil
import signal
import subprocess
import sys
import tempfile
import time
import urllib.request

import distributed
import numpy as np
import pytest

import dmdask
from dmdask.dashboard.markup import fmt_bytes
from dmdask.source import open_source
from dmdask.testing.datasets import write_folder, write_zarr, zarr_sample

from conftest import all_ids, run_epoch, wait_until

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
BIN = os.path.dirname(sys.executable)
MiB = 2**20
ROW_BYTES = 256 * 4 + 8  # x: 256 float32, label: int64
RAM_RGB, SSD_RGB = (0x3B, 0x7D, 0xD8), (0xF0, 0xA2, 0x3B)
CLUSTER_METRICS = {"dmdask_dataset_bytes", "dmdask_dataset_blocks", "dmdask_dataset_loaded_blocks",
                   "dmdask_dataset_samples", "dmdask_cached_share"}
SETTLE = 20  # seconds to wait for the heartbeats to carry the workers' counters over

# -- helpers ----------------------------------------------------------------------------
def http(url: str, timeout: float = 10) -> str:
    with urllib.request.urlopen(url, timeout=timeout) as response:
        return response.read().decode()


def base_url(client) -> str:
    return client.dashboard_link.rsplit("/", 1)[0]


def tiers_json(client) -> dict:
    return json.loads(http(base_url(client) + "/dmdask/tiers.json"))


def metrics(client) -> dict:
    """{(name, frozenset(labels)): value} of the dmdask_* samples on /metrics."""
    from prometheus_client.parser import text_string_to_metric_families

    out = {}
    for family in text_string_to_metric_families(http(base_url(client) + "/metrics")):
        for sample in family.samples:
            if sample.name.startswith("dmdask_"):
                key = (sample.name, frozenset(sample.labels.items()))
                assert key not in out, f"duplicate sample {key}"
                out[key] = sample.value
    return out


def expected_metrics(stats: dict) -> dict:
    """What /metrics must say for `dmdask.stats(client)["workers"]`."""
    out = {("dmdask_workers", frozenset()): len(stats)}
    for w, s in stats.items():
        def put(name, value, **labels):
            out[(name, frozenset(dict(worker=w, **labels).items()))] = value

        for tier in ("ram", "ssd"):
            put("dmdask_tier_bytes", s[tier]["bytes"], tier=tier)
            put("dmdask_tier_capacity_bytes", s[tier]["capacity"], tier=tier)
            put("dmdask_tier_blocks", s[tier]["blocks"], tier=tier)
            put("dmdask_tier_full", int(s[tier]["full"]), tier=tier)
            put("dmdask_hits_total", s[tier]["hits"], tier=tier)
            put("dmdask_hit_bytes_total", s[tier]["hit_bytes"], tier=tier)
        put("dmdask_tier_blocks", s["streamed_blocks"], tier="stream")
        put("dmdask_hits_total", s["stream"]["hits"], tier="stream")
        put("dmdask_shared_store_bytes_total", s["shared_store"]["bytes"])
        put("dmdask_shared_store_requests_total", s["shared_store"]["requests"])
        put("dmdask_peer_bytes_total", s["peer"]["bytes_in"], direction="in")
        put("dmdask_peer_bytes_total", s["peer"]["bytes_out"], direction="out")
        put("dmdask_stream_buffer_bytes", s["stream"]["buffer_bytes"])
        put("dmdask_stream_buffer_capacity_bytes", s["stream"]["buffer_capacity"])
    return out


def settled(client, check, timeout=SETTLE):
    """Poll until `check(stats, tiers, metrics)` holds for one consistent reading
    (dmdask.stats, then the JSON and /metrics), so heartbeat lag cannot fail the test."""
    deadline = time.monotonic() + timeout
    while True:
        stats = dmdask.stats(client)
        tiers, prom = tiers_json(client), metrics(client)
        try:
            check(stats, tiers, prom)
            return stats, tiers, prom
        except AssertionError:
            if time.monotonic() > deadline:
                raise
            time.sleep(0.25)


# -- the cluster and the data it loaded --------------------------------------------------
@pytest.fixture(scope="module")
def cluster(tmp_path_factory):
    """Two dmdask workers with 4 MiB of RAM and 4 MiB of SSD each."""
    ssd = tmp_path_factory.mktemp("ssd")
    with dmdask.LocalCluster(n_workers=2, ram="4 MiB", ssd="4 MiB", ssd_dir=str(ssd)) as cluster, \
            distributed.Client(cluster) as client:
        yield cluster, client


@pytest.fixture(scope="module")
def small(cluster, tmp_path_factory):
    """A 2.95 MiB dataset, one epoch: it fits in RAM, so every figure is exact."""
    _, client = cluster
    path = write_zarr(str(tmp_path_factory.mktemp("shared") / "small.zarr"), 3000, sample_shape=(256,), chunk=100)
    spec = dmdask.Spec(path, batch_size=100, seed=1)
    ids = all_ids(run_epoch(client, spec, world_size=2))
    assert np.array_equal(np.sort(ids), np.arange(3000))
    return spec


@pytest.fixture(scope="module")
def large(cluster, small, tmp_path_factory):
    """Then 14.8 MiB more, two epochs: it fills RAM and SSD, the rest is streamed."""
    _, client = cluster
    path = write_zarr(str(tmp_path_factory.mktemp("shared") / "large.zarr"), 15000, sample_shape=(256,), chunk=100)
    spec = dmdask.Spec(path, batch_size=250, seed=2)
    for epoch in range(2):
        for batch in dmdask.batches(client, spec, epoch=epoch, progress=False):
            np.testing.assert_array_equal(batch["x"], zarr_sample(batch["index"], (256,)))
            time.sleep(0.02)  # a training step: lets the line plot show a slope
    return spec


@pytest.mark.slow
def test_json_and_metrics_exact_for_a_dataset_that_fits(cluster, small):
    _, client = cluster
    info = open_source(small).info
    decoded = info.nbytes
    assert decoded == 3000 * ROW_BYTES

    def check(stats, tiers, prom):
        total = tiers["total"]
        assert total["ram"]["bytes"] == decoded and total["ram"]["blocks"] == 30
        assert total["ssd"]["bytes"] == 0 and total["streamed_blocks"] == 0
        assert total["shared_store"] == {"requests": 30, "bytes": decoded, "retries": 0, "read_ahead": 0, "from_ranks": 0}
        assert total["ram"]["hits"] == 3000 and total["stream"]["hits"] == 0
        assert tiers["workers"] == stats["workers"]
        assert tiers["total"] == stats["total"]
        assert {k: v for k, v in prom.items() if k[0] not in CLUSTER_METRICS} == expected_metrics(stats["workers"])

    stats, tiers, prom = settled(client, check)
    name = info.name
    assert tiers["datasets"] == {name: {"url": small.source, "blocks": 30, "loaded_blocks": 30, "samples": 3000,
                                        "bytes": decoded}}
    cluster_ = tiers["cluster"]
    assert cluster_["workers"] == 2 and cluster_["cached_share"] == 1.0
    assert cluster_["cached_bytes"] == cluster_["dataset_bytes"] == cluster_["shared_store_bytes"] == decoded
    assert cluster_["shared_store_reads_per_dataset"] == 1.0
    assert cluster_["hit_shares"] == {"ram": 1.0, "ssd": 0.0, "stream": 0.0}
    labels = frozenset({("dataset", name)})
    assert prom[("dmdask_dataset_bytes", labels)] == decoded
    assert prom[("dmdask_dataset_blocks", labels)] == prom[("dmdask_dataset_loaded_blocks", labels)] == 30
    assert prom[("dmdask_dataset_samples", labels)] == 3000
    assert prom[("dmdask_cached_share", frozenset())] == 1.0
    # every dmdask_* series is one the test expects: no stray or missing names
    assert {k[0] for k in prom} == {k[0] for k in expected_metrics(stats["workers"])} | CLUSTER_METRICS


@pytest.mark.slow
def test_json_and_metrics_when_the_tiers_overflow(cluster, small, large):
    _, client = cluster
    blocks = 30 + 150

    def check(stats, tiers, prom):
        total = tiers["total"]
        assert tiers["workers"] == stats["workers"] and total == stats["total"]
        assert total["ram"]["blocks"] + total["ssd"]["blocks"] + total["streamed_blocks"] == blocks
        assert total["ram"]["hits"] + total["ssd"]["hits"] + total["stream"]["hits"] == 3000 + 2 * 15000
        assert all(prom.get(k) == v for k, v in expected_metrics(stats["workers"]).items())

    stats, tiers, prom = settled(client, check)
    total = stats["total"]
    for s in stats["workers"].values():  # MinIO: RAM first, then SSD, never beyond capacity
        assert s["ram"]["bytes"] <= s["ram"]["capacity"] == 4 * MiB
        assert s["ssd"]["bytes"] <= s["ssd"]["capacity"] == 4 * MiB
    # how many blocks each worker loaded may vary a little (work stealing): bounds, not figures
    assert total["ram"]["bytes"] > 7 * MiB and total["ssd"]["bytes"] > 2 * MiB
    assert total["streamed_blocks"] > 0 and total["stream"]["hits"] > 0
    assert total["shared_store"]["requests"] > blocks  # streamed blocks are read once per epoch
    cached = total["ram"]["blocks"] + total["ssd"]["blocks"]
    assert tiers["cluster"]["cached_blocks"] == cached
    assert tiers["cluster"]["cached_share"] == pytest.approx(cached / blocks)
    assert tiers["cluster"]["dataset_bytes"] == (3000 + 15000) * ROW_BYTES
    assert len(tiers["datasets"]) == 2
    assert prom[("dmdask_cached_share", frozenset())] == pytest.approx(cached / blocks)
    history = json.loads(http(base_url(client) + "/dmdask/tiers.json?history=1"))["history"]
    assert history and history[-1]["shared_store_bytes"] > history[0]["shared_store_bytes"]
    # the once-a-second point (`figures.dataset_sizes`, not the page's per-dataset summaries) sums the same
    assert history[-1]["dataset_bytes"] == tiers["cluster"]["dataset_bytes"]


@pytest.mark.slow
def test_status_command_prints_the_stats(cluster, small, large, capsys):
    from dmdask import cli

    cluster_, client = cluster
    assert cli.main(["status", cluster_.scheduler_address]) == 0
    out = capsys.readouterr().out
    stats = dmdask.stats(client)  # the counters are still: nothing loads now
    table, _, rest = out.partition("\n\n")
    lines = table.splitlines()
    header = lines[0].split()
    assert header[0] == "worker"
    rows = {line.split()[0]: line.split() for line in lines[1:]}
    assert set(rows) == set(stats["workers"]) | {"total"}
    for name, s in list(stats["workers"].items()) + [("total", stats["total"])]:
        row = rows[name]
        assert row[1] == f"{s['ram']['bytes'] / MiB:.1f}" and row[2] == f"{s['ram']['capacity'] / MiB:.1f}"
        assert row[3] == f"{s['ssd']['bytes'] / MiB:.1f}" and row[4] == f"{s['ssd']['capacity'] / MiB:.1f}"
        assert [int(x) for x in row[5:11]] == [s["ram"]["blocks"], s["ssd"]["blocks"], s["streamed_blocks"],
                                              s["ram"]["hits"], s["ssd"]["hits"], s["stream"]["hits"]]
        assert row[12] == f"{s['shared_store']['bytes'] / MiB:.1f}" and int(row[13]) == s["shared_store"]["requests"]
    datasets = {line.split()[0]: line.split() for line in rest.splitlines()[1:] if line.startswith("ds-")}
    assert set(datasets) == {d["name"] for d in stats["datasets"]} and len(datasets) == 2
    for d in stats["datasets"]:
        assert datasets[d["name"]][1:5] == [f"{d['samples']:,}", f"{d['blocks']:,}", f"{d['loaded']:,}", "0"]
    assert "/dmdask" in out
    assert cli.main(["status", "tcp://127.0.0.1:1", "--timeout", "1"]) == 1
    assert "cannot reach" in capsys.readouterr().err


# -- the page in a browser -----------------------------------------------------------------
def chromium() -> str:
    for name in (os.environ.get("DMDASK_CHROMIUM"), "chromium", "chromium-browser", "google-chrome",
                 "google-chrome-stable"):
        if name and shutil.which(name):
            return shutil.which(name)
    return ""


DEEP_TEXT = """(() => {
  const texts = []; const tables = []; let canvases = 0;
  const walk = (node) => {
    if (node.shadowRoot) walk(node.shadowRoot);
    for (const child of node.childNodes) {
      if (child.nodeType === 3) texts.push(child.textContent);
      else if (child.nodeType === 1 && !["SCRIPT", "STYLE"].includes(child.tagName)) {
        if (child.tagName === "CANVAS") canvases += 1;
        if (child.tagName === "TABLE") {
          const box = child.parentElement;
          tables.push({right: child.getBoundingClientRect().right, width: child.scrollWidth,
                       room: box ? box.clientWidth : 0});
        }
        walk(child);
      }
    }
  };
  walk(document.documentElement);
  const bokeh = typeof Bokeh !== "undefined" && Bokeh.documents.length > 0;
  return {bokeh, canvases, tables, text: texts.join(" ").replace(/\\s+/g, " ")};
})()"""

DRAWN = """(() => {
  const drawn = [innerWidth, innerHeight, document.documentElement.scrollHeight];
  const walk = (node) => {
    if (node.shadowRoot) walk(node.shadowRoot);
    for (const child of node.children || []) {
      if (child.tagName === "CANVAS") drawn.push(child.width, child.height, child.toDataURL().length);
      walk(child);
    }
  };
  walk(document.documentElement);
  return JSON.stringify(drawn);
})()"""  # the viewport, the page's height and what each canvas shows: unchanged once it is drawn
FRAMES = "new Promise(done => requestAnimationFrame(() => requestAnimationFrame(() => done(true))))"


class Browser:
    """Headless Chromium driven over the DevTools protocol (tornado's websocket client)."""

    FLAGS = ["--headless", "--no-sandbox", "--disable-gpu", "--disable-quic", "--no-first-run",
             "--disable-background-networking", "--disable-component-update", "--disable-sync",
             "--hide-scrollbars", "--remote-debugging-port=0", "--remote-allow-origins=*"]

    def __init__(self, binary: str, width: int = 1400, height: int = 1000):
        self.width, self.height = width, height
        self.profile = tempfile.mkdtemp(prefix="dmdask-chromium-")
        self.log = open(os.path.join(self.profile, "chromium.log"), "wb")
        self.proc = subprocess.Popen([binary, *self.FLAGS, f"--user-data-dir={self.profile}",
                                      f"--window-size={width},{height}", "about:blank"],
                                     stdout=self.log, stderr=subprocess.STDOUT,
                                     start_new_session=True)  # its helpers end with it (close)
        self.ws = None
        self._id = 0

    async def connect(self, timeout: float = 30) -> None:
        from tornado.websocket import websocket_connect

        port_file = os.path.join(self.profile, "DevToolsActivePort")
        deadline = time.monotonic() + timeout
        while not (os.path.exists(port_file) and open(port_file).read().strip()):
            if self.proc.poll() is not None or time.monotonic() > deadline:
                raise RuntimeError(f"chromium did not start: {self.logtail()}")
            await asyncio.sleep(0.1)
        port = int(open(port_file).read().split()[0])
        while True:
            try:
                targets = json.loads(http(f"http://127.0.0.1:{port}/json/list"))
                page = next(t for t in targets if t["type"] == "page")
                break
            except (OSError, StopIteration):
                if time.monotonic() > deadline:
                    raise
                await asyncio.sleep(0.1)
        self.ws = await websocket_connect(page["webSocketDebuggerUrl"], max_message_size=256 * MiB)
        await self.send("Emulation.setDeviceMetricsOverride", width=self.width, height=self.height,
                        deviceScaleFactor=1, mobile=False)

    async def send(self, method: str, **params):
        self._id += 1
        ident = self._id
        await self.ws.write_message(json.dumps({"id": ident, "method": method, "params": params}))
        while True:
            message = await self.ws.read_message()
            if message is None:
                raise RuntimeError(f"DevTools connection closed: {self.logtail()}")
            reply = json.loads(message)
            if reply.get("id") == ident:
                if "error" in reply:
                    raise RuntimeError(f"{method}: {reply['error']}")
                return reply["result"]

    async def evaluate(self, expression: str):
        result = await self.send("Runtime.evaluate", expression=expression, returnByValue=True)
        return result["result"].get("value")

    async def drawn(self, timeout: float = 30, readings: int = 4):
        """Wait until the page is laid out and drawn: `DRAWN` the same in `readings`
        readings in a row, each two frames after the last."""
        deadline, seen = time.monotonic() + timeout, []
        while len(seen) < readings or len(set(seen[-readings:])) > 1:
            if time.monotonic() > deadline:
                raise AssertionError(f"the page did not settle in {timeout} s: {seen[-2:]}")
            await self.send("Runtime.evaluate", expression=FRAMES, awaitPromise=True)
            seen.append(await self.evaluate(DRAWN))

    async def screenshot(self) -> bytes:
        """The whole page (the viewport grown to its height)."""
        layout = await self.send("Page.getLayoutMetrics")
        height = max(int(layout.get("cssContentSize", layout.get("contentSize"))["height"]) + 1, 400)
        await self.send("Emulation.setDeviceMetricsOverride", width=self.width, height=height,
                        deviceScaleFactor=1, mobile=False)
        deadline = time.monotonic() + 30
        while await self.evaluate("innerHeight") != height:  # the new viewport applied
            assert time.monotonic() < deadline, "the viewport did not grow"
            await self.send("Runtime.evaluate", expression=FRAMES, awaitPromise=True)
        await self.drawn()  # and the layout followed it
        shot = await self.send("Page.captureScreenshot", format="png")
        return base64.b64decode(shot["data"])

    def logtail(self) -> str:
        self.log.flush()
        with open(self.log.name, "rb") as f:
            return f.read()[-2000:].decode(errors="replace")

    def close(self) -> None:
        if self.ws is not None:
            self.ws.close()
        for sig, wait in ((signal.SIGTERM, 10), (signal.SIGKILL, 10)):
            try:
                os.killpg(self.proc.pid, sig)  # the process group of the browser started here
            except ProcessLookupError:
                break
            try:
                self.proc.wait(wait)
                break
            except subprocess.TimeoutExpired:
                continue
        self.log.close()
        shutil.rmtree(self.profile, ignore_errors=True)


async def render(binary: str, url: str, wanted, timeout: float = 60):
    """Open `url`, wait until `wanted(page)` holds for the page's text and canvases,
    and return (page, png)."""
    browser = Browser(binary)
    try:
        await browser.connect()
        await browser.send("Page.navigate", url=url)
        deadline = time.monotonic() + timeout
        page = None
        while True:
            page = await browser.evaluate(DEEP_TEXT)
            if page and wanted(page):
                break
            if time.monotonic() > deadline:
                raise AssertionError(f"the page never showed what was expected; it shows: {page}")
            await asyncio.sleep(0.25)
        await browser.drawn()  # the canvases drawn
        page = await browser.evaluate(DEEP_TEXT)
        return page, await browser.screenshot()
    finally:
        browser.close()


def color_share(image, rgb, tolerance=12) -> float:
    pixels = np.asarray(image.convert("RGB")).reshape(-1, 3).astype(int)
    return float(np.mean(np.all(np.abs(pixels - np.array(rgb)) <= tolerance, axis=1)))


@pytest.mark.slow
@pytest.mark.skipif(not chromium(), reason="no Chromium on PATH: run scripts/install-browser.sh "
                                           "(or set DMDASK_CHROMIUM=/path/to/chrome)")
def test_page_in_headless_chromium(cluster, small, large, tmp_path):
    binary = chromium()
    from PIL import Image  # the test extra (and a bokeh dependency)

    _, client = cluster
    stats, tiers, _ = settled(client, lambda stats, tiers, prom: tiers["workers"] == stats["workers"])
    addresses = [a.split("://", 1)[-1] for a in stats["workers"]]

    def wanted(page):
        text = page["text"]
        return (page["bokeh"] and page["canvases"] >= 5 and "dmdask tiers" in text
                and all(a in text for a in addresses) and "Datasets" in text)

    records = []
    handler = logging.Handler(logging.ERROR)
    handler.emit = records.append
    tornado_log = logging.getLogger("tornado.application")
    tornado_log.addHandler(handler)
    try:
        page, png = asyncio.run(render(binary, base_url(client) + "/dmdask", wanted))
        time.sleep(2)  # an observation window, not a wait: the page's next updates go to a closed socket
    finally:
        tornado_log.removeHandler(handler)
    assert not [r.getMessage() for r in records if "/dmdask/ws" in r.getMessage()]  # a closed page logs nothing
    (tmp_path / "dashboard.png").write_bytes(png)
    shot = os.path.join(tempfile.gettempdir(), "dmdask-dashboard.png")
    with open(shot, "wb") as f:
        f.write(png)
    if os.environ.get("DMDASK_UPDATE_SCREENSHOT", "") not in ("", "0"):
        with open(os.path.join(ROOT, "docs", "dashboard.png"), "wb") as f:
            f.write(png)

    text = page["text"]
    # the numbers the page prints are those of the JSON view
    cluster_ = tiers["cluster"]
    assert f"{cluster_['cached_blocks']:,} of {cluster_['dataset_blocks']:,} blocks" in text
    assert f"{cluster_['shared_store_requests']:,} requests" in text
    for address, s in list(stats["workers"].items()) + [("total", stats["total"])]:
        # its row of the workers table: blocks held, then samples served, per tier
        row = " ".join(f"{n:,}" for n in (s["ram"]["blocks"], s["ssd"]["blocks"], s["streamed_blocks"],
                                          s["ram"]["hits"], s["ssd"]["hits"], s["stream"]["hits"]))
        assert f"{address.split('://')[-1]} " in text and f" {row} " in text
    assert "Dmdask" in text  # the link in the navigation bar
    assert small.source in text and large.source in text  # each dataset's source URL
    # the peer-transfer card says what the per-worker bars show (bytes sent, and received)
    assert f"peer transfer {fmt_bytes(stats['total']['peer']['bytes_out'])} rows sent by workers" in text
    # every table fits the 1400 px window, none wider than the room it has
    assert len(page["tables"]) >= 2
    for table in page["tables"]:
        assert table["right"] <= 1400 and table["width"] <= table["room"], page["tables"]

    image = Image.open(io.BytesIO(png))
    assert image.width == 1400 and image.height > 900
    colors = image.convert("RGB").getcolors(maxcolors=1 << 20)
    assert colors is not None and len(colors) > 50, "the screenshot is blank"
    # non-zero occupancy drawn: the RAM and SSD bars (both tiers are full here)
    assert color_share(image, RAM_RGB) > 0.005 and color_share(image, SSD_RGB) > 0.005


def test_the_heartbeat_metric_is_typed_and_checked_where_it_is_read(cluster, small):
    """Each worker's `dmdask` metric has the shape `dmdask.protocol.metric` declares; one of
    another shape (a counter of another type, a tier missing, a field unknown, a negative
    count) is read as no metric: the page lists its worker as one without dmdask tiers."""
    import copy
    import types as pytypes

    from dmdask.dashboard.figures import worker_metrics
    from dmdask.protocol.metric import read_metric

    _, client = cluster
    real = client.run(lambda dask_worker: dask_worker.metrics["dmdask"](dask_worker))
    assert real and all(read_metric(m) is m for m in real.values())
    good = next(iter(real.values()))

    def changed(edit):
        bad = copy.deepcopy(good)
        edit(bad)
        return bad

    bads = [changed(lambda m: m["ram"].update(hits="12")), changed(lambda m: m.pop("ssd")),
            changed(lambda m: m.update(surprise=1)), changed(lambda m: m["shared_store"].update(bytes=-1)),
            changed(lambda m: m["ssd"].update(full=1)), "not a dict"]
    assert [read_metric(b) for b in bads] == [None] * len(bads)
    workers = {f"tcp://w{i}:1": pytypes.SimpleNamespace(address=f"tcp://w{i}:1", name=f"w{i}", metrics={"dmdask": m})
               for i, m in enumerate([good] + bads)}
    found, _, others = worker_metrics(pytypes.SimpleNamespace(workers=workers))
    assert list(found) == ["tcp://w0:1"] and len(others) == len(bads)


@pytest.mark.slow
@pytest.mark.skipif(not chromium(), reason="no Chromium on PATH: run scripts/install-browser.sh "
                                           "(or set DMDASK_CHROMIUM=/path/to/chrome)")
def test_files_read_through_dmdask_show_as_one_row_per_folder(tmp_path, capsys):
    """60 files of two folders read through `dmdask::` (each file a dataset of the registry)
    and a Zarr dataset: the page's datasets table, tiers.json and `dmdask status` each show
    three rows, the folders with their files counted (the page listed one row per file: 35,946
    px tall after one epoch of a real folder)."""
    import fsspec

    from dmdask import cli

    root = write_folder(str(tmp_path / "images"), classes=2, per_class=30)
    paths = sorted(os.path.join(d, f) for d, _, names in os.walk(root) for f in names)
    zarr_path = write_zarr(str(tmp_path / "d.zarr"), 300, chunk=100)
    with dmdask.LocalCluster(n_workers=1, ram="16 MiB") as cluster, distributed.Client(cluster) as client:
        fs = fsspec.filesystem("dmdask", target_protocol="file", scheduler=cluster.scheduler_address)
        for path in paths:
            with open(path, "rb") as f:
                assert fs.cat_file(path) == f.read()
        assert sum(len(b["index"]) for b in dmdask.batches(client, dmdask.Spec(zarr_path, batch_size=100))) == 300
        registry = dmdask.stats(client)["datasets"]
        assert sum(d["name"].startswith("fs-") for d in registry) == 60  # a dataset per file
        folders = [f"file://{root}/class-00", f"file://{root}/class-01"]  # as the files were registered
        datasets = tiers_json(client)["datasets"]
        assert sorted(datasets) == sorted([f"dmdask::{f}/" for f in folders] +
                                          [d["name"] for d in registry if not d["name"].startswith("fs-")])
        for folder in folders:
            assert datasets[f"dmdask::{folder}/"]["files"] == 30
            assert datasets[f"dmdask::{folder}/"]["blocks"] == sum(
                d["blocks"] for d in registry if d["name"].startswith("fs-") and d["url"].startswith(folder + "/"))
        assert cli.main(["status", cluster.scheduler_address]) == 0
        status = capsys.readouterr().out
        page, _ = asyncio.run(render(chromium(), base_url(client) + "/dmdask",
                                     lambda page: "Datasets" in page["text"] and "30 files" in page["text"]))
    text = page["text"]
    assert "fs-" not in text and "fs-" not in status
    for folder in folders:
        assert f"30 files {folder}/ (dmdask::)" in text
        assert re.search(rf"^30 files  30  \d+  \d+  0  {re.escape(folder)}/ \(dmdask::\)$", status, re.M), status
    assert text.count(" files ") == 2 and zarr_path in text


def test_page_renders_without_workers_or_datasets():
    """The page's update on an empty cluster and with a worker without dmdask tiers."""
    from dmdask.dashboard import figures, page

    class FakeMonitor:
        history = deque(maxlen=10)

        def __init__(self, snap):
            self.snap = snap

        def snapshot(self):
            return self.snap

    empty = figures.snapshot_of_nothing()
    empty["other_workers"] = ["tcp://10.0.0.1:1234"]
    tiers = page.TiersPage(FakeMonitor(empty))
    tiers.update()
    assert "no dataset registered yet" in tiers.summary.text and "1 without dmdask tiers" in tiers.summary.text
    assert "10.0.0.1:1234" in tiers.table.text
    busy = figures.snapshot_of_nothing()
    s = figures.empty_stats()
    s["ram"].update(capacity=4 * MiB, bytes=MiB, blocks=3, hits=10)
    s["stream"]["hits"] = 30
    busy["workers"] = {"tcp://10.0.0.2:1": s}
    busy["total"] = s
    busy["cluster"] = figures.cluster_summary(s, {"dmdask-x": {"blocks": 6, "bytes": 2 * MiB, "samples": 60}})
    tiers.monitor = FakeMonitor(busy)
    tiers.update()
    assert tiers.occupancy["ram"].data["label"] == ["1.00 MiB / 4.00 MiB (25%) · 3 blocks"]
    assert tiers.hits.data["stream"] == [0.75]
    assert "50%" in tiers.summary.text  # 3 of 6 blocks cached


# -- a scheduler started with the stock CLI -------------------------------------------------
@pytest.mark.slow
def test_preload_on_the_dask_scheduler_cli(tmp_path):
    """`dask scheduler --preload dmdask.dashboard`, with a dashboard prefix."""
    scheduler_file = str(tmp_path / "scheduler.json")
    procs = [subprocess.Popen([os.path.join(BIN, "dask"), "scheduler", "--host", "127.0.0.1", "--port", "0",
                               "--dashboard-address", "127.0.0.1:0", "--dashboard-prefix", "/dask",
                               "--scheduler-file", scheduler_file, "--preload", "dmdask.dashboard"],
                              stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)]
    try:
        wait_until(lambda: os.path.exists(scheduler_file), 60, "the scheduler wrote its file")
        procs.append(subprocess.Popen(
            [os.path.join(BIN, "dask"), "worker", "--scheduler-file", scheduler_file, "--worker-class",
             "dmdask.Worker", "--nthreads", "1", "--host", "127.0.0.1", "--no-dashboard"],
            stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL,
            env=dict(os.environ, DASK_DMDASK__WORKER__RAM="8 MiB")))
        with distributed.Client(scheduler_file=scheduler_file, timeout=30) as client:
            client.wait_for_workers(1, timeout=60)
            path = write_zarr(str(tmp_path / "d.zarr"), 500, sample_shape=(4,), chunk=50)
            spec = dmdask.Spec(path, batch_size=50)
            assert len(all_ids(run_epoch(client, spec))) == 500
            base = base_url(client) + "/dask"  # the link Dask reports leaves the prefix out
            deadline = time.monotonic() + SETTLE
            while True:
                tiers = json.loads(http(base + "/dmdask/tiers.json"))
                if tiers["total"]["ram"]["blocks"] == 10 or time.monotonic() > deadline:
                    break
                time.sleep(0.25)
            assert tiers["total"]["ram"]["bytes"] == open_source(spec).info.nbytes == 500 * 24
            assert tiers["cluster"]["cached_share"] == 1.0
            page = http(base + "/dmdask")
            assert "Bokeh" in page and 'href="dmdask"' in page  # the Bokeh app, and the link
            assert 'href="dmdask"' in http(base + "/status")
            assert "dmdask_tier_bytes{" in http(base + "/metrics")
    finally:
        for p in procs[::-1]:
            p.terminate()
        for p in procs:
            p.wait(30)


# -- wiring ---------------------------------------------------------------------------------
def test_local_cluster_preload_keeps_configured_preloads():
    from dmdask.cluster import with_dashboard_preload

    assert with_dashboard_preload(None) == {"preload": ["dmdask.dashboard"]}
    assert with_dashboard_preload({"preload": "mine"}) == {"preload": ["mine", "dmdask.dashboard"]}
    assert with_dashboard_preload({"preload": ["mine"], "preload_argv": [["--x", "1"]]}) == {
        "preload": ["mine", "dmdask.dashboard"], "preload_argv": [["--x", "1"], []]}
    with dask_config({"distributed.scheduler.preload": ["configured"]}):
        assert with_dashboard_preload({})["preload"] == ["configured", "dmdask.dashboard"]
    already = {"preload": ["dmdask.dashboard"]}
    assert with_dashboard_preload(already) == already


def dask_config(values):
    import dask

    return dask.config.set(values)


def test_collector_registered_once(monkeypatch):
    import prometheus_client

    from dmdask.dashboard import prometheus

    first = prometheus.collector()
    again = []
    monkeypatch.setattr(prometheus_client.REGISTRY, "register", again.append)  # from now on
    assert prometheus.collector() is first
    importlib.reload(prometheus)  # a reloaded module finds the registered collector
    assert prometheus.collector() is first
    assert again == []  # nothing registered a second time


def test_a_closed_page_websocket_logs_no_traceback():
    """tornado's "Uncaught exception GET /dmdask/ws" for a browser gone mid-write is dropped
    by the filter the preload installs on tornado's application log; other errors pass."""
    from tornado.websocket import WebSocketClosedError

    from dmdask.dashboard import ClosedPageFilter

    def record(path, exc):
        try:
            raise exc
        except Exception:
            return logging.LogRecord("tornado.application", logging.ERROR, __file__, 1, "Uncaught exception %s\n%r",
                                     (f"GET {path} (127.0.0.1)", "request"), sys.exc_info())

    keep = ClosedPageFilter().filter
    assert not keep(record("/dmdask/ws?bokeh-session-id=x", WebSocketClosedError()))
    assert keep(record("/dmdask/ws?bokeh-session-id=x", ValueError("a real bug")))
    assert keep(record("/status/ws", WebSocketClosedError()))
