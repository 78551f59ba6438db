"""The `/dmdask` Bokeh page: per-worker tiers, hit rates, peer and shared-store traffic.

Built by `tiers_doc`, the function that the preload puts into Dask's dashboard
applications. It redraws once a second from `figures.Monitor.snapshot()` (the
scheduler's copy of the workers' heartbeat metrics); nothing here talks to a worker.
"""
from __future__ import annotations

import html
import math
from typing import Dict, List, Optional

from bokeh.layouts import column, row
from bokeh.models import (BasicTicker, ColumnDataSource, CustomJSTickFormatter, DataRange1d, Div,
                          FactorRange, HoverTool, Legend, LinearAxis, NumeralTickFormatter, Range1d)
from bokeh.plotting import figure
from bokeh.transform import dodge
from dask.utils import format_bytes
from distributed.dashboard.components import add_periodic_callback
from distributed.dashboard.components.scheduler import BOKEH_THEME, env
from distributed.utils import log_errors

from .figures import Monitor, hit_shares, monitor

RAM, SSD, STREAM = "#3b7dd8", "#f0a23b", "#d9534f"
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


def fmt_bytes(n: Optional[float]) -> str:
    return "?" if n is None else format_bytes(n)


def fmt_pct(x: Optional[float]) -> str:
    return "–" if x is None else f"{100 * x:.0f}%" if x in (0, 1) or x >= 0.1 else f"{100 * x:.1f}%"


def fmt_int(n: Optional[int]) -> str:
    return "?" if n is None else f"{n:,}"


def short(address: str) -> str:
    return address.split("://", 1)[-1]


def _bytes_axis(axis) -> None:
    axis.formatter = CustomJSTickFormatter(code=BYTES_JS)
    axis.ticker = BasicTicker(**TICKS_1024, desired_num_ticks=5)


def _legend_above(fig, items) -> None:
    """A horizontal legend between the title and the plot (never over the bars)."""
    legend = Legend(items=items, orientation="horizontal", location="top_left", label_text_font_size="11px",
                    glyph_width=12, glyph_height=12, padding=0, margin=0, spacing=14,
                    border_line_alpha=0, background_fill_alpha=0)
    fig.add_layout(legend, "above")


def _figure(title: str, **kwargs):
    fig = figure(title=title, tools="", toolbar_location=None, sizing_mode="stretch_width",
                 min_border_left=10, min_border_right=20, **kwargs)
    fig.title.text_font_size = "13px"
    fig.title.text_color = TEXT
    fig.outline_line_color = None
    return fig


def _div() -> Div:
    # Bokeh sizes a Div's content to fit it (an inline block): let it take the whole width
    return Div(text="", sizing_mode="stretch_width",
               stylesheets=[".bk-clearfix { display: block !important; width: 100%; }"])


