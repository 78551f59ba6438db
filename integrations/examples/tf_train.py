"""Train a small Keras classifier with `model.fit` on batches from a dmdask cluster.

    # in .venv-tf (make test builds it): a local two-worker cluster and a synthetic dataset
    python integrations/examples/tf_train.py
    # an existing cluster and dataset (arrays "x": features, "y": int class labels)
    python integrations/examples/tf_train.py --scheduler tcp://host:8786 --source s3://bucket/train.zarr

Each `fit` epoch iterates the next dmdask epoch. A `tf.train.Checkpoint` holds the
model, the optimizer and the loader; it is written at the end of every epoch, and
--checkpoint DIR resumes from the latest one (`fit(initial_epoch=loader.epoch)`).
"""
from __future__ import annotations

import argparse
import os
import tempfile
import time
import warnings

os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "2")

import distributed  # noqa: E402
import numpy as np  # noqa: E402
import tensorflow as tf  # noqa: E402

import dmdask  # noqa: E402
from dmdask.testing.datasets import write_blobs  # noqa: E402
from dmdask.integrations.tensorflow import TFLoader  # noqa: E402


class EpochCheckpoint(tf.keras.callbacks.Callback):
    """Write the checkpoint (model, optimizer, loader position) after every epoch."""

    def __init__(self, manager: tf.train.CheckpointManager):
        super().__init__()
        self.manager = manager

    def on_epoch_end(self, epoch, logs=None):
        self.manager.save(checkpoint_number=epoch + 1)


class EpochTimer(tf.keras.callbacks.Callback):
    def __init__(self, loader: TFLoader):
        super().__init__()
        self.loader = loader

    def on_epoch_begin(self, epoch, logs=None):
        self.t0 = time.perf_counter()

    def on_epoch_end(self, epoch, logs=None):
        print(f"epoch {epoch}: loss {logs['loss']:.4f}, accuracy {logs['accuracy']:.3f}, "
              f"{time.perf_counter() - self.t0:.2f} s; loader now at {self.loader.state_dict()}")


def main(argv=None) -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--scheduler", help="address of a cluster of dmdask workers (default: start a local one)")
    parser.add_argument("--source", help="Zarr v3 group with arrays x and y (default: a synthetic one)")
    parser.add_argument("--epochs", type=int, default=3)
    parser.add_argument("--batch-size", type=int, default=128)
    parser.add_argument("--lr", type=float, default=0.05)
    parser.add_argument("--ram", default="256 MiB", help="per-worker RAM tier of the local cluster")
    parser.add_argument("--checkpoint", help="folder of tf.train checkpoints: written each epoch, resumed from")
    args = parser.parse_args(argv)

    cluster = tmp = None
    if args.scheduler:
        client = distributed.Client(args.scheduler)
    else:
        cluster = dmdask.LocalCluster(n_workers=2, ram=args.ram)
        client = distributed.Client(cluster)
    source = args.source
    if source is None:  # next to the checkpoint, so that a resumed run reads the same dataset
        if args.checkpoint:
            source = os.path.join(os.path.abspath(args.checkpoint), "train.zarr")
        else:
            tmp = tempfile.TemporaryDirectory()
            source = os.path.join(tmp.name, "train.zarr")
        if not os.path.exists(source):
            os.makedirs(os.path.dirname(source), exist_ok=True)
            write_blobs(source)

    try:
        import zarr

        g = zarr.open_group(source, mode="r")
        features, classes = g["x"].shape[1], int(np.max(g["y"][:])) + 1
        spec = dmdask.Spec(source=source, batch_size=args.batch_size, keys=["x", "y"])
        loader = TFLoader(client, spec)  # rank and world size from the strategy in scope, if any

        tf.keras.utils.set_random_seed(0)
        model = tf.keras.Sequential([tf.keras.Input((features,)), tf.keras.layers.Dense(64, activation="relu"),
                                     tf.keras.layers.Dense(classes)])
        optimizer = tf.keras.optimizers.SGD(args.lr, momentum=0.9)
        model.compile(optimizer=optimizer, metrics=["accuracy"],
                      loss=tf.keras.losses.SparseCategoricalCrossentropy(from_logits=True))

        callbacks = [EpochTimer(loader)]
        if args.checkpoint:
            ckpt = tf.train.Checkpoint(model=model, optimizer=optimizer, loader=loader)
            manager = tf.train.CheckpointManager(ckpt, args.checkpoint, max_to_keep=2)
            if manager.latest_checkpoint:
                ckpt.restore(manager.latest_checkpoint)  # the loader's state is restored right here
                print(f"resumed from {manager.latest_checkpoint}: {loader.state_dict()}")
            callbacks.append(EpochCheckpoint(manager))

        print(f"{loader!r}: {len(loader)} batches per epoch")
        if loader.epoch >= args.epochs:
            print("nothing left to train")
            return
        dataset = loader.dataset().map(lambda b: (b["x"], b["y"]))
        with warnings.catch_warnings():
            warnings.simplefilter("ignore", UserWarning)  # Keras: "ran out of data" at each epoch end
            model.fit(dataset, epochs=args.epochs, initial_epoch=loader.epoch, callbacks=callbacks, verbose=0)
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
