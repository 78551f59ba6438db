"""Scenario 11: GPUs fed from the cache (`python -m benchmarks run --only gpu`).

Images/s into a ResNet-50 (torchvision, random weights, mixed precision, channels-last,
SGD) training on one GPU, fed three ways:

- in GPU memory: batches made once on the device and reused (the ceiling);
- dmdask: `TorchLoader(client, spec, device="cuda:0")` over a warm cache of the same
  images (uint8, 3x224x224) in a 2-worker LocalCluster (pinned buffers, a copy stream,
  `device_prefetch` batches ahead);
- DataLoader from local files: one `.npy` per image, `num_workers` processes,
  `pin_memory=True`, `.to(device, non_blocking=True)`.

Goal: dmdask >= 0.9x the in-memory rate. Each feed runs `warmup` steps, then `steps`
timed steps (`torch.cuda.synchronize()` at both ends). Without CUDA (or torchvision) the
scenario records why and measures nothing: it has not run on a GPU yet.
"""
from __future__ import annotations

import os
import time

import numpy as np

from .common import workdir

PRESETS = {
    "tiny": {"images": 256, "batch": 32, "warmup": 2, "steps": 4, "loader_workers": 2, "device_prefetch": 2},
    "quick": {"images": 2048, "batch": 128, "warmup": 5, "steps": 30, "loader_workers": 8, "device_prefetch": 2},
    "full": {"images": 8192, "batch": 256, "warmup": 10, "steps": 100, "loader_workers": 12, "device_prefetch": 3},
}
SHAPE = (3, 224, 224)
GOAL = 0.9


def unavailable() -> str:
    """Why this scenario cannot run here ("" when it can)."""
    try:
        import torch
    except ImportError:
        return "torch is not installed"
    if not torch.cuda.is_available():
        return f"no CUDA here (torch {torch.__version__}, CUDA build: {torch.version.cuda})"
    try:
        import torchvision  # noqa: F401
    except ImportError:
        return "torchvision is not installed (pip install torchvision matching torch)"
    return ""


def run(preset: str) -> dict:
    cfg = dict(PRESETS[preset])
    why = unavailable()
    if why:
        return {"config": cfg, "skipped": why,
                "goals": [{"goal": f"dmdask >= {GOAL}x the in-GPU-memory rate", "met": False,
                           "measured": f"not run on a GPU yet ({why})"}]}
    import distributed
    import torch
    import torchvision

    import dmdask
    from dmdask.integrations.torch import TorchLoader

    device = torch.device("cuda:0")
    torch.backends.cudnn.benchmark = True
    rng = np.random.default_rng(0)
    n, batch = cfg["images"], cfg["batch"]
    images = rng.integers(0, 256, size=(n,) + SHAPE, dtype=np.uint8)
    labels = rng.integers(0, 1000, size=n).astype(np.int64)
    result = {"config": cfg, "gpu": torch.cuda.get_device_name(device), "torch": torch.__version__, "feeds": {}}

    model = torchvision.models.resnet50(weights=None).to(device, memory_format=torch.channels_last)
    step = _trainer(torch, model, device)

    with workdir("gpu") as root:
        # in GPU memory: the ceiling
        on_device = [(torch.from_numpy(images[i:i + batch]).to(device),
                      torch.from_numpy(labels[i:i + batch]).to(device)) for i in range(0, n - batch + 1, batch)]
        result["feeds"]["in_gpu_memory"] = _measure(torch, step, _cycle(on_device), cfg)

        # dmdask, warm cache
        import zarr
        path = os.path.join(root, "images.zarr")
        g = zarr.open_group(path, mode="w")
        g.create_array("x", shape=images.shape, chunks=(64,) + SHAPE, dtype="u1")[:] = images
        g.create_array("y", shape=labels.shape, chunks=(64,), dtype="i8")[:] = labels
        ram = int(images.nbytes * 0.6) + 2**28  # the dataset, split over two workers, with room
        with dmdask.LocalCluster(n_workers=2, ram=ram, ssd=0, threads_per_worker=2) as cluster, \
                distributed.Client(cluster) as client:
            spec = dmdask.Spec(source=path, batch_size=batch, drop_last=True)
            for _ in dmdask.batches(client, spec, epoch=0):  # fills the cache
                pass
            loader = TorchLoader(client, spec, device=device, device_prefetch=cfg["device_prefetch"])

            def dmdask_batches():
                epoch = 1
                while True:
                    loader.set_epoch(epoch)
                    for b in loader:
                        yield b["x"], b["y"]
                    epoch += 1

            result["feeds"]["dmdask"] = _measure(torch, step, dmdask_batches(), cfg)
            dmdask.release(client, spec)

        # DataLoader from local files
        folder = os.path.join(root, "files")
        os.makedirs(folder)
        for i in range(n):
            np.save(os.path.join(folder, f"{i:06d}.npy"), images[i])
        result["feeds"]["dataloader_files"] = _measure(torch, step, _dataloader(torch, folder, labels, cfg, device),
                                                       cfg)

    ceiling = result["feeds"]["in_gpu_memory"]["images_per_s"]
    share = result["feeds"]["dmdask"]["images_per_s"] / ceiling
    result["dmdask_over_in_memory"] = share
    result["goals"] = [{"goal": f"dmdask >= {GOAL}x the in-GPU-memory rate", "met": share >= GOAL,
                        "measured": f"{share:.2f}x ({result['feeds']['dmdask']['images_per_s']:,.0f} against "
                                    f"{ceiling:,.0f} images/s)"}]
    return result