class TiersPage:
    """All components of the page; `update()` redraws them from the latest snapshot."""

    def __init__(self, mon: Monitor):
        self.monitor = mon
        self.workers: List[str] = []
        self._last_time = 0.0
        self._labels: list = []  # text renderers next to the bars, hidden when rows get thin
        self.summary, self.table, self.datasets = _div(), _div(), _div()

        self.occupancy = {tier: ColumnDataSource(self._empty_occupancy()) for tier in ("ram", "ssd")}
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
    @staticmethod
    def _empty_occupancy() -> dict:
        return {k: [] for k in ("worker", "bytes", "capacity", "label", "blocks", "bytes_text", "capacity_text",
                                "dir", "source")}

    def _occupancy_figure(self, tier: str, title: str, color: str):
        source = self.occupancy[tier]
        fig = _figure(title, y_range=FactorRange(), x_range=Range1d(0, 1), height=160)
        fig.hbar(y="worker", left=0, right="capacity", height=0.72, color=CAPACITY, source=source)
        bars = fig.hbar(y="worker", left=0, right="bytes", height=0.72, color=color, source=source)
        self._labels.append(fig.text(x="capacity", y="worker", text="label", source=source, x_offset=6,
                                     text_align="left", text_baseline="middle", text_font_size="11px",
                                     text_color=TEXT))
        _bytes_axis(fig.xaxis[0])
        fig.ygrid.visible = False
        fig.xgrid.grid_line_alpha = 0.4
        fig.yaxis.major_label_text_font_size = "11px"
        fig.add_tools(HoverTool(renderers=[bars], point_policy="follow_mouse", tooltips=[
            ("worker", "@worker"), ("held", "@bytes_text"), ("capacity", "@capacity_text"), ("blocks", "@blocks"),
            ("folder", "@dir"), ("size from", "@source")]))
        return fig

    def _hits_figure(self):
        fig = _figure("Samples served per worker, by tier (share)", y_range=FactorRange(),
                      x_range=Range1d(0, 1.45), height=160)
        renderers = fig.hbar_stack(["ram", "ssd", "stream"], y="worker", height=0.72, source=self.hits,
                                   color=[RAM, SSD, STREAM])
        _legend_above(fig, [("RAM", [renderers[0]]), ("SSD", [renderers[1]]),
                            ("streamed from the shared store", [renderers[2]])])
        self._labels.append(fig.text(x=1.0, y="worker", text="label", source=self.hits, x_offset=6,
                                     text_align="left", text_baseline="middle", text_font_size="11px",
                                     text_color=TEXT))
        fig.xaxis[0].formatter = NumeralTickFormatter(format="0%")
        fig.xaxis[0].ticker = BasicTicker(desired_num_ticks=5)
        fig.ygrid.visible = False
        fig.xgrid.grid_line_alpha = 0.4
        fig.add_tools(HoverTool(renderers=renderers, point_policy="follow_mouse", tooltips=[
            ("worker", "@worker"), ("RAM", "@ram_n samples"), ("SSD", "@ssd_n samples"),
            ("streamed", "@stream_n samples")]))
        return fig

    def _peer_figure(self):
        fig = _figure("Peer transfer per worker: rows sent to and received from other workers",
                      y_range=FactorRange(), x_range=Range1d(0, 1), height=160)
        out_bars = fig.hbar(y=dodge("worker", 0.18, range=fig.y_range), left=0, right="bytes_out", height=0.34,
                            color=PEER_OUT, source=self.peer)
        in_bars = fig.hbar(y=dodge("worker", -0.18, range=fig.y_range), left=0, right="bytes_in", height=0.34,
                           color=PEER_IN, source=self.peer)
        for x, offset, text in (("bytes_out", 0.18, "out_text"), ("bytes_in", -0.18, "in_text")):
            self._labels.append(fig.text(x=x, y=dodge("worker", offset, range=fig.y_range), text=text,
                                         source=self.peer, x_offset=5, text_align="left", text_baseline="middle",
                                         text_font_size="10px", text_color=TEXT))
        _legend_above(fig, [("sent to peers", [out_bars]), ("received from peers", [in_bars])])
        _bytes_axis(fig.xaxis[0])
        fig.ygrid.visible = False
        fig.xgrid.grid_line_alpha = 0.4
        fig.add_tools(HoverTool(renderers=[out_bars, in_bars], point_policy="follow_mouse", tooltips=[
            ("worker", "@worker"), ("sent", "@out_text"), ("received", "@in_text")]))
        return fig

    def _store_figure(self):
        fig = _figure("Shared store: bytes and requests read so far (all workers)", x_axis_type="datetime",
                      height=230)
        bytes_line = fig.line("time", "bytes", source=self.history, color=STREAM, line_width=3,
                              legend_label="bytes read")
        dataset_line = fig.line("time", "dataset", source=self.history, color="#888", line_width=1.5,
                                line_dash="dashed", legend_label="size of the registered datasets (decoded)")
        fig.y_range = DataRange1d(start=0, renderers=[bytes_line, dataset_line], range_padding=0.08)
        fig.extra_y_ranges = {"requests": DataRange1d(start=0, range_padding=0.08)}
        requests_line = fig.line("time", "requests", source=self.history, color="#222", line_width=1.5,
                                 line_dash="dotted", y_range_name="requests", legend_label="requests (right axis)")
        fig.extra_y_ranges["requests"].renderers = [requests_line]
        fig.add_layout(LinearAxis(y_range_name="requests", axis_label="requests"), "right")
        _bytes_axis(fig.yaxis[0])
        fig.yaxis[0].axis_label = "bytes"
        fig.xgrid.grid_line_alpha = 0.4
        fig.ygrid.grid_line_alpha = 0.4
        legend = fig.legend[0]
        fig.center.remove(legend)
        legend.update(orientation="horizontal", location="top_left", label_text_font_size="11px", padding=0,
                      margin=0, spacing=14, border_line_alpha=0, background_fill_alpha=0, glyph_width=18)
        fig.add_layout(legend, "above")
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
        self._set(self.summary, summary_html(snap))
        self._set(self.table, workers_html(snap))
        self._set(self.datasets, datasets_html(snap))

    @staticmethod
    def _set(div: Div, text: str) -> None:
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
        end = max(caps + used + [1])
        fig.x_range.end = end * 1.75  # room for the labels right of the bars
        fig.x_range.start = 0

    def _update_hits(self, labels, stats) -> None:
        data: Dict[str, list] = {k: [] for k in self.hits.data}
        for label, s in zip(labels, stats):
            shares = hit_shares(s) or {"ram": 0.0, "ssd": 0.0, "stream": 0.0}
            data["worker"].append(label)
            for tier in ("ram", "ssd", "stream"):
                data[tier].append(shares[tier])
            data["ram_n"].append(f"{s['ram']['hits']:,}")
            data["ssd_n"].append(f"{s['ssd']['hits']:,}")
            data["stream_n"].append(f"{s['stream']['hits']:,}")
            served = s["ram"]["hits"] + s["ssd"]["hits"] + s["stream"]["hits"]
            data["label"].append(f"{served:,} samples · {fmt_pct(1 - shares['stream']) if served else '–'} cached"
                                 if served else "nothing served yet")
        self.hits.data = data

    def _update_peer(self, labels, stats) -> None:
        b_in = [s["peer"]["bytes_in"] for s in stats]
        b_out = [s["peer"]["bytes_out"] for s in stats]
        self.peer.data = {"worker": labels, "bytes_in": b_in, "bytes_out": b_out,
                          "in_text": [fmt_bytes(b) for b in b_in], "out_text": [fmt_bytes(b) for b in b_out]}
        self.peer_fig.x_range.end = max(b_in + b_out + [1]) * 1.35
        self.peer_fig.x_range.start = 0

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


