"""`dmdask demo`: train a small PyTorch model through dmdask on an embedded cluster.

It writes a synthetic image dataset to a "shared" folder, serves that folder over HTTP
with the counting store server (the stand-in for a shared file system), starts a
`dmdask.LocalCluster`, trains for a few epochs and reports what left the shared store
per epoch against the dataset size, where each sample came from, and epoch times.
"""
from __future__ import annotations

import argparse
import os
import time

import distributed
import numpy as np


def _parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="dmdask demo", description=__doc__.splitlines()[0])
    p.add_argument("--workers", type=int, default=2, help="worker processes (default 2)")
    p.add_argument("--samples", type=int, default=16384, help="dataset size in samples")
    p.add_argument("--epochs", type=int, default=3)
    p.add_argument("--batch-size", type=int, default=256)
    p.add_argument("--ram", default="64 MiB", help="RAM tier per worker")
    p.add_argument("--ssd", default="64 MiB", help="SSD tier per worker (0: none)")
    p.add_argument("--latency", type=float, default=0.002, help="shared-store latency per request, s")
    p.add_argument("--bandwidth", default="200MB", help="shared-store bandwidth cap, bytes/s")
    p.add_argument("--data", default="demo-data", help="folder for the shared dataset and the SSD tier")
    p.add_argument("--progress", action=argparse.BooleanOptionalAction, default=None,
                   help="a progress bar per epoch with the hit rate (default: in a terminal)")
    return p


def main(argv=None) -> int:
    args = _parser().parse_args(argv)
    import dask
    import torch

    if args.progress is not None:  # TorchLoader -> dmdask.batches(progress=None) reads it
        dask.config.set({"dmdask.progress": args.progress})

    import dmdask
    from dmdask.testing.datasets import write_images
    from dmdask.testing.store_server import StoreServer
    from integrations.torch import TorchLoader

    shared = os.path.join(args.data, "shared")
    dataset = os.path.join(shared, "train.zarr")
    if not os.path.exists(os.path.join(dataset, "zarr.json")):
        print(f"writing {args.samples} synthetic images to {dataset} ...")
        os.makedirs(shared, exist_ok=True)
        write_images(dataset, args.samples)
    dataset_bytes = sum(os.path.getsize(os.path.join(d, f)) for d, _, fs in os.walk(dataset)
                        for f in fs if f != "zarr.json")

    with StoreServer(shared, latency=args.latency, bandwidth=args.bandwidth) as store, \
            dmdask.LocalCluster(n_workers=args.workers, ram=args.ram, ssd=args.ssd,
                                ssd_dir=os.path.join(args.data, "ssd"), dashboard_address=":8787") as cluster, \
            distributed.Client(cluster) as client:
        print(f"cluster: {args.workers} workers, RAM {args.ram} + SSD {args.ssd} each")
        print(f"dashboard: {client.dashboard_link} (dmdask tiers: {_tiers_page(client)})")
        print(f"shared store: {store.url}/train.zarr ({dataset_bytes / 2**20:.1f} MiB of chunks)")
        spec = dmdask.Spec(store.url + "/train.zarr", batch_size=args.batch_size, seed=0)
        loader = TorchLoader(client, spec)
        torch.manual_seed(0)
        model = torch.nn.Sequential(torch.nn.Flatten(), torch.nn.Linear(3 * 16 * 16, 64),
                                    torch.nn.ReLU(), torch.nn.Linear(64, 10))
        optimizer = torch.optim.SGD(model.parameters(), lr=0.05, momentum=0.9)
        rows = []
        before = _counters(client, store)
        for epoch in range(args.epochs):
            loader.set_epoch(epoch)
            started = time.perf_counter()
            losses, correct, seen = [], 0, 0
            for batch in loader:
                images = batch["image"].float() / 255.0
                labels = batch["label"]
                logits = model(images)
                loss = torch.nn.functional.cross_entropy(logits, labels)
                optimizer.zero_grad()
                loss.backward()
                optimizer.step()
                losses.append(loss.item())
                correct += int((logits.argmax(1) == labels).sum())
                seen += len(labels)
            seconds = time.perf_counter() - started
            after = _counters(client, store)
            delta = {k: after[k] - before[k] for k in after}
            before = after
            rows.append((epoch, seconds, float(np.mean(losses)), correct / seen, delta))
        _report(rows, dataset_bytes, client.dashboard_link)
    return 0


def _counters(client, store) -> dict:
    import dmdask

    total = dmdask.stats(client)["total"]
    served = store.stats()
    return {"store_bytes": served["bytes"], "store_requests": served["requests"],
            "ram": total["ram"]["hits"], "ssd": total["ssd"]["hits"], "stream": total["stream"]["hits"],
            "peer_bytes": total["peer"]["bytes_in"]}


def _report(rows, dataset_bytes: int, dashboard: str) -> None:
    print()
    print("epoch  time(s)  loss   acc    shared-store MiB (x dataset)  requests  from RAM  from SSD  streamed")
    total_store = 0
    for epoch, seconds, loss, acc, d in rows:
        total_store += d["store_bytes"]
        print(f"{epoch:>5}  {seconds:7.2f}  {loss:5.3f}  {acc:5.3f}  "
              f"{d['store_bytes'] / 2**20:10.2f} ({d['store_bytes'] / dataset_bytes:4.2f}x)      "
              f"{d['store_requests']:8d}  {d['ram']:8d}  {d['ssd']:8d}  {d['stream']:8d}")
    epochs = len(rows)
    print(f"\nshared store over {epochs} epochs: {total_store / 2**20:.2f} MiB = "
          f"{total_store / dataset_bytes:.2f}x the dataset "
          f"(a loader without a cache reads {epochs:.0f}x; "
          f"{100 * (1 - total_store / (epochs * dataset_bytes)):.0f}% saved)")
    if len(rows) > 1:
        later = np.mean([r[1] for r in rows[1:]])
        print(f"epoch 1: {rows[0][1]:.2f} s, later epochs: {later:.2f} s on average")
    print(f"dashboard: {dashboard}")


def _tiers_page(client) -> str:
    return client.dashboard_link.rsplit("/", 1)[0] + "/dmdask"
