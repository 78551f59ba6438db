"""One training rank of an unmodified PyTorch pipeline that reads a class-folder dataset
through `dmdask::` URLs: an ImageFolder-like Dataset over fsspec, DistributedSampler,
DataLoader(num_workers=2). Run as a process by tests/test_transparent.py:

    python tests/transparent_loader.py SCHEDULER ROOT_URL RANK WORLD EPOCHS START_METHOD OUT.json

It checks every sample's bytes itself (`folder_sample` of the id in the file name) and
writes the ids each epoch delivered, and the number of wrong samples, to OUT.json.
"""
import json
import sys

import distributed
import fsspec
import torch.utils.data

import dmdask  # noqa: F401  (registers dmdask:: for processes that did not install the package)
from dmdask.testing.datasets import folder_sample

SIZES = {"min_size": 3000, "max_size": 90_000}  # of the files the test writes (some span two 64 KiB rows)


class FolderFiles(torch.utils.data.Dataset):
    """What torchvision's ImageFolder does, over any fsspec URL: class subfolders in
    sorted order, their files in sorted order; an item is (file id, class, bytes)."""

    def __init__(self, root: str):
        fs, path = fsspec.core.url_to_fs(root)
        classes = sorted(e["name"] for e in fs.ls(path, detail=True) if e["type"] == "directory")
        self.protocol = root.split("::", 1)[0] + "::" if "::" in root else ""
        self.samples = [(name, label) for label, folder in enumerate(classes)
                        for name in sorted(e["name"] for e in fs.ls(folder, detail=True) if e["type"] == "file")]

    def __len__(self):
        return len(self.samples)

    def __getitem__(self, i):
        name, label = self.samples[i]
        with fsspec.open(self.protocol + name, "rb") as f:
            data = f.read()
        return int(name.rsplit("s-", 1)[1].split(".")[0]), label, data


def keep(items):
    return items


def main(argv):
    scheduler, root, rank, world, epochs, method, out = argv
    rank, world, epochs = int(rank), int(world), int(epochs)
    per_epoch, wrong = [], 0
    with distributed.Client(scheduler):
        dataset = FolderFiles(root)
        sampler = torch.utils.data.distributed.DistributedSampler(dataset, num_replicas=world, rank=rank, seed=5)
        loader = torch.utils.data.DataLoader(dataset, batch_size=4, sampler=sampler, num_workers=2, collate_fn=keep,
                                             multiprocessing_context=method, persistent_workers=method != "fork")
        for epoch in range(epochs):
            sampler.set_epoch(epoch)
            ids = []
            for batch in loader:
                for sample_id, _, data in batch:
                    ids.append(sample_id)
                    wrong += data != folder_sample(sample_id, **SIZES)
            per_epoch.append(ids)
    with open(out, "w") as f:
        json.dump({"ids": per_epoch, "wrong": int(wrong), "samples": len(dataset)}, f)


if __name__ == "__main__":
    main(sys.argv[1:])