# -- HTML parts (Divs: readable text, and what the browser test reads) -----------------
CARD = ("flex:0 0 auto;min-width:150px;padding:8px 14px;"
        "border:1px solid #dde1e6;border-radius:6px;background:#fff;font-family:Helvetica,Arial,sans-serif")
CARD_TITLE = "font-size:11px;color:#666;text-transform:uppercase;letter-spacing:0.04em"
CARD_VALUE = "font-size:22px;font-weight:bold;color:#222;margin:2px 0"
CARD_NOTE = "font-size:12px;color:#444"
TABLE = "border-collapse:collapse;font-family:Helvetica,Arial,sans-serif;font-size:12px;margin:6px 0 14px 0"
TH = "text-align:right;padding:3px 6px;border-bottom:2px solid #ccc;color:#444;white-space:nowrap;"
TD = "text-align:right;padding:3px 6px;border-bottom:1px solid #eee;white-space:nowrap;"
TH_GROUP = "text-align:center;padding:2px 9px 0 9px;color:#666;font-weight:normal;font-size:11px;white-space:nowrap;"
URL_TD = "white-space:normal;word-break:break-all;max-width:520px;"  # long URLs wrap instead of widening the table
SECTION = "font-family:Helvetica,Arial,sans-serif;font-size:13px;font-weight:bold;color:#333;margin-top:8px"


