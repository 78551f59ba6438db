"""`dmdask demo`: train a small model on scikit-learn's digits through a local dmdask cluster.

What it does and reports: docs/quickstart.md, "The demo".
"""
from __future__ import annotations

import argparse
import io
import os
import shutil
import signal
import textwrap
import time

import distributed
import numpy as np
from dask.utils import format_bytes, parse_bytes

from .cli import tiers_page

TEST_FRACTION = 0.2
MEAN, STD = 0.3, 0.4  # of the digits' pixels in [0, 1]: normalize() centres them


DESCRIPTION = __doc__.split("\n\n")[0].split(": ", 1)[1]
EPILOG = "The report's epochs are numbered from 0, as dmdask.batches(epoch=...) numbers them."


def add_arguments(p: argparse.ArgumentParser) -> argparse.ArgumentParser:
    """The options of `dmdask demo`."""
    p.add_argument("--workers", type=int, default=2, help="worker processes (default 2)")
    p.add_argument("--epochs", type=int, default=6, help="training epochs (default 6)")
    p.add_argument("--quick", action="store_true", help="3 epochs (the smoke test's setting)")
    p.add_argument("--batch-size", type=int, default=64)
    p.add_argument("--block-size", type=int, default=64, help="files per block (default 64)")
    p.add_argument("--ram", default="32 KiB", help="RAM tier per worker (default 32 KiB)")
    p.add_argument("--ssd", default="32 KiB", help="SSD tier per worker, 0: none (default 32 KiB)")
    p.add_argument("--data", default="demo-data", help="folder for the shared dataset and the SSD tiers")
    p.add_argument("--model", choices=("auto", "torch", "numpy"), default="auto",
                   help="auto: PyTorch if installed, else numpy softmax regression")
    p.add_argument("--dashboard-address", default=":0",
                   help="where the Dask dashboard listens (default: a free port; the real address is printed)")
    p.add_argument("--serve", action="store_true", help="keep the cluster and its dashboard up afterwards, "
                   "until Ctrl-C")
    p.add_argument("--progress", action=argparse.BooleanOptionalAction, default=None,
                   help="a progress bar per epoch with the hit rate (default: in a terminal)")
    return p


def command(args) -> int:
    """`dmdask demo` with parsed options."""
    if args.quick:
        args.epochs = 3
    run(args)
    return 0


def run(args) -> dict:
    import dmdask
    from dmdask import images

    shared = os.path.abspath(os.path.join(args.data, "shared"))
    train_dir, test_dir = write_digits(os.path.join(shared, "digits"))
    dataset_bytes, train_files = folder_bytes(train_dir)
    model = make_model(args.model)
    # Augmentation on the workers, fresh every epoch and the same on a resumed one.
    # No flip: a mirrored digit is another glyph.
    train_tf = images.pipeline(images.decode("L"), images.random_resized_crop(8, scale=(0.85, 1.0), ratio=(0.9, 1.1)),
                               images.normalize(MEAN, STD))
    test_tf = images.pipeline(images.decode("L"), images.normalize(MEAN, STD))

    with dmdask.LocalCluster(n_workers=args.workers, ram=args.ram, ssd=args.ssd,
                             ssd_dir=os.path.join(os.path.abspath(args.data), "ssd"),
                             dashboard_address=args.dashboard_address) as cluster, \
            distributed.Client(cluster) as client:
        capacity = args.workers * (_bytes(args.ram) + _bytes(args.ssd))
        print(f"shared store: {_shown(train_dir)} ({train_files} PNG files, {format_bytes(dataset_bytes)})")
        print(f"cache: {args.workers} workers x (RAM {args.ram} + SSD {args.ssd}) = {format_bytes(capacity)}, "
              f"{'smaller than' if capacity < dataset_bytes else 'at least'} the dataset")
        print(f"dashboard: {client.dashboard_link}  (dmdask tiers: {tiers_page(client.dashboard_link)})")
        print(f"model: {model.name}; training {args.epochs} epochs, batches of {args.batch_size} decoded and "
              "augmented on the workers (dmdask.images)")
        spec = dmdask.Spec(train_dir, batch_size=args.batch_size, seed=0, block_size=args.block_size,
                           transform=train_tf)
        rows = []
        before = counters(client)
        for epoch in range(args.epochs):
            started = time.perf_counter()
            losses, correct, seen = [], 0, 0
            for batch in dmdask.batches(client, spec, epoch=epoch, progress=args.progress):
                x = batch["image"].reshape(len(batch["index"]), -1)
                loss, right = model.step(x, batch["label"])
                losses.append(loss)
                correct += right
                seen += len(x)
            seconds = time.perf_counter() - started
            after = counters(client)
            rows.append({"epoch": epoch, "seconds": seconds, "loss": float(np.mean(losses)),
                         "accuracy": correct / seen, **{k: after[k] - before[k] for k in after}})
            before = after
        report(rows, dataset_bytes, train_files)

        test = dmdask.Spec(test_dir, batch_size=256, shuffle=False, transform=test_tf)
        correct = seen = 0
        for batch in dmdask.batches(client, test, progress=False):
            x = batch["image"].reshape(len(batch["index"]), -1)
            correct += int((model.predict(x) == batch["label"]).sum())
            seen += len(x)
        accuracy = correct / seen
        print(f"\ntest accuracy: {accuracy:.3f} on {seen} held-out digits (decoded by the workers, not augmented)")
        if args.serve:
            serve(client)
    return {"rows": rows, "test_accuracy": accuracy, "dataset_bytes": dataset_bytes}