def _trainer(torch, model, device):
    optimizer = torch.optim.SGD(model.parameters(), lr=0.01, momentum=0.9)
    scaler = torch.amp.GradScaler("cuda")
    loss_fn = torch.nn.CrossEntropyLoss()
    mean = torch.tensor([0.485, 0.456, 0.406], device=device).view(1, 3, 1, 1) * 255
    std = torch.tensor([0.229, 0.224, 0.225], device=device).view(1, 3, 1, 1) * 255

    def step(x, y):
        x = ((x.float() - mean) / std).contiguous(memory_format=torch.channels_last)
        with torch.autocast("cuda", dtype=torch.float16):
            loss = loss_fn(model(x), y)
        optimizer.zero_grad(set_to_none=True)
        scaler.scale(loss).backward()
        scaler.step(optimizer)
        scaler.update()

    return step


def _cycle(items):
    while True:
        yield from items


def _measure(torch, step, batches, cfg) -> dict:
    for _ in range(cfg["warmup"]):
        step(*next(batches))
    torch.cuda.synchronize()
    started, images = time.perf_counter(), 0
    for _ in range(cfg["steps"]):
        x, y = next(batches)
        step(x, y)
        images += len(x)
    torch.cuda.synchronize()
    seconds = time.perf_counter() - started
    return {"images": images, "seconds": seconds, "images_per_s": images / seconds}


class _Files:
    """A map-style dataset of one `.npy` per image (what `DataLoader` reads)."""

    def __init__(self, folder, labels):
        self.paths = sorted(os.path.join(folder, f) for f in os.listdir(folder))
        self.labels = labels

    def __len__(self):
        return len(self.paths)

    def __getitem__(self, i):
        return np.load(self.paths[i]), self.labels[i]


def _dataloader(torch, folder, labels, cfg, device):
    loader = torch.utils.data.DataLoader(_Files(folder, labels), batch_size=cfg["batch"], shuffle=True,
                                         num_workers=cfg["loader_workers"], pin_memory=True, drop_last=True,
                                         persistent_workers=True)
    while True:
        for x, y in loader:
            yield x.to(device, non_blocking=True), y.to(device, non_blocking=True)


def report(result: dict, plots_dir: str) -> str:
    cfg = result["config"]
    if "skipped" in result:
        return (f"Not run on a GPU yet: {result['skipped']}. On a machine with CUDA and torchvision, "
                "`python -m benchmarks run --only gpu` measures images/s into a ResNet-50 (random weights, mixed "
                "precision) fed by dmdask's cache against the same model fed from tensors already in GPU memory "
                "and against a DataLoader over local files.\n")
    names = {"in_gpu_memory": "tensors already in GPU memory", "dmdask": "dmdask TorchLoader(device=cuda:0)",
             "dataloader_files": f"DataLoader(num_workers={cfg['loader_workers']}) from local .npy files"}
    lines = [f"{result['gpu']}, torch {result['torch']}; ResNet-50, random weights, fp16 autocast, channels-last, "
             f"batch {cfg['batch']}, {cfg['steps']} timed steps after {cfg['warmup']}; {cfg['images']:,} uint8 "
             f"images of {'x'.join(map(str, SHAPE))}; dmdask from a warm 2-worker cache, device_prefetch "
             f"{cfg['device_prefetch']}.", "", "| fed from | images/s | x in-memory |", "|---|---:|---:|"]
    ceiling = result["feeds"]["in_gpu_memory"]["images_per_s"]
    for name, r in result["feeds"].items():
        lines.append(f"| {names[name]} | {r['images_per_s']:,.0f} | {r['images_per_s'] / ceiling:.2f} |")
    return "\n".join(lines) + "\n"