def _card(title: str, value: str, note: str = "") -> str:
    return (f'<div style="{CARD}"><div style="{CARD_TITLE}">{html.escape(title)}</div>'
            f'<div style="{CARD_VALUE}">{html.escape(value)}</div>'
            f'<div style="{CARD_NOTE}">{note}</div></div>')


def _dot(color: str, first: bool = False) -> str:
    return (f'<span style="display:inline-block;width:9px;height:9px;border-radius:2px;'
            f'background:{color};margin:0 4px 0 {0 if first else 10}px"></span>')


def summary_html(snap: dict) -> str:
    c, total = snap["cluster"], snap["total"]
    parts = ['<div style="font-family:Helvetica,Arial,sans-serif;margin:4px 0 2px 0">'
             '<span style="font-size:18px;font-weight:bold;color:#222">dmdask tiers</span>'
             '<span style="font-size:12px;color:#666;margin-left:10px">RAM and SSD block cache of the '
             'workers, from their heartbeats (updated every second)</span></div>'
             '<div style="display:flex;flex-wrap:wrap;gap:10px;margin:6px 0 8px 0">']
    others = snap["other_workers"]
    note = (f"RAM {fmt_bytes(total['ram']['capacity'])}, SSD {fmt_bytes(total['ssd']['capacity'])} in all")
    if others:
        note += f'<br><span style="color:#b94a48">{len(others)} without dmdask tiers</span>'
    for tier in ("ram", "ssd"):
        for text in filter(None, (total[tier].get("warning"), total[tier].get("error"))):
            note += f'<br><span style="color:#b94a48;white-space:normal">{html.escape(text)}</span>'
    parts.append(_card("workers", str(c["workers"]), note))
    if c["cached_share"] is None:
        parts.append(_card("dataset cached", "–", "no dataset registered yet"))
    else:
        size = fmt_bytes(c["dataset_bytes"]) if c["dataset_bytes"] is not None else "?"
        parts.append(_card(
            "dataset cached", fmt_pct(c["cached_share"]),
            f"{c['cached_blocks']:,} of {c['dataset_blocks']:,} blocks · {fmt_bytes(c['cached_bytes'])} of {size}"
            f"<br>{_dot(RAM, True)}RAM {fmt_bytes(total['ram']['bytes'])}{_dot(SSD)}SSD {fmt_bytes(total['ssd']['bytes'])}"
            f"{_dot(STREAM)}{c['streamed_blocks']:,} blocks streamed"))
    ratio = c["shared_store_reads_per_dataset"]
    parts.append(_card(
        "shared-store reads", fmt_bytes(c["shared_store_bytes"]),
        f"in {c['shared_store_requests']:,} requests"
        + (f"<br>{ratio:.2f}× the registered datasets" if ratio is not None else "")))
    shares = c["hit_shares"]
    if shares is None:
        parts.append(_card("hit rate", "–", "no sample served yet"))
    else:
        served = total["ram"]["hits"] + total["ssd"]["hits"] + total["stream"]["hits"]
        parts.append(_card(
            "hit rate (RAM + SSD)", fmt_pct(shares["ram"] + shares["ssd"]),
            f"of {served:,} samples served<br>{_dot(RAM, True)}RAM {fmt_pct(shares['ram'])}{_dot(SSD)}SSD "
            f"{fmt_pct(shares['ssd'])}{_dot(STREAM)}streamed {fmt_pct(shares['stream'])}"))
    parts.append(_card("peer transfer", fmt_bytes(total["peer"]["bytes_out"]),
                       f"rows sent by workers (to peers and to ranks)<br>"
                       f"{fmt_bytes(total['peer']['bytes_in'])} received from peers"))
    parts.append("</div>")
    return "".join(parts)


