"""The `/dmdask` Bokeh page: per-worker tiers, hit rates, peer and shared-store traffic.

`tiers_doc` is what the preload puts into Dask's dashboard applications. The page
redraws once a second from `figures.Monitor.snapshot()`; nothing here talks to a worker.
"""
from __future__ import annotations

import math
from bokeh.layouts import column, row
from bokeh.models import (BasicTicker, ColumnDataSource, CustomJSTickFormatter, DataRange1d, Div,
                          FactorRange, HoverTool, Legend, LinearAxis, NumeralTickFormatter, Range1d)
from bokeh.plotting import figure
from bokeh.transform import dodge
from distributed.dashboard.components import add_periodic_callback
from distributed.dashboard.components.scheduler import BOKEH_THEME, env
from distributed.utils import log_errors

from ..stats import hit_shares
from .figures import Monitor, monitor
from .markup import RAM, SSD, STREAM, datasets_html, fmt_bytes, fmt_pct, short, summary_html, workers_html

CAPACITY = "#e4e7eb"
PEER_IN, PEER_OUT = "#4cae6e", "#8e6cc1"
TEXT = "#333"
UPDATE_MS = 1000
TICKS_1024 = {"base": 1024, "mantissas": [1, 2, 4, 8, 16, 32, 64, 128, 256, 512]}

BYTES_JS = """
const units = ["B", "KiB", "MiB", "GiB", "TiB", "PiB"];
let v = Math.abs(tick), i = 0;
while (v >= 1024 && i < units.length - 1) { v /= 1024; i += 1; }
const s = v >= 100 || i == 0 ? v.toFixed(0) : v.toFixed(1);
return (tick < 0 ? "-" : "") + s.replace(/\\.0$/, "") + " " + units[i];
"""


def _bytes_axis(axis) -> None:
    axis.formatter = CustomJSTickFormatter(code=BYTES_JS)
    axis.ticker = BasicTicker(**TICKS_1024, desired_num_ticks=5)


def _legend_above(fig, items, glyph_width: int = 12, glyph_height: int = 12) -> None:
    """A horizontal legend between the title and the plot (never over the bars)."""
    legend = Legend(items=items, orientation="horizontal", location="top_left", label_text_font_size="11px",
                    glyph_width=glyph_width, glyph_height=glyph_height, padding=0, margin=0, spacing=14,
                    border_line_alpha=0, background_fill_alpha=0)
    fig.add_layout(legend, "above")


def _figure(title: str, **kwargs):
    fig = figure(title=title, tools="", toolbar_location=None, sizing_mode="stretch_width",
                 min_border_left=10, min_border_right=20, **kwargs)
    fig.title.text_font_size = "13px"
    fig.title.text_color = TEXT
    fig.outline_line_color = None
    return fig


def _bar_figure(title: str, x_end: float = 1):
    """Horizontal bars, one row per worker."""
    fig = _figure(title, y_range=FactorRange(), x_range=Range1d(0, x_end), height=160)
    fig.ygrid.visible = False
    fig.xgrid.grid_line_alpha = 0.4
    return fig


def _div() -> Div:
    # Bokeh sizes a Div's content to fit it (an inline block): let it take the whole width
    return Div(text="", sizing_mode="stretch_width",
               stylesheets=[".bk-clearfix { display: block !important; width: 100%; }"])


