"""A training process whose DataLoader workers (fork, made anew each epoch) read files
through `dmdask::` URLs from a manifest: the main process never reads through
`dmdask::` itself. Run as a process by tests/test_transparent_fork.py:

    python tests/transparent_manifest.py SCHEDULER STORE_URL EPOCHS BATCHES_FIRST OUT.json [ZARR]

BATCHES_FIRST=1: the main process iterates `dmdask.batches` over the Zarr array ZARR
first (its client, pools and threads exist when the loader forks). Writes the sha1 of
every file each epoch read, and the seconds each epoch took, to OUT.json. The main
process lists the store folder over HTTP before the loader forks and again after the
last epoch (both listings in OUT.json): forked workers must leave its HTTP connections
working.
"""
import hashlib
import json
import sys

import distributed
import fsspec
import torch.utils.data

import dmdask


class Manifest(torch.utils.data.Dataset):
    def __init__(self, urls):
        self.urls = urls

    def __len__(self):
        return len(self.urls)

    def __getitem__(self, i):
        with fsspec.open(self.urls[i], "rb") as f:
            return i, hashlib.sha1(f.read()).hexdigest()


def keep(items):
    return items


def main(argv):
    scheduler, store_url, epochs, batches_first, out = argv[:5]
    names = json.loads(sys.stdin.read())
    urls = [f"dmdask::{store_url}/{n}" for n in names]
    def listing():  # the instance held by fsspec's cache only, as a library's would be
        return sorted(fsspec.filesystem("http").ls(f"{store_url}/files", detail=False))

    before = listing()
    with distributed.Client(scheduler) as client:
        if batches_first == "1":
            spec = dmdask.Spec(source=argv[5], batch_size=16, shuffle=True, seed=0)
            assert sum(len(b["index"]) for b in dmdask.batches(client, spec, epoch=0)) > 0
        loader = torch.utils.data.DataLoader(Manifest(urls), batch_size=4, num_workers=2, collate_fn=keep,
                                             multiprocessing_context="fork", timeout=120)
        digests = []
        for _ in range(int(epochs)):
            got = {}
            for batch in loader:
                got.update(dict(batch))
            digests.append([got[i] for i in range(len(urls))])
    after = listing()
    with open(out, "w") as f:
        json.dump({"digests": digests, "listings": [before, after]}, f)


if __name__ == "__main__":
    main(sys.argv[1:])