def _held(tier: dict) -> str:
    if not tier["capacity"]:
        return "–"
    return f"{fmt_bytes(tier['bytes'])} / {fmt_bytes(tier['capacity'])} ({fmt_pct(tier['bytes'] / tier['capacity'])})"


def workers_html(snap: dict) -> str:
    groups = [("", 2), ("RAM", 1), ("SSD", 1), ("blocks held", 3), ("samples served", 3), ("", 1),
              ("shared store", 2), ("peer transfer", 2)]
    heads = ["worker", "name", "held / capacity", "held / capacity", "RAM", "SSD", "streamed", "RAM", "SSD",
             "streamed", "hit rate", "requests", "bytes", "in", "out"]
    rows = []
    entries = [(short(a), snap["names"].get(a, ""), s) for a, s in snap["workers"].items()]
    if len(entries) > 1:
        entries.append(("total", "", snap["total"]))
    for address, name, s in entries:
        shares = hit_shares(s)
        cells = [address, name, _held(s["ram"]), _held(s["ssd"]),
                 fmt_int(s["ram"]["blocks"]), fmt_int(s["ssd"]["blocks"]), fmt_int(s["streamed_blocks"]),
                 fmt_int(s["ram"]["hits"]), fmt_int(s["ssd"]["hits"]), fmt_int(s["stream"]["hits"]),
                 fmt_pct(None if shares is None else shares["ram"] + shares["ssd"]),
                 fmt_int(s["shared_store"]["requests"]), fmt_bytes(s["shared_store"]["bytes"]),
                 fmt_bytes(s["peer"]["bytes_in"]), fmt_bytes(s["peer"]["bytes_out"])]
        weight = "font-weight:bold;" if address == "total" else ""
        rows.append("<tr>" + "".join(
            f'<td style="{TD}{weight}{"text-align:left;" if i < 2 else ""}">{html.escape(str(v))}</td>'
            for i, v in enumerate(cells)) + "</tr>")
    for address in snap["other_workers"]:
        rows.append(f'<tr><td style="{TD}text-align:left">{html.escape(short(address))}</td>'
                    f'<td colspan="{len(heads) - 1}" style="{TD}text-align:left;color:#b94a48">'
                    "no dmdask tiers (a plain Dask worker, or no heartbeat yet)</td></tr>")
    top = "".join(f'<th colspan="{n}" style="{TH_GROUP}">{g}</th>' for g, n in groups)
    head = "".join(f'<th style="{TH}{"text-align:left;" if i < 2 else ""}">{h}</th>' for i, h in enumerate(heads))
    return (f'<div style="{SECTION}">Workers</div><div style="overflow-x:auto"><table style="{TABLE}">'
            f'<tr>{top}</tr><tr>{head}</tr>{"".join(rows)}</table></div>')


def datasets_html(snap: dict) -> str:
    sets = snap["datasets"]
    heads = ["dataset", "source", "samples", "blocks", "blocks loaded", "decoded size"]
    head = "".join(f'<th style="{TH}{"text-align:left;" if i < 2 else ""}">{h}</th>' for i, h in enumerate(heads))
    rows = []
    for name, d in sets.items():
        cells = [name, d.get("url") or "", fmt_int(d["samples"]), fmt_int(d["blocks"]), fmt_int(d.get("loaded_blocks")),
                 fmt_bytes(d["bytes"])]
        rows.append("<tr>" + "".join(
            f'<td style="{TD}{URL_TD if i == 1 else ""}{"text-align:left;" if i < 2 else ""}">'
            f'{html.escape(str(v))}</td>' for i, v in enumerate(cells)) + "</tr>")
    if not rows:
        rows.append(f'<tr><td colspan="6" style="{TD}text-align:left;color:#666">none yet: '
                    "datasets appear when a training process first iterates over them</td></tr>")
    return (f'<div style="{SECTION}">Datasets</div><div style="max-width:100%;overflow-x:auto">'
            f'<table style="{TABLE}"><tr>{head}</tr>{"".join(rows)}</table></div>')


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
