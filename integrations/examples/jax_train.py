"""Train a small JAX classifier on batches from a dmdask cluster, each batch sharded over local devices.

    # in .venv (make test builds it): a local two-worker cluster and a synthetic dataset
    python integrations/examples/jax_train.py
    # four CPU "devices" to see the sharding on a CPU-only machine
    python integrations/examples/jax_train.py --cpu-devices 4
    # an existing cluster and dataset (arrays "x": features, "y": int class labels)
    python integrations/examples/jax_train.py --scheduler tcp://host:8786 --source s3://bucket/train.zarr

With --checkpoint FILE the parameters, the optimizer state and the loader's position
are pickled after every epoch and a later run resumes from them.
"""
from __future__ import annotations

import argparse
import os
import pickle
import tempfile
import time

import distributed
import numpy as np

import dmdask
from dmdask.testing.datasets import write_blobs


def main(argv=None) -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--scheduler", help="address of a cluster of dmdask workers (default: start a local one)")
    parser.add_argument("--source", help="Zarr v3 group with arrays x and y (default: a synthetic one)")
    parser.add_argument("--epochs", type=int, default=3)
    parser.add_argument("--batch-size", type=int, default=128, help="rounded down to a multiple of the devices")
    parser.add_argument("--lr", type=float, default=0.05)
    parser.add_argument("--ram", default="256 MiB", help="per-worker RAM tier of the local cluster")
    parser.add_argument("--cpu-devices", type=int, help="split the CPU into this many JAX devices")
    parser.add_argument("--checkpoint", help="file to save to after each epoch and resume from if present")
    args = parser.parse_args(argv)

    import jax

    if args.cpu_devices:
        jax.config.update("jax_num_cpu_devices", args.cpu_devices)  # before JAX starts its backend
    import jax.numpy as jnp

    from dmdask.integrations.jax import JaxLoader

    cluster = tmp = None
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
        devices = len(jax.local_devices())
        batch_size = max(devices, args.batch_size // devices * devices)
        # sharding splits every batch evenly over the devices: full batches only
        spec = dmdask.Spec(source=source, batch_size=batch_size, keys=["x", "y"], drop_last=True)
        loader = JaxLoader(client, spec, sharding="local" if devices > 1 else None)

        k1, k2 = jax.random.split(jax.random.PRNGKey(0))
        params = {"w1": jax.random.normal(k1, (features, 64)) / np.sqrt(features), "b1": jnp.zeros(64),
                  "w2": jax.random.normal(k2, (64, classes)) / 8.0, "b2": jnp.zeros(classes)}
        velocity = jax.tree_util.tree_map(jnp.zeros_like, params)

        def logits_of(p, x):
            return jax.nn.relu(x @ p["w1"] + p["b1"]) @ p["w2"] + p["b2"]

        def loss_of(p, x, y):
            logits = logits_of(p, x)
            loss = -jnp.mean(jnp.take_along_axis(jax.nn.log_softmax(logits), y[:, None], axis=1))
            return loss, jnp.sum(jnp.argmax(logits, axis=1) == y)

        @jax.jit
        def step(p, v, x, y):
            (loss, correct), grads = jax.value_and_grad(loss_of, has_aux=True)(p, x, y)
            v = jax.tree_util.tree_map(lambda v_, g_: 0.9 * v_ + g_, v, grads)
            p = jax.tree_util.tree_map(lambda p_, v_: p_ - args.lr * v_, p, v)
            return p, v, loss, correct

        if args.checkpoint and os.path.exists(args.checkpoint):
            with open(args.checkpoint, "rb") as f:
                ckpt = pickle.load(f)
            params, velocity = ckpt["params"], ckpt["velocity"]
            loader.load_state_dict(ckpt["loader"])
            print(f"resumed at {loader.state_dict()}")

        print(f"{loader!r}: {len(loader)} batches per epoch on {devices} device(s)")
        for epoch in range(loader.epoch, args.epochs):
            loader.set_epoch(epoch)  # the loader is there already; keeps a loaded mid-epoch position
            t0, losses, correct, seen = time.perf_counter(), [], 0, 0
            for batch in loader:
                params, velocity, loss, right = step(params, velocity, batch["x"], batch["y"])
                losses.append(loss)
                correct += right
                seen += len(batch["index"])
            print(f"epoch {epoch}: loss {float(np.mean(jax.device_get(losses))):.4f}, "
                  f"accuracy {int(correct) / max(seen, 1):.3f}, {seen} samples, {time.perf_counter() - t0:.2f} s")
            if args.checkpoint:
                with open(args.checkpoint, "wb") as f:
                    pickle.dump({"params": jax.device_get(params), "velocity": jax.device_get(velocity),
                                 "loader": loader.state_dict()}, f)
        loader.close()
        if tmp is not None:  # a throw-away dataset: drop its blocks from the cluster's cache
            dmdask.release(client, spec)
    finally:
        client.close()
        if cluster is not None:
            cluster.close()
        if tmp is not None:
            tmp.cleanup()


if __name__ == "__main__":
    main()