# -- the dataset ---------------------------------------------------------------------------
def write_digits(root: str) -> tuple:
    """The two folders `root`/train and `root`/test of scikit-learn's digits as PNG files in
    class folders (a fixed 80/20 split), written once: a later run finds them."""
    train, test = os.path.join(root, "train"), os.path.join(root, "test")
    if os.path.exists(os.path.join(root, "COMPLETE")):
        return train, test
    from PIL import Image
    from sklearn.datasets import load_digits

    digits = load_digits()  # bundled with scikit-learn: nothing to download
    n = len(digits.target)
    test_ids = set(np.random.default_rng(0).permutation(n)[:int(n * TEST_FRACTION)].tolist())
    print(f"writing {n} digits as PNG files to {_shown(root)} ...")
    partial = root + ".partial"
    shutil.rmtree(partial, ignore_errors=True)
    for i, (pixels, label) in enumerate(zip(digits.images, digits.target)):
        folder = os.path.join(partial, "test" if i in test_ids else "train", f"class-{label:02d}")
        os.makedirs(folder, exist_ok=True)
        image = Image.fromarray(np.round(pixels * 255 / 16).astype(np.uint8), mode="L")  # 0..16 -> 0..255
        buffer = io.BytesIO()
        image.save(buffer, format="PNG")
        with open(os.path.join(folder, f"{i:04d}.png"), "wb") as f:
            f.write(buffer.getvalue())
    open(os.path.join(partial, "COMPLETE"), "w").close()
    shutil.rmtree(root, ignore_errors=True)
    os.rename(partial, root)
    return train, test


def folder_bytes(root: str) -> tuple:
    """(bytes dmdask counts when it reads the whole folder: the files plus an int64
    label each, number of files)."""
    sizes = [os.path.getsize(os.path.join(d, f)) for d, _, files in os.walk(root) for f in files]
    return sum(sizes) + 8 * len(sizes), len(sizes)


# -- the models ----------------------------------------------------------------------------
def make_model(kind: str):
    if kind in ("auto", "torch"):
        try:
            return TorchMLP()
        except ImportError:
            if kind == "torch":
                raise
    return SoftmaxRegression()


class TorchMLP:
    """64 -> 128 -> 10, Adam."""

    name = "PyTorch MLP (64-128-10)"

    def __init__(self):
        import torch

        self.torch = torch
        torch.manual_seed(0)
        self.net = torch.nn.Sequential(torch.nn.Linear(64, 128), torch.nn.ReLU(), torch.nn.Linear(128, 10))
        self.opt = torch.optim.Adam(self.net.parameters(), lr=3e-3)

    def step(self, x, y) -> tuple:
        torch = self.torch
        logits = self.net(torch.from_numpy(np.ascontiguousarray(x, dtype=np.float32)))
        labels = torch.from_numpy(np.asarray(y, dtype=np.int64))
        loss = torch.nn.functional.cross_entropy(logits, labels)
        self.opt.zero_grad()
        loss.backward()
        self.opt.step()
        return loss.item(), int((logits.argmax(1) == labels).sum())

    def predict(self, x) -> np.ndarray:
        with self.torch.no_grad():
            return self.net(self.torch.from_numpy(np.ascontiguousarray(x, dtype=np.float32))).argmax(1).numpy()


