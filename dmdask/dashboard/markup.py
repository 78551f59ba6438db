"""The HTML parts of the `/dmdask` page (Bokeh Divs: the summary cards and the workers'
and datasets' tables), and the number formats the page shows."""
from __future__ import annotations

import html

from dask.utils import format_bytes

from ..stats import hit_shares

RAM, SSD, STREAM = "#3b7dd8", "#f0a23b", "#d9534f"
FONT = "font-family:Helvetica,Arial,sans-serif"
CARD = (f"flex:0 0 auto;min-width:150px;padding:8px 14px;border:1px solid #dde1e6;border-radius:6px;"
        f"background:#fff;{FONT}")
CARD_TITLE = "font-size:11px;color:#666;text-transform:uppercase;letter-spacing:0.04em"
CARD_VALUE = "font-size:22px;font-weight:bold;color:#222;margin:2px 0"
CARD_NOTE = "font-size:12px;color:#444"
TABLE = f"border-collapse:collapse;{FONT};font-size:12px;margin:6px 0 14px 0"
TH = "text-align:right;padding:3px 6px;border-bottom:2px solid #ccc;color:#444;white-space:nowrap;"
TD = "text-align:right;padding:3px 6px;border-bottom:1px solid #eee;white-space:nowrap;"
TH_GROUP = "text-align:center;padding:2px 9px 0 9px;color:#666;font-weight:normal;font-size:11px;white-space:nowrap;"
URL_TD = "white-space:normal;word-break:break-all;max-width:520px;"  # long URLs wrap instead of widening the table
SECTION = f"{FONT};font-size:13px;font-weight:bold;color:#333;margin-top:8px"
LEFT = "text-align:left;"  # the first two columns: names


def fmt_bytes(n: float | None) -> str:
    return "?" if n is None else format_bytes(n)


def fmt_pct(x: float | None) -> str:
    return "–" if x is None else f"{100 * x:.0f}%" if x in (0, 1) or x >= 0.1 else f"{100 * x:.1f}%"


def fmt_int(n: int | None) -> str:
    return "?" if n is None else f"{n:,}"


def short(address: str) -> str:
    return address.split("://", 1)[-1]


def _card(title: str, value: str, note: str = "") -> str:
    return (f'<div style="{CARD}"><div style="{CARD_TITLE}">{html.escape(title)}</div>'
            f'<div style="{CARD_VALUE}">{html.escape(value)}</div>'
            f'<div style="{CARD_NOTE}">{note}</div></div>')


def _dot(color: str, first: bool = False) -> str:
    return (f'<span style="display:inline-block;width:9px;height:9px;border-radius:2px;'
            f'background:{color};margin:0 4px 0 {0 if first else 10}px"></span>')


def summary_html(snap: dict) -> str:
    c, total = snap["cluster"], snap["total"]
    parts = [f'<div style="{FONT};margin:4px 0 2px 0">'
             '<span style="font-size:18px;font-weight:bold;color:#222">dmdask tiers</span>'
             '<span style="font-size:12px;color:#666;margin-left:10px">RAM and SSD block cache of the '
             'workers, from their heartbeats (updated every second)</span></div>'
             '<div style="display:flex;flex-wrap:wrap;gap:10px;margin:6px 0 8px 0">']
    others = snap["other_workers"]
    note = f"RAM {fmt_bytes(total['ram']['capacity'])}, SSD {fmt_bytes(total['ssd']['capacity'])} in all"
    if others:
        note += f'<br><span style="color:#b94a48">{len(others)} without dmdask tiers</span>'
    for tier in ("ram", "ssd"):
        for text in filter(None, (total[tier].get("warning"), total[tier].get("error"))):
            note += f'<br><span style="color:#b94a48;white-space:normal">{html.escape(text)}</span>'
    parts.append(_card("workers", str(c["workers"]), note))
    if c["cached_share"] is None:
        parts.append(_card("dataset cached", "–", "no dataset registered yet"))
    else:
        size = fmt_bytes(c["dataset_bytes"])
        parts.append(_card(
            "dataset cached", fmt_pct(c["cached_share"]),
            f"{c['cached_blocks']:,} of {c['dataset_blocks']:,} blocks · {fmt_bytes(c['cached_bytes'])} of {size}"
            f"<br>{_dot(RAM, True)}RAM {fmt_bytes(total['ram']['bytes'])}"
            f"{_dot(SSD)}SSD {fmt_bytes(total['ssd']['bytes'])}"
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


def _row(cells, style: str = "", wrap: tuple = ()) -> str:
    """A table row; the first two cells (names) left-aligned, those in `wrap` may wrap."""
    return "<tr>" + "".join(
        f'<td style="{TD}{style}{URL_TD if i in wrap else ""}{LEFT if i < 2 else ""}">{html.escape(str(v))}</td>'
        for i, v in enumerate(cells)) + "</tr>"


def _table(title: str, head_rows: list, rows: list) -> str:
    return (f'<div style="{SECTION}">{title}</div><div style="max-width:100%;overflow-x:auto">'
            f'<table style="{TABLE}">{"".join(head_rows)}{"".join(rows)}</table></div>')


def _head(heads) -> str:
    return "<tr>" + "".join(f'<th style="{TH}{LEFT if i < 2 else ""}">{h}</th>' for i, h in enumerate(heads)) + "</tr>"


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
        rows.append(_row([address, name, _held(s["ram"]), _held(s["ssd"]),
                          fmt_int(s["ram"]["blocks"]), fmt_int(s["ssd"]["blocks"]), fmt_int(s["streamed_blocks"]),
                          fmt_int(s["ram"]["hits"]), fmt_int(s["ssd"]["hits"]), fmt_int(s["stream"]["hits"]),
                          fmt_pct(None if shares is None else shares["ram"] + shares["ssd"]),
                          fmt_int(s["shared_store"]["requests"]), fmt_bytes(s["shared_store"]["bytes"]),
                          fmt_bytes(s["peer"]["bytes_in"]), fmt_bytes(s["peer"]["bytes_out"])],
                         style="font-weight:bold;" if address == "total" else ""))
    for address in snap["other_workers"]:
        rows.append(f'<tr><td style="{TD}text-align:left">{html.escape(short(address))}</td>'
                    f'<td colspan="{len(heads) - 1}" style="{TD}text-align:left;color:#b94a48">'
                    "no dmdask tiers (a plain Dask worker, or no heartbeat yet)</td></tr>")
    top = "".join(f'<th colspan="{n}" style="{TH_GROUP}">{g}</th>' for g, n in groups)
    return _table("Workers", [f"<tr>{top}</tr>", _head(heads)], rows)


def datasets_html(snap: dict) -> str:
    rows = [_row([name if "files" not in d else f"{fmt_int(d['files'])} files",
                  (d.get("url") or "") + (" (dmdask::)" if "files" in d else ""), fmt_int(d["samples"]),
                  fmt_int(d["blocks"]), fmt_int(d.get("loaded_blocks")), fmt_bytes(d["bytes"])], wrap=(1,))
            for name, d in snap["datasets"].items()]
    if not rows:
        rows.append(f'<tr><td colspan="6" style="{TD}text-align:left;color:#666">none yet: '
                    "datasets appear when a training process first iterates over them</td></tr>")
    heads = ["dataset", "source", "samples", "blocks", "blocks loaded", "decoded size"]
    return _table("Datasets", [_head(heads)], rows)
