"""Train a small PyTorch classifier on batches from a dmdask cluster.

    # a local two-worker cluster and a synthetic Zarr dataset written to a temp folder
    python integrations/examples/torch_train.py
    # an existing cluster and dataset (arrays "x": features, "y": int class labels)
    python integrations/examples/torch_train.py --scheduler tcp://host:8786 --source s3://bucket/train.zarr
    # several ranks (each needs the shared cluster): torchrun --nproc-per-node 2 ... --scheduler ADDR

Checkpoints hold the model, the optimizer and the loader's position; --checkpoint
resumes mid-epoch, right after the last batch the interrupted run consumed.
"""
from __future__ import annotations

import argparse
import os
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
    tmp = None
    if args.scheduler:
        client = distributed.Client(args.scheduler)
    else:
        cluster = dmdask.LocalCluster(n_workers=2, ram=args.ram)
        client = distributed.Client(cluster)
    source = args.source
    if source is None:  # next to the checkpoint, so that a resumed run reads the same dataset
        if args.checkpoint:
            source = os.path.abspath(args.checkpoint) + ".zarr"
        else:
            tmp = tempfile.TemporaryDirectory()
            source = os.path.join(tmp.name, "train.zarr")
        if not os.path.exists(source):
            write_blobs(source)

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
        if tmp is not None:  # a throw-away dataset: drop its blocks from the cluster's cache
            dmdask.release(client, spec)
    finally:
        client.close()
        if cluster is not None:
            cluster.close()
        if tmp is not None:
            tmp.cleanup()
        if torch.distributed.is_initialized():
            torch.distributed.destroy_process_group()


if __name__ == "__main__":
    main()
