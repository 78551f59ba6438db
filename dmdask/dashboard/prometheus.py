"""`dmdask_*` metrics on the scheduler's `/metrics` (the global prometheus_client registry).

One collector per process, registered once, even across reloads of this module (it
is remembered on the registry itself). It reports the scheduler whose preload ran
last and is still running, like Dask's own scheduler collectors.
"""
from __future__ import annotations

import logging
import threading
import weakref
from collections.abc import Iterator

from .figures import monitor

logger = logging.getLogger(__name__)

_ATTRIBUTE = "_dmdask_collector"  # where the registered collector is remembered
_lock = threading.Lock()


class DmdaskCollector:
    """A prometheus_client custom collector over `figures.snapshot`."""

    def __init__(self):
        self._scheduler = None

    @property
    def scheduler(self):
        return self._scheduler() if self._scheduler is not None else None

    @scheduler.setter
    def scheduler(self, value) -> None:
        self._scheduler = weakref.ref(value) if value is not None else None

    def describe(self):
        return []  # names are not known up front; no collect() at registration

    def collect(self) -> Iterator:
        from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily

        scheduler = self.scheduler
        if scheduler is None or getattr(getattr(scheduler, "status", None), "name", "running") in ("closing", "closed"):
            return
        snap = monitor(scheduler).snapshot()
        W, WT, WD = ["worker"], ["worker", "tier"], ["worker", "direction"]

        def gauge(name, doc, labels=()):
            return GaugeMetricFamily(name, doc, labels=list(labels))

        def counter(name, doc, labels=()):
            return CounterMetricFamily(name, doc, labels=list(labels))

        workers = GaugeMetricFamily("dmdask_workers", "Workers reporting dmdask tiers", value=len(snap["workers"]))
        tier_bytes = gauge("dmdask_tier_bytes", "Bytes of blocks held in the tier", WT)
        capacity = gauge("dmdask_tier_capacity_bytes", "Capacity of the tier in bytes", WT)
        blocks = gauge("dmdask_tier_blocks", "Blocks held per tier (tier=stream: blocks beyond the "
                       "cache, streamed from the shared store when asked for)", WT)
        full = gauge("dmdask_tier_full", "1 once the tier's device refused a write (out of space)", WT)
        hits = counter("dmdask_hits", "Samples served, by the tier they came from "
                       "(stream: read from the shared store)", WT)
        hit_bytes = counter("dmdask_hit_bytes", "Bytes of samples served from the tier", WT)
        store_bytes = counter("dmdask_shared_store_bytes", "Decoded bytes read from the shared store", W)
        store_requests = counter("dmdask_shared_store_requests", "Blocks read from the shared store", W)
        peer = counter("dmdask_peer_bytes", "Bytes of rows sent to (out) or received from (in) peer workers", WD)
        buffer_bytes = gauge("dmdask_stream_buffer_bytes", "Bytes in the stream buffer", W)
        buffer_capacity = gauge("dmdask_stream_buffer_capacity_bytes", "Capacity of the stream buffer", W)
        for address, s in snap["workers"].items():
            for tier in ("ram", "ssd"):
                t = s[tier]
                tier_bytes.add_metric([address, tier], t["bytes"])
                capacity.add_metric([address, tier], t["capacity"])
                blocks.add_metric([address, tier], t["blocks"])
                full.add_metric([address, tier], int(bool(t["full"])))
                hit_bytes.add_metric([address, tier], t["hit_bytes"])
            blocks.add_metric([address, "stream"], s["streamed_blocks"])
            for tier in ("ram", "ssd", "stream"):
                hits.add_metric([address, tier], s[tier]["hits"])
            store_bytes.add_metric([address], s["shared_store"]["bytes"])
            store_requests.add_metric([address], s["shared_store"]["requests"])
            peer.add_metric([address, "in"], s["peer"]["bytes_in"])
            peer.add_metric([address, "out"], s["peer"]["bytes_out"])
            buffer_bytes.add_metric([address], s["stream"]["buffer_bytes"])
            buffer_capacity.add_metric([address], s["stream"]["buffer_capacity"])
        yield from (workers, tier_bytes, capacity, blocks, full, hits, hit_bytes, store_bytes,
                    store_requests, peer, buffer_bytes, buffer_capacity)

        D = ["dataset"]
        ds_blocks = gauge("dmdask_dataset_blocks", "Blocks of a dmdask dataset", D)
        ds_loaded = gauge("dmdask_dataset_loaded_blocks", "Blocks of the dataset loaded (cached or streamed)", D)
        ds_bytes = gauge("dmdask_dataset_bytes", "Decoded size of the dataset, from its metadata", D)
        ds_samples = gauge("dmdask_dataset_samples", "Samples of the dataset", D)
        for name, d in snap["datasets"].items():
            ds_blocks.add_metric([name], d["blocks"])
            ds_loaded.add_metric([name], d.get("loaded_blocks", 0))
            if d["bytes"] is not None:
                ds_bytes.add_metric([name], d["bytes"])
                ds_samples.add_metric([name], d["samples"])
        share = gauge("dmdask_cached_share", "Share of the registered datasets' blocks held in RAM or SSD")
        cluster = snap["cluster"]
        if cluster["cached_share"] is not None:
            share.add_metric([], cluster["cached_share"])
        yield from (ds_blocks, ds_loaded, ds_bytes, ds_samples, share)


def collector():
    """The process's registered collector (registered on first call), or None without
    prometheus_client."""
    try:
        import prometheus_client
    except ImportError:
        return None
    registry = prometheus_client.REGISTRY
    with _lock:
        found = getattr(registry, _ATTRIBUTE, None)
        if found is None:
            found = DmdaskCollector()
            registry.register(found)
            setattr(registry, _ATTRIBUTE, found)
    return found


def register(scheduler) -> None:
    """Report `scheduler` on `/metrics` from now on."""
    found = collector()
    if found is None:
        logger.info("prometheus_client is not installed: no dmdask_* metrics on /metrics")
        return
    found.scheduler = scheduler


def unregister(scheduler) -> None:
    found = collector()
    if found is not None and found.scheduler is scheduler:
        found.scheduler = None
