"""Train a small PyTorch classifier on batches from a dmdask cluster.

    # a local two-worker cluster and a synthetic Zarr dataset written to a temp folder
    python integrations/examples/torch_train.py
    # an existing cluster and dataset (arrays "x": features, "y": int class labels)
    python integrations/examples/torch_train.py --scheduler tcp://host:8786 --source s3://bucket/train.zarr
    # several ranks (each needs the shared cluster): torchrun --nproc-per-node 2 ... --scheduler ADDR
    # (without --source, rank 0 writes the synthetic dataset once and the other ranks
    # wait for it and read the same path: the workers must see rank 0's files, so run
    # them on the same machine or pass --source on a shared file system)

Checkpoints hold the model, the optimizer and the loader's position; --checkpoint
resumes mid-epoch, right after the last batch the interrupted run consumed.
"""
from __future__ import annotations

import argparse
import os
import shutil
import tempfile
import time

import distributed
import numpy as np
import torch

import dmdask
from dmdask.testing.datasets import write_blobs
from dmdask.integrations.torch import TorchLoader


def main(argv=None) -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--scheduler", help="address of a cluster of dmdask workers (default: start a local one)")
    parser.add_argument("--source", help="Zarr v3 group with arrays x and y (default: write a synthetic one, "
                        "next to --checkpoint if given)")
    parser.add_argument("--epochs", type=int, default=3)
    parser.add_argument("--batch-size", type=int, default=128)
    parser.add_argument("--lr", type=float, default=0.05)
    parser.add_argument("--ram", default="256 MiB", help="per-worker RAM tier of the local cluster")
    parser.add_argument("--checkpoint", help="file to save to after each epoch and resume from if present")
    parser.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    args = parser.parse_args(argv)

    if "WORLD_SIZE" in os.environ and not torch.distributed.is_initialized():  # started by torchrun
        torch.distributed.init_process_group("gloo")
        if not args.scheduler and torch.distributed.get_world_size() > 1:
            parser.error("several ranks must share one cluster: pass --scheduler")

    cluster = None
    if args.scheduler:
        client = distributed.Client(args.scheduler)
    else:
        cluster = dmdask.LocalCluster(n_workers=2, ram=args.ram)
        client = distributed.Client(cluster)
    source, tmp = args.source, None
    if source is None:
        source, tmp = synthetic_dataset(args.checkpoint)

    try:
        import zarr

        g = zarr.open_group(source, mode="r")
        features, classes = g["x"].shape[1], int(np.max(g["y"][:])) + 1
        ddp = torch.distributed.is_initialized() and torch.distributed.get_world_size() > 1
        # under DDP every rank must take the same number of steps: drop the uneven tail
        spec = dmdask.Spec(source=source, batch_size=args.batch_size, keys=["x", "y"], drop_last=ddp)
        device = torch.device(args.device)
        loader = TorchLoader(client, spec, pin_memory=device.type == "cuda", device=device)

        torch.manual_seed(0)
        model = torch.nn.Sequential(torch.nn.Linear(features, 64), torch.nn.ReLU(),
                                    torch.nn.Linear(64, classes)).to(device)
        if ddp:
            model = torch.nn.parallel.DistributedDataParallel(model)
        opt = torch.optim.SGD(model.parameters(), lr=args.lr, momentum=0.9)

        start = 0
        if args.checkpoint and os.path.exists(args.checkpoint):
            ckpt = torch.load(args.checkpoint)
            model.load_state_dict(ckpt["model"])
            opt.load_state_dict(ckpt["optimizer"])
            loader.load_state_dict(ckpt["loader"])
            start = ckpt["loader"]["epoch"]
            print(f"resumed at epoch {start}, batch {(ckpt['loader']['iterator'] or {}).get('position', 0)}")

        print(f"{loader!r}: {len(loader)} batches per epoch")
        for epoch in range(start, args.epochs):
            loader.set_epoch(epoch)  # keeps a loaded mid-epoch position of this epoch
            t0, losses, correct, seen = time.perf_counter(), [], 0, 0
            for batch in loader:
                logits = model(batch["x"])
                loss = torch.nn.functional.cross_entropy(logits, batch["y"])
                opt.zero_grad()
                loss.backward()
                opt.step()
                losses.append(loss.item())
                correct += int((logits.argmax(1) == batch["y"]).sum())
                seen += len(batch["y"])
            if seen == 0:  # resumed from a checkpoint taken at the end of this epoch
                continue
            print(f"epoch {epoch}: loss {np.mean(losses):.4f}, "
                  f"accuracy {correct / max(seen, 1):.3f}, {seen} samples, {time.perf_counter() - t0:.2f} s")
            if args.checkpoint:
                torch.save({"model": model.state_dict(), "optimizer": opt.state_dict(),
                            "loader": loader.state_dict()}, args.checkpoint)
        loader.close()
        if torch.distributed.is_initialized():
            torch.distributed.barrier()  # every rank is done with the dataset
        if tmp is not None:  # rank 0's throw-away dataset: drop its blocks from the cluster's cache
            dmdask.release(client, spec)
    finally:
        client.close()
        if cluster is not None:
            cluster.close()
        if tmp is not None:
            shutil.rmtree(tmp, ignore_errors=True)
        if torch.distributed.is_initialized():
            torch.distributed.destroy_process_group()


def synthetic_dataset(checkpoint):
    """(path, temporary folder to remove or None) of the synthetic dataset, written once:
    by rank 0, next to the checkpoint if given (so a resumed run reads the same data),
    else in a temporary folder. Under torchrun the other ranks wait for rank 0 to write
    it and take its path, so every rank reads the same dataset (dmdask's exactly-once
    delivery needs the same spec on every rank)."""
    rank = torch.distributed.get_rank() if torch.distributed.is_initialized() else 0
    path = tmp = None
    if rank == 0:
        if checkpoint:
            path = os.path.abspath(checkpoint) + ".zarr"
        else:
            tmp = tempfile.mkdtemp(prefix="dmdask-example-")
            path = os.path.join(tmp, "train.zarr")
        if not os.path.exists(path):
            write_blobs(path)
            print(f"rank 0 wrote a synthetic dataset to {path}")
    if torch.distributed.is_initialized():
        shared = [path]
        torch.distributed.broadcast_object_list(shared, src=0)  # waits for rank 0
        path = shared[0]
    return path, tmp


if __name__ == "__main__":
    main()
