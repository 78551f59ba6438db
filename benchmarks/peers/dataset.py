"""The peers' dataset: image-like samples, written once in each loader's own format.

Sample i is `size_i` bytes (uniform in 16-110 KB, seeded): its id as 8 little-endian
bytes, then random bytes (as incompressible as a JPEG). Its label is its class folder.
Every loader reads the id back from the sample's first 8 bytes, so duplicates and misses
are counted from what the trainer got, whatever the format.

Formats (each timed on its own, `convert()`):
- `files`: one file per sample in class folders (dmdask, DataLoader, Grain);
- `tar`: WebDataset shards written by `webdataset.ShardWriter`;
- `mds`: Mosaic shards written by `streaming.MDSWriter` (then put on the S3 server);
- `litdata`: LitData chunks written by `litdata.optimize` (then put on the S3 server).
"""
from __future__ import annotations

import os
import time
from typing import Dict, List

import numpy as np

CLASSES = 10
MIN_BYTES, MAX_BYTES = 16 * 1024, 110 * 1024


def sizes(n: int, seed: int = 0) -> np.ndarray:
    return np.random.default_rng([seed, 1]).integers(MIN_BYTES, MAX_BYTES + 1, n)


def label(i: int, n: int) -> int:
    return i // -(-n // CLASSES)


def sample(i: int, n: int, seed: int = 0, size: int = 0) -> bytes:
    """Sample i's bytes (its id first)."""
    size = size or int(sizes(n, seed)[i])
    body = np.random.default_rng([seed, 2, i]).integers(0, 256, size - 8, dtype=np.uint8).tobytes()
    return i.to_bytes(8, "little") + body


def sample_id(data) -> int:
    """The id a sample's bytes start with (bytes, or a uint8 array)."""
    head = bytes(data[:8]) if isinstance(data, (bytes, bytearray, memoryview)) else np.asarray(data[:8]).tobytes()
    return int.from_bytes(head, "little")


def write_files(root: str, n: int, seed: int = 0) -> List[str]:
    """`root/class-CCC/s-IIIIIIII.bin`: sorted paths are in id order (dmdask's sample ids)."""
    paths = []
    for i, size in enumerate(sizes(n, seed)):
        folder = os.path.join(root, f"class-{label(i, n):03d}")
        os.makedirs(folder, exist_ok=True)
        path = os.path.join(folder, f"s-{i:08d}.bin")
        with open(path, "wb") as f:
            f.write(sample(i, n, seed, int(size)))
        paths.append(path)
    return paths


def write_tar(root: str, n: int, shard_bytes: int, seed: int = 0) -> List[str]:
    """WebDataset shards `root/shard-NNNNNN.tar` of about `shard_bytes`: members KEY.bin, KEY.cls."""
    import webdataset as wds

    os.makedirs(root, exist_ok=True)
    with wds.ShardWriter(os.path.join(root, "shard-%06d.tar"), maxsize=shard_bytes, verbose=0) as sink:
        for i, size in enumerate(sizes(n, seed)):
            sink.write({"__key__": f"s-{i:08d}", "bin": sample(i, n, seed, int(size)), "cls": label(i, n)})
    return sorted(os.path.join(root, f) for f in os.listdir(root) if f.endswith(".tar"))


def write_mds(root: str, n: int, shard_bytes: int, seed: int = 0) -> List[str]:
    """Mosaic MDS shards (columns data: bytes, label: int) and their index.json."""
    from streaming import MDSWriter

    with MDSWriter(out=root, columns={"data": "bytes", "label": "int"}, size_limit=shard_bytes,
                   progress_bar=False) as out:
        for i, size in enumerate(sizes(n, seed)):
            out.write({"data": sample(i, n, seed, int(size)), "label": label(i, n)})
    return sorted(os.path.join(root, f) for f in os.listdir(root))


def _litdata_item(i_n_seed):
    i, n, seed = i_n_seed
    return {"data": sample(i, n, seed), "label": label(i, n)}


def write_litdata(root: str, n: int, shard_bytes: int, seed: int = 0) -> List[str]:
    """LitData chunks and index.json from `litdata.optimize` (one worker process)."""
    import litdata

    litdata.optimize(fn=_litdata_item, inputs=[(i, n, seed) for i in range(n)], output_dir=root,
                     chunk_bytes=shard_bytes, num_workers=1, mode="overwrite")
    return sorted(os.path.join(root, f) for f in os.listdir(root))


WRITERS = {"files": write_files, "tar": write_tar, "mds": write_mds, "litdata": write_litdata}


def convert(fmt: str, root: str, n: int, shard_bytes: int, seed: int = 0) -> Dict:
    """Write `fmt` under root/fmt; {"seconds", "files", "bytes"} or {"error": ...}."""
    started = time.perf_counter()
    try:
        args = (n, seed) if fmt == "files" else (n, shard_bytes, seed)
        paths = WRITERS[fmt](os.path.join(root, fmt), *args)
    except Exception as exc:  # noqa: BLE001 - a peer that cannot convert is reported, not fatal
        return {"error": f"{type(exc).__name__}: {exc}"}
    return {"seconds": time.perf_counter() - started, "files": len(paths),
            "bytes": sum(os.path.getsize(p) for p in paths if os.path.isfile(p))}
