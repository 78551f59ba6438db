"""The scenario's goals, judged at every point: dmdask's store bytes at the bound, dmdask
ahead of every peer that ran on epochs 2+ and on store bytes, epoch 1 no slower than the
fastest peer."""
from __future__ import annotations

from typing import List

OURS = ("dmdask", "transparent")


def bound(result: dict, point: dict) -> float:
    """E*D - min(C, D)*(E - 1), C the cluster's cache (every node's together)."""
    epochs, size = result["config"]["epochs"], result["dataset_bytes"]
    c = min(point["nodes"] * point["node_cache_bytes"], size)
    return epochs * size - c * (epochs - 1)


def peers_ok(rows: dict) -> dict:
    return {k: r for k, r in rows.items() if k not in OURS and r["status"] == "ok"}


def goals(result: dict) -> List[dict]:
    at_bound, later, traffic, first = [], [], [], []
    for point in result["points"]:
        rows = point["loaders"]
        mine, peers = rows.get("dmdask", {}), peers_ok(rows)
        tag = f"{point['nodes']} nodes, {point['node_cache']:.2f} D a node"
        if mine.get("status") != "ok":
            for lst in (at_bound, later, traffic, first):
                lst.append((False, f"{tag}: dmdask {mine.get('status', 'missing')}"))
            continue
        r = mine["store_bytes"] / bound(result, point)
        at_bound.append((abs(r - 1) <= 0.02, f"{tag}: {r:.3f}"))
        if not peers:
            for lst in (later, traffic, first):
                lst.append((False, f"{tag}: no peer ran"))
            continue
        best = min(peers, key=lambda k: peers[k]["later_s"])
        later.append((mine["later_s"] < peers[best]["later_s"],
                      f"{tag}: {mine['later_s'] / peers[best]['later_s']:.2f}x {best}"))
        least = min(peers, key=lambda k: peers[k]["store_bytes"])
        traffic.append((mine["store_bytes"] < peers[least]["store_bytes"],
                        f"{tag}: {mine['store_bytes'] / peers[least]['store_bytes']:.2f}x {least}"))
        fastest = min(peers, key=lambda k: peers[k]["epoch1_s"])
        first.append((mine["epoch1_s"] <= peers[fastest]["epoch1_s"],
                      f"{tag}: {mine['epoch1_s'] / peers[fastest]['epoch1_s']:.2f}x {fastest}"))

    def goal(text, checks):
        return {"goal": text, "met": bool(checks) and all(ok for ok, _ in checks),
                "measured": "; ".join(m for _, m in checks)}

    return [goal("dmdask's shared-store bytes at the bound E*D - min(C,D)*(E-1), within 2% (dmdask / bound)", at_bound),
            goal("dmdask ahead of every peer on epochs 2+ time (dmdask / best peer)", later),
            goal("dmdask ahead of every peer on shared-store bytes (dmdask / least peer)", traffic),
            goal("dmdask's epoch 1 no slower than the fastest peer's (dmdask / fastest peer)", first)]
