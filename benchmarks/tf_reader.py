"""tf.data's parallel map over a folder of JPEGs, for scenario 7 (`benchmarks.loaders`).

Run as a script by TensorFlow's own interpreter (`.venv-tf`, which has TensorFlow and
not dmdask): `python benchmarks/tf_reader.py EPOCHS`, one PATH a line on its standard input. Each PATH is a local file
(a `dmdask mount`'s, read with `tf.io.read_file`) or an http:// URL (read with one GET
in a `tf.py_function`: the store directly). Each element is decoded (`tf.io.decode_jpeg`);
the dataset is shuffled each epoch and mapped with `num_parallel_calls=AUTOTUNE`.
Prints one JSON line: {"epochs_s": [...], "samples": N, "pixels": sum of decoded sizes}.
"""
from __future__ import annotations

import json
import os
import sys
import time
import urllib.request

os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "3")


def main(argv: list[str]) -> int:
    import tensorflow as tf

    epochs, paths = int(argv[0]), sys.stdin.read().split()
    over_http = paths[0].startswith("http://")

    def get(url):
        with urllib.request.urlopen(url.numpy().decode(), timeout=60) as reply:
            return reply.read()

    def load(path):
        data = tf.py_function(get, [path], tf.string) if over_http else tf.io.read_file(path)
        return tf.shape(tf.io.decode_jpeg(data, channels=3))

    dataset = (tf.data.Dataset.from_tensor_slices(paths).shuffle(len(paths), reshuffle_each_iteration=True)
               .map(load, num_parallel_calls=tf.data.AUTOTUNE).prefetch(tf.data.AUTOTUNE))
    times, samples, pixels = [], 0, 0
    for _ in range(epochs):
        started = time.perf_counter()
        for shape in dataset:
            samples += 1
            pixels += int(shape[0]) * int(shape[1])
        times.append(time.perf_counter() - started)
    print(json.dumps({"epochs_s": times, "samples": samples, "pixels": pixels}), flush=True)
    return 0


if __name__ == "__main__":
    raise SystemExit(main(sys.argv[1:]))
