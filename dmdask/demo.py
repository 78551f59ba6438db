"""`dmdask demo`: train a small PyTorch model through dmdask on an embedded cluster.

It writes a synthetic image dataset to a "shared" folder (the stand-in for a shared
file system such as Lustre or NFS), reads it from that path as a user would, starts a
`dmdask.LocalCluster`, trains for a few epochs and reports what dmdask's workers read
from the shared store per epoch (`dmdask.stats`: decoded bytes and block reads)
against the dataset size, where each sample came from, and epoch times.
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
    p.add_argument("--data", default="demo-data", help="folder for the shared dataset and the SSD tier")
    p.add_argument("--progress", action=argparse.BooleanOptionalAction, default=None,
                   help="a progress bar per epoch with the hit rate (default: in a terminal)")
    return p


def main(argv=None) -> int:
    args = _parser().parse_args(argv)
    import dask
    import torch
    import zarr

    if args.progress is not None:  # TorchLoader -> dmdask.batches(progress=None) reads it
        dask.config.set({"dmdask.progress": args.progress})

    import dmdask
    from dmdask.integrations.torch import TorchLoader
    from dmdask.testing.datasets import write_images

    shared = os.path.abspath(os.path.join(args.data, "shared"))
    dataset = os.path.join(shared, "train.zarr")
    if not os.path.exists(os.path.join(dataset, "zarr.json")):
        print(f"writing {args.samples} synthetic images to {dataset} ...")
        os.makedirs(shared, exist_ok=True)
        write_images(dataset, args.samples)
    # the size dmdask counts: decoded arrays, not the compressed chunk files
    dataset_bytes = sum(a.nbytes for _, a in zarr.open_group(dataset, mode="r").arrays())

    with dmdask.LocalCluster(n_workers=args.workers, ram=args.ram, ssd=args.ssd,
                             ssd_dir=os.path.join(args.data, "ssd"), dashboard_address=":8787") as cluster, \
            distributed.Client(cluster) as client:
        print(f"cluster: {args.workers} workers, RAM {args.ram} + SSD {args.ssd} each")
        print(f"dashboard: {client.dashboard_link} (dmdask tiers: {_tiers_page(client)})")
        print(f"shared store: {dataset} ({dataset_bytes / 2**20:.1f} MiB decoded)")
        spec = dmdask.Spec(dataset, batch_size=args.batch_size, seed=0)
        loader = TorchLoader(client, spec)
        torch.manual_seed(0)
        model = torch.nn.Sequential(torch.nn.Flatten(), torch.nn.Linear(3 * 16 * 16, 64),
                                    torch.nn.ReLU(), torch.nn.Linear(64, 10))
        optimizer = torch.optim.SGD(model.parameters(), lr=0.05, momentum=0.9)
        rows = []
        before = _counters(client)
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
            after = _counters(client)
            delta = {k: after[k] - before[k] for k in after}
            before = after
            rows.append((epoch, seconds, float(np.mean(losses)), correct / seen, delta))
        _report(rows, dataset_bytes, client.dashboard_link)
    return 0


def _counters(client) -> dict:
    """Cumulative counters over all workers; the demo prints their change per epoch."""
    import dmdask

    total = dmdask.stats(client)["total"]
    return {"store_bytes": total["shared_store"]["bytes"], "store_requests": total["shared_store"]["requests"],
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