class SoftmaxRegression:
    """Multinomial logistic regression by plain gradient descent, in numpy."""

    name = "numpy softmax regression"

    def __init__(self, features: int = 64, classes: int = 10, lr: float = 0.5):
        self.w = np.zeros((features, classes), np.float32)
        self.b = np.zeros(classes, np.float32)
        self.lr = lr

    def _probabilities(self, x):
        z = x @ self.w + self.b
        z -= z.max(1, keepdims=True)
        p = np.exp(z)
        return p / p.sum(1, keepdims=True)

    def step(self, x, y) -> tuple:
        p = self._probabilities(x)
        n = len(y)
        loss = float(-np.log(p[np.arange(n), y] + 1e-12).mean())
        right = int((p.argmax(1) == y).sum())
        p[np.arange(n), y] -= 1
        self.w -= self.lr * (x.T @ p) / n
        self.b -= self.lr * p.sum(0) / n
        return loss, right

    def predict(self, x) -> np.ndarray:
        return (x @ self.w + self.b).argmax(1)


# -- the report ----------------------------------------------------------------------------
def counters(client) -> dict:
    """Cumulative counters over all workers; the report shows their change per epoch."""
    import dmdask

    total = dmdask.stats(client)["total"]
    return {"store_bytes": total["shared_store"]["bytes"], "store_reads": total["shared_store"]["requests"],
            "ram": total["ram"]["hits"], "ssd": total["ssd"]["hits"], "streamed": total["stream"]["hits"]}


def report(rows, dataset_bytes: int, samples: int) -> None:
    print()
    print("epoch  time(s)   loss  train acc  | shared store: KiB  x dataset  reads  "
          "| samples served: from RAM  from SSD  streamed")
    for r in rows:
        print(f"{r['epoch']:>5}  {r['seconds']:7.2f}  {r['loss']:5.3f}  {r['accuracy']:9.3f}  "
              f"|{r['store_bytes'] / 1024:18.1f}  {r['store_bytes'] / dataset_bytes:8.2f}x  {r['store_reads']:5d}  "
              f"|{r['ram']:>24}  {r['ssd']:8d}  {r['streamed']:8d}")
    epochs = len(rows)
    total = sum(r["store_bytes"] for r in rows)
    print()
    print(explanation(rows, samples))
    print(f"\nshared store over epochs 0-{epochs - 1}: {format_bytes(total)} = {total / dataset_bytes:.2f}x "
          f"the dataset (a loader without a cache reads {epochs}x)")
    if epochs > 1:
        later = np.mean([r["seconds"] for r in rows[1:]])
        print(f"epoch 0 (cold cache): {rows[0]['seconds']:.2f} s; "
              f"epochs 1-{epochs - 1}: {later:.2f} s on average")


def explanation(rows, samples: int) -> str:
    """What the table says, with the numbers of its epoch 0: the sentences about epoch 0
    quote that row, so they cannot disagree with it."""
    first = rows[0]
    cached = first["ram"] + first["ssd"]
    return textwrap.fill(f"""Every epoch serves each of the {samples} training samples once: "from RAM" and "from SSD" are
samples a worker took from its cache, "streamed" the ones it read from the shared store for
that request. The shared-store columns are what the workers read from the store: the bytes of
the PNG files and labels, and its reads (a whole block, or the samples of one block that a
request needs). In epoch 0 each sample is read from the store once: the blocks the cache has
room for are read whole as the ranks first ask for them and their {cached} samples served from
the cache ({first['ram']} from RAM, {first['ssd']} from SSD; a whole block also counts 8 bytes a
sample of file pointers, hence a little over 1.00x), and the {first['streamed']} samples it has
no room for are streamed. From epoch 1 on, only the samples the cache has no room for are read
from the store again.""", width=94)


def serve(client) -> None:
    print(f"\nserving the cluster until Ctrl-C; dashboard: {tiers_page(client.dashboard_link)}, "
          f"scheduler: {client.scheduler.address} (try `dmdask status {client.scheduler.address}`)")

    def stop(signum, frame):
        raise KeyboardInterrupt

    # Ctrl-C (even where the shell started us with SIGINT ignored) or a kill: close cleanly
    previous = {sig: signal.signal(sig, stop) for sig in (signal.SIGINT, signal.SIGTERM)}
    try:
        while True:
            time.sleep(1)
    except KeyboardInterrupt:
        print("closing the cluster")
    finally:
        for sig, handler in previous.items():
            signal.signal(sig, handler)


def _bytes(size: str) -> int:
    return int(parse_bytes(size)) if str(size).strip() not in ("0", "") else 0


def _shown(path: str) -> str:
    """`path` relative to the current folder when it is below it."""
    relative = os.path.relpath(path)
    return path if relative.startswith("..") else relative
