"""The scenario's goals, judged at every point: dmdask's store bytes at the bound, dmdask
ahead of every peer that ran on epochs 2+ (apart: the points with the emulated step, and the
loader-bound points with none, each with the load average of dmdask's and the peer's runs and
dmdask's per-rank samples/s against its same-host run) and on store bytes, epoch 1 no slower
than the fastest peer."""
from __future__ import annotations

from typing import List

OURS = ("dmdask", "transparent")


def bound(result: dict, point: dict) -> float:
    """E*D - min(C, D)*(E - 1), C the cluster's cache (every node's together), E the point's epochs."""
    epochs, size = point.get("epochs", result["config"]["epochs"]), result["dataset_bytes"]
    c = min(point["nodes"] * point["node_cache_bytes"], size)
    return epochs * size - c * (epochs - 1)


def peers_ok(rows: dict) -> dict:
    return {k: r for k, r in rows.items() if k not in OURS and r["status"] == "ok"}


def loader_bound(result: dict, point: dict) -> bool:
    """True at a point with no emulated step (results written before points had their own rate: never)."""
    return point.get("rate", result["config"]["rate"]) == 0


def load(r: dict) -> str:
    """The 1-minute load average as `r`'s run started and ended, or '?' (results without it)."""
    return "-".join(f"{x:.1f}" for x in r["load_1min"]) if "load_1min" in r else "?"


def vs_same_host(point: dict) -> str:
    """dmdask's per-rank samples/s on epochs 2+ at `point` over its same-host run's, or ''."""
    mine, same = point["loaders"].get("dmdask", {}), point.get("same_host", {})
    if mine.get("status") != "ok" or same.get("status") != "ok":
        return ""
    a, b = mine["later_per_rank_samples_per_s"], same["later_per_rank_samples_per_s"]
    return f"{a:,.0f} per rank vs {b:,.0f} same host ({a / b:.2f}x)"


def goals(result: dict) -> List[dict]:
    at_bound, later, unbound, traffic, first = [], [], [], [], []
    for point in result["points"]:
        rows = point["loaders"]
        mine, peers = rows.get("dmdask", {}), peers_ok(rows)
        tag = f"{point['nodes']} nodes, {point['node_cache']:.2f} D a node" + (", no step" if loader_bound(result, point)
                                                                             else "")
        epochs = unbound if loader_bound(result, point) else later
        if mine.get("status") != "ok":
            for lst in (at_bound, epochs, traffic, first):
                lst.append((False, f"{tag}: dmdask {mine.get('status', 'missing')}"))
            continue
        r = mine["store_bytes"] / bound(result, point)
        at_bound.append((abs(r - 1) <= 0.02, f"{tag}: {r:.3f}"))
        if not peers:
            for lst in (epochs, traffic, first):
                lst.append((False, f"{tag}: no peer ran"))
            continue
        best = min(peers, key=lambda k: peers[k]["later_s"])
        text = f"{tag}: {mine['later_s'] / peers[best]['later_s']:.2f}x {best}"
        if epochs is unbound:
            same = vs_same_host(point)
            text += f" (load {load(mine)} / {load(peers[best])}{'; dmdask ' + same if same else ''})"
        epochs.append((mine["later_s"] < peers[best]["later_s"], text))
        least = min(peers, key=lambda k: peers[k]["store_bytes"])
        traffic.append((mine["store_bytes"] < peers[least]["store_bytes"],
                        f"{tag}: {mine['store_bytes'] / peers[least]['store_bytes']:.2f}x {least}"))
        fastest = min(peers, key=lambda k: peers[k]["epoch1_s"])
        first.append((mine["epoch1_s"] <= peers[fastest]["epoch1_s"],
                      f"{tag}: {mine['epoch1_s'] / peers[fastest]['epoch1_s']:.2f}x {fastest}"))

    def goal(text, checks):
        return {"goal": text, "met": bool(checks) and all(ok for ok, _ in checks),
                "measured": "; ".join(m for _, m in checks)}

    out = [goal("dmdask's shared-store bytes at the bound E*D - min(C,D)*(E-1), within 2% (dmdask / bound)", at_bound),
           goal("dmdask ahead of every peer on epochs 2+ time (dmdask / best peer)", later)]
    if unbound:
        out.append(goal("#36: loader-bound (no emulated step): dmdask ahead of every peer on epochs 2+ time (dmdask / "
                        "best peer; load average at the start-end of dmdask's / the peer's run; dmdask's per-rank "
                        "samples/s on epochs 2+ against the same-host path)", unbound))
    return out + [
        goal("dmdask ahead of every peer on shared-store bytes (dmdask / least peer)", traffic),
        goal("dmdask's epoch 1 no slower than the fastest peer's (dmdask / fastest peer)", first)]
