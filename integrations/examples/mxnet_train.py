"""Train a small MXNet classifier on batches from a dmdask cluster: a Gluon loop or `Module.fit`.

    # in .venv-mx (make test builds it: MXNet 1.9.1, numpy 1.26.4)
    python integrations/examples/mxnet_train.py                  # Gluon, MXNetLoader
    python integrations/examples/mxnet_train.py --api module     # Module.fit, DmdaskDataIter
    # an existing cluster and dataset (arrays "x": features, "y": int class labels)
    python integrations/examples/mxnet_train.py --scheduler tcp://host:8786 --source s3://bucket/train.zarr

With --checkpoint PREFIX (Gluon) the parameters, the trainer state and the loader's
position are saved after every epoch and a later run resumes from them.
"""
from __future__ import annotations

import argparse
import os
import pickle
import tempfile
import time

import dmdask.integrations.mxnet  # noqa: F401  (first: restores numpy's `bool` alias for MXNet 1.9.1)
import distributed  # noqa: E402
import mxnet as mx  # noqa: E402
import numpy as np  # noqa: E402
from mxnet import autograd, gluon  # noqa: E402

import dmdask  # noqa: E402
from dmdask.testing.datasets import write_blobs  # noqa: E402
from dmdask.integrations.mxnet import DmdaskDataIter, MXNetLoader  # noqa: E402


def train_gluon(client, spec, classes: int, args) -> None:
    loader = MXNetLoader(client, spec)
    mx.random.seed(0)
    net = gluon.nn.Sequential()
    net.add(gluon.nn.Dense(64, activation="relu"), gluon.nn.Dense(classes))
    net.initialize(mx.init.Xavier())
    trainer = gluon.Trainer(net.collect_params(), "sgd", {"learning_rate": args.lr, "momentum": 0.9})
    loss_fn = gluon.loss.SoftmaxCrossEntropyLoss()

    if args.checkpoint and os.path.exists(args.checkpoint + ".loader"):
        net(mx.nd.zeros((1, spec_features(spec))))  # materialise the parameters before loading them
        net.load_parameters(args.checkpoint + ".params")
        trainer.load_states(args.checkpoint + ".states")
        with open(args.checkpoint + ".loader", "rb") as f:
            loader.load_state_dict(pickle.load(f))
        print(f"resumed at {loader.state_dict()}")

    print(f"{loader!r}: {len(loader)} batches per epoch")
    for epoch in range(loader.epoch, args.epochs):
        loader.set_epoch(epoch)  # the loader is there already; keeps a loaded mid-epoch position
        t0, losses, correct, seen = time.perf_counter(), [], 0, 0
        for batch in loader:
            with autograd.record():
                logits = net(batch["x"])
                loss = loss_fn(logits, batch["y"])
            loss.backward()
            trainer.step(batch["x"].shape[0])
            losses.append(float(loss.mean().asscalar()))
            correct += int((logits.argmax(axis=1).astype("int64") == batch["y"]).sum().asscalar())
            seen += batch["x"].shape[0]
        print(f"epoch {epoch}: loss {np.mean(losses):.4f}, accuracy {correct / max(seen, 1):.3f}, "
              f"{seen} samples, {time.perf_counter() - t0:.2f} s")
        if args.checkpoint:
            net.save_parameters(args.checkpoint + ".params")
            trainer.save_states(args.checkpoint + ".states")
            with open(args.checkpoint + ".loader", "wb") as f:
                pickle.dump(loader.state_dict(), f)  # {"epoch": epoch + 1, "iterator": None}
    loader.close()


def spec_features(spec) -> int:
    import zarr

    return zarr.open_group(spec.source, mode="r")["x"].shape[1]


def train_module(client, spec, classes: int, args) -> None:
    train = DmdaskDataIter(client, spec, data_names=("x",), label_names=("y",))
    x, y = mx.sym.var("x"), mx.sym.var("y")
    hidden = mx.sym.Activation(mx.sym.FullyConnected(x, num_hidden=64), act_type="relu")
    out = mx.sym.SoftmaxOutput(mx.sym.FullyConnected(hidden, num_hidden=classes),
                               label=mx.sym.cast(y, "float32"), name="softmax")
    mod = mx.mod.Module(out, data_names=("x",), label_names=("y",), context=mx.cpu())
    print(f"{train!r}: {len(train)} batches per epoch, provide_data={train.provide_data}")
    t0 = [time.perf_counter()]

    def epoch_end(epoch, *_):
        print(f"epoch {epoch}: {time.perf_counter() - t0[0]:.2f} s; iterator now at {train.state_dict()}")
        t0[0] = time.perf_counter()

    mod.fit(train, num_epoch=args.epochs, eval_metric=["acc", "ce"], optimizer="sgd", initializer=mx.init.Xavier(),
            optimizer_params={"learning_rate": args.lr, "momentum": 0.9}, epoch_end_callback=epoch_end)
    # score() resets the iterator and makes one more pass (the next epoch: every sample once)
    print("training-set metrics:", mod.score(train, ["acc", "ce"]))
    train.close()


def main(argv=None) -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--api", choices=("gluon", "module"), default="gluon")
    parser.add_argument("--scheduler", help="address of a cluster of dmdask workers (default: start a local one)")
    parser.add_argument("--source", help="Zarr v3 group with arrays x and y (default: a synthetic one)")
    parser.add_argument("--epochs", type=int, default=3)
    parser.add_argument("--batch-size", type=int, default=128)
    parser.add_argument("--lr", type=float, default=0.05)
    parser.add_argument("--ram", default="256 MiB", help="per-worker RAM tier of the local cluster")
    parser.add_argument("--checkpoint", help="path prefix of the Gluon checkpoint files (.params, .states, .loader)")
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
            source = os.path.abspath(args.checkpoint) + ".zarr"
        else:
            tmp = tempfile.TemporaryDirectory()
            source = os.path.join(tmp.name, "train.zarr")
        if not os.path.exists(source):
            write_blobs(source)
    try:
        import zarr

        classes = int(np.max(zarr.open_group(source, mode="r")["y"][:])) + 1
        spec = dmdask.Spec(source=source, batch_size=args.batch_size, keys=["x", "y"])
        (train_module if args.api == "module" else train_gluon)(client, spec, classes, args)
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
