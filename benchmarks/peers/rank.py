"""One trainer rank of a peers run: `python -m benchmarks.peers.rank RUN_DIR RANK`.

It joins a gloo process group (as a torchrun job would: the peers read the world from it
or from RANK, WORLD_SIZE, LOCAL_RANK, LOCAL_WORLD_SIZE), then for each epoch: a barrier,
the loader's batches with an emulated training step (a sleep of batch / rate; none where
rate is 0, the loader-bound points), a barrier.
Its library is imported before the first barrier (`module.available()`), as a training
script imports at its top, and one full garbage collection follows, so that no loader's
epoch pays for the start-up's objects; the loader is built inside epoch 1's clock. Rank 0
then tells the runner the epoch ended (`epoch-E.done`) and waits for it to take its counts
(`epoch-E.ack`). Written: the timings (with each batch's arrival, seconds into the epoch)
to `rank-R.json` and the sample ids each epoch to `ids-R-E.npy`.
"""
from __future__ import annotations

import gc
import importlib
import json
import os
import sys
import time
import warnings

import numpy as np


def _handshake(run_dir: str, epoch: int, timeout: float = 120.0) -> None:
    open(os.path.join(run_dir, f"epoch-{epoch}.done"), "w").close()
    ack = os.path.join(run_dir, f"epoch-{epoch}.ack")
    deadline = time.monotonic() + timeout
    while not os.path.exists(ack) and time.monotonic() < deadline:
        time.sleep(0.01)


def main(run_dir: str, rank: int) -> None:
    import torch
    import torch.distributed as dist

    warnings.filterwarnings("ignore")
    torch.set_num_threads(1)
    with open(os.path.join(run_dir, "ctx.json")) as f:
        ctx = json.load(f)
    per_node = ctx["ranks_per_node"]
    ctx.update(rank=rank, node=rank // per_node, local_rank=rank % per_node,
               node_dir=ctx["node_dirs"][rank // per_node])
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{ctx['port']}", rank=rank,
                            world_size=ctx["world"])
    module = importlib.import_module(f"benchmarks.peers.{ctx['module']}")
    module.available()  # imports the loader's library, outside every epoch's clock
    # the process's first full collection of its start-up objects (0.1-0.2 s with torch imported,
    # on this machine) comes here, not in whichever loader's epoch first crosses the collector's threshold
    gc.collect()
    loader, epochs = None, []
    for epoch in range(ctx["epochs"]):
        dist.barrier()
        start, waited, samples = time.time(), 0.0, 0
        t = time.perf_counter()
        if loader is None:
            loader = module.Loader(ctx)
        it = iter(loader.epoch(epoch))
        setup = time.perf_counter() - t
        waited += setup
        ids, arrivals = [], []
        while True:
            t = time.perf_counter()
            try:
                batch = next(it)
            except StopIteration:
                waited += time.perf_counter() - t
                break
            waited += time.perf_counter() - t
            arrivals.append(round(time.time() - start, 4))
            got = loader.ids(batch)
            ids.append(got)
            samples += len(got)
            if ctx["rate"]:
                time.sleep(len(got) / ctx["rate"])
        end = time.time()
        del it
        np.save(os.path.join(run_dir, f"ids-{rank}-{epoch}.npy"),
                np.concatenate(ids) if ids else np.zeros(0, dtype=np.int64))
        epochs.append({"start": start, "end": end, "wait_s": waited, "setup_s": setup, "samples": samples,
                       "arrivals": arrivals})
        dist.barrier()
        if rank == 0:
            _handshake(run_dir, epoch)
    loader.close()
    with open(os.path.join(run_dir, f"rank-{rank}.json"), "w") as f:
        json.dump({"rank": rank, "pid": os.getpid(), "epochs": epochs}, f)
    dist.barrier()
    dist.destroy_process_group()


if __name__ == "__main__":
    main(sys.argv[1], int(sys.argv[2]))
    sys.stdout.flush()
    os._exit(0)  # some loaders leave non-daemon threads behind