class TiersPage:
    """All components of the page; `update()` redraws them from the latest snapshot."""

    def __init__(self, mon: Monitor):
        self.monitor = mon
        self.workers: list[str] = []
        self._last_time = 0.0
        self._labels: list = []  # text renderers next to the bars, hidden when rows get thin
        self.summary, self.table, self.datasets = _div(), _div(), _div()
        self.occupancy = {tier: ColumnDataSource({k: [] for k in (
            "worker", "bytes", "capacity", "label", "blocks", "bytes_text", "capacity_text", "dir", "source")})
            for tier in ("ram", "ssd")}
        self.ram_fig = self._occupancy_figure("ram", "RAM tier: bytes held / capacity, per worker", RAM)
        self.ssd_fig = self._occupancy_figure("ssd", "SSD tier: bytes held / capacity, per worker", SSD)
        self.hits = ColumnDataSource({k: [] for k in (
            "worker", "ram", "ssd", "stream", "ram_n", "ssd_n", "stream_n", "label")})
        self.hits_fig = self._hits_figure()
        self.peer = ColumnDataSource({"worker": [], "bytes_in": [], "bytes_out": [], "in_text": [], "out_text": []})
        self.peer_fig = self._peer_figure()
        self.history = ColumnDataSource({"time": [], "bytes": [], "requests": [], "dataset": []})
        self.store_fig = self._store_figure()
        self.root = column(
            self.summary,
            row(self.ram_fig, self.ssd_fig, sizing_mode="stretch_width"),
            row(self.hits_fig, self.peer_fig, sizing_mode="stretch_width"),
            self.store_fig,
            self.table,
            self.datasets,
            sizing_mode="stretch_width",
        )

    # -- figures ------------------------------------------------------------------------
    def _label(self, fig, x, y, text: str, source, x_offset: int = 6, size: str = "11px") -> None:
        """Text right of the bars (hidden with the other labels when rows get thin)."""
        self._labels.append(fig.text(x=x, y=y, text=text, source=source, x_offset=x_offset, text_align="left",
                                     text_baseline="middle", text_font_size=size, text_color=TEXT))

    def _occupancy_figure(self, tier: str, title: str, color: str):
        source = self.occupancy[tier]
        fig = _bar_figure(title)
        fig.hbar(y="worker", left=0, right="capacity", height=0.72, color=CAPACITY, source=source)
        bars = fig.hbar(y="worker", left=0, right="bytes", height=0.72, color=color, source=source)
        self._label(fig, "capacity", "worker", "label", source)
        _bytes_axis(fig.xaxis[0])
        fig.yaxis.major_label_text_font_size = "11px"
        fig.add_tools(HoverTool(renderers=[bars], point_policy="follow_mouse", tooltips=[
            ("worker", "@worker"), ("held", "@bytes_text"), ("capacity", "@capacity_text"), ("blocks", "@blocks"),
            ("folder", "@dir"), ("size from", "@source")]))
        return fig

    def _hits_figure(self):
        fig = _bar_figure("Samples served per worker, by tier (share)", x_end=1.45)
        renderers = fig.hbar_stack(["ram", "ssd", "stream"], y="worker", height=0.72, source=self.hits,
                                   color=[RAM, SSD, STREAM])
        _legend_above(fig, [("RAM", [renderers[0]]), ("SSD", [renderers[1]]),
                            ("streamed from the shared store", [renderers[2]])])
        self._label(fig, 1.0, "worker", "label", self.hits)
        fig.xaxis[0].formatter = NumeralTickFormatter(format="0%")
        fig.xaxis[0].ticker = BasicTicker(desired_num_ticks=5)
        fig.add_tools(HoverTool(renderers=renderers, point_policy="follow_mouse", tooltips=[
            ("worker", "@worker"), ("RAM", "@ram_n samples"), ("SSD", "@ssd_n samples"),
            ("streamed", "@stream_n samples")]))
        return fig

    def _peer_figure(self):
        fig = _bar_figure("Peer transfer per worker: rows sent to and received from other workers")
        bars = {}
        for x, offset, color, text in (("bytes_out", 0.18, PEER_OUT, "out_text"),
                                       ("bytes_in", -0.18, PEER_IN, "in_text")):
            y = dodge("worker", offset, range=fig.y_range)
            bars[x] = fig.hbar(y=y, left=0, right=x, height=0.34, color=color, source=self.peer)
            self._label(fig, x, y, text, self.peer, x_offset=5, size="10px")
        _legend_above(fig, [("sent to peers", [bars["bytes_out"]]), ("received from peers", [bars["bytes_in"]])])
        _bytes_axis(fig.xaxis[0])
        fig.add_tools(HoverTool(renderers=list(bars.values()), point_policy="follow_mouse", tooltips=[
            ("worker", "@worker"), ("sent", "@out_text"), ("received", "@in_text")]))
        return fig

    def _store_figure(self):
        fig = _figure("Shared store: bytes and requests read so far (all workers)", x_axis_type="datetime",
                      height=230)
        bytes_line = fig.line("time", "bytes", source=self.history, color=STREAM, line_width=3)
        dataset_line = fig.line("time", "dataset", source=self.history, color="#888", line_width=1.5,
                                line_dash="dashed")
        fig.y_range = DataRange1d(start=0, renderers=[bytes_line, dataset_line], range_padding=0.08)
        fig.extra_y_ranges = {"requests": DataRange1d(start=0, range_padding=0.08)}
        requests_line = fig.line("time", "requests", source=self.history, color="#222", line_width=1.5,
                                 line_dash="dotted", y_range_name="requests")
        fig.extra_y_ranges["requests"].renderers = [requests_line]
        fig.add_layout(LinearAxis(y_range_name="requests", axis_label="requests"), "right")
        _bytes_axis(fig.yaxis[0])
        fig.yaxis[0].axis_label = "bytes"
        fig.xgrid.grid_line_alpha = 0.4
        fig.ygrid.grid_line_alpha = 0.4
        _legend_above(fig, [("bytes read", [bytes_line]),
                            ("size of the registered datasets (decoded)", [dataset_line]),
                            ("requests (right axis)", [requests_line])], glyph_width=18, glyph_height=20)
        fig.add_tools(HoverTool(renderers=[bytes_line, requests_line], mode="vline", tooltips=[
            ("time", "@time{%H:%M:%S}"), ("bytes", "@bytes{0.0 b}"), ("requests", "@requests")],
            formatters={"@time": "datetime"}))
        return fig

    # -- updates ------------------------------------------------------------------------
    @log_errors
    def update(self) -> None:
        snap = self.monitor.snapshot()
        workers = list(snap["workers"])
        labels = [short(a) for a in workers]
        stats = [snap["workers"][a] for a in workers]
        if workers != self.workers:
            self.workers = workers
            n = max(1, len(workers))
            row_px = 30 if n <= 20 else max(3, 600 // n)  # large clusters: thinner rows, no labels
            for fig in (self.ram_fig, self.ssd_fig, self.hits_fig, self.peer_fig):
                fig.y_range.factors = labels[::-1]  # first worker on top
                fig.height = 70 + row_px * n
                fig.yaxis.visible = row_px >= 12
            for renderer in self._labels:
                renderer.visible = row_px >= 24
        for tier, fig in (("ram", self.ram_fig), ("ssd", self.ssd_fig)):
            self._update_occupancy(tier, fig, labels, stats)
        self._update_hits(labels, stats)
        self._update_peer(labels, stats)
        self._update_history()
        for div, text in ((self.summary, summary_html(snap)), (self.table, workers_html(snap)),
                          (self.datasets, datasets_html(snap))):
            if div.text != text:
                div.text = text

    def _update_occupancy(self, tier, fig, labels, stats) -> None:
        caps = [s[tier]["capacity"] for s in stats]
        used = [s[tier]["bytes"] for s in stats]
        blocks = [s[tier]["blocks"] for s in stats]
        text = []
        for u, c, b, s in zip(used, caps, blocks, stats):
            if not c:
                text.append("no tier")
                continue
            full = " · full" if s[tier]["full"] else ""
            full += " · folder unusable" if s[tier].get("error") else ""
            full += " · larger than its shared memory" if s[tier].get("warning") else ""
            text.append(f"{fmt_bytes(u)} / {fmt_bytes(c)} ({fmt_pct(u / c)}) · {b:,} blocks{full}")
        self.occupancy[tier].data = {
            "worker": labels, "bytes": used, "capacity": caps, "label": text, "blocks": blocks,
            "bytes_text": [fmt_bytes(u) for u in used], "capacity_text": [fmt_bytes(c) for c in caps],
            "dir": [str(s[tier].get("dir") or "-") for s in stats],
            "source": [str(s[tier].get("source") or "-") for s in stats],
        }
        fig.x_range.start = 0
        fig.x_range.end = max(caps + used + [1]) * 1.75  # room for the labels right of the bars

    def _update_hits(self, labels, stats) -> None:
        data: dict[str, list] = {k: [] for k in self.hits.data}
        for label, s in zip(labels, stats):
            shares = hit_shares(s) or {"ram": 0.0, "ssd": 0.0, "stream": 0.0}
            data["worker"].append(label)
            for tier in ("ram", "ssd", "stream"):
                data[tier].append(shares[tier])
                data[f"{tier}_n"].append(f"{s[tier]['hits']:,}")
            served = s["ram"]["hits"] + s["ssd"]["hits"] + s["stream"]["hits"]
            data["label"].append(f"{served:,} samples · {fmt_pct(1 - shares['stream'])} cached"
                                 if served else "nothing served yet")
        self.hits.data = data

    def _update_peer(self, labels, stats) -> None:
        b_in = [s["peer"]["bytes_in"] for s in stats]
        b_out = [s["peer"]["bytes_out"] for s in stats]
        self.peer.data = {"worker": labels, "bytes_in": b_in, "bytes_out": b_out,
                          "in_text": [fmt_bytes(b) for b in b_in], "out_text": [fmt_bytes(b) for b in b_out]}
        self.peer_fig.x_range.start = 0
        self.peer_fig.x_range.end = max(b_in + b_out + [1]) * 1.35

    def _update_history(self) -> None:
        points = [p for p in list(self.monitor.history) if p["time"] > self._last_time]
        if not points:
            return
        self._last_time = points[-1]["time"]
        self.history.stream({
            "time": [p["time"] * 1000 for p in points],
            "bytes": [p["shared_store_bytes"] for p in points],
            "requests": [p["shared_store_requests"] for p in points],
            "dataset": [p["dataset_bytes"] if p["dataset_bytes"] is not None else math.nan for p in points],
        }, rollover=self.monitor.history.maxlen)


@log_errors
def tiers_doc(scheduler, extra, doc):
    """The Bokeh document of `/dmdask` (Dask calls it with the scheduler and template variables)."""
    mon = monitor(scheduler)
    mon.start()
    page = TiersPage(mon)
    page.update()
    add_periodic_callback(doc, page, UPDATE_MS)
    doc.title = "Dask: dmdask tiers"
    doc.add_root(page.root)
    doc.template = env.get_template("simple.html")
    doc.template_variables.update(extra)
    doc.theme = BOKEH_THEME
