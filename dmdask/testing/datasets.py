"""Synthetic datasets whose every value tells which sample it came from, so that a batch
can be checked against the sample ids in its "index" field (tests, demo, benchmarks)."""
from __future__ import annotations

import io
import os
import tarfile
import warnings
import zlib

import numpy as np


def zarr_sample(ids: np.ndarray, sample_shape=(8,), dtype="float32") -> np.ndarray:
    """The "x" rows of `write_zarr` for the given sample ids."""
    ids = np.asarray(ids, dtype=np.int64)
    width = int(np.prod(sample_shape))
    values = (ids[:, None] * 7 + np.arange(width)[None, :]) % 251
    return values.reshape((len(ids),) + tuple(sample_shape)).astype(dtype)


def zarr_label(ids: np.ndarray, classes: int = 10) -> np.ndarray:
    return (np.asarray(ids, dtype=np.int64) * 3) % classes


def write_zarr(path: str, n: int, sample_shape=(8,), chunk: int = 64, dtype="float32",
               compressed: bool = True, classes: int = 10) -> str:
    """A Zarr v3 group with "x" (n, *sample_shape) and "label" (n,), chunked `chunk` samples
    along the first axis, with consolidated metadata."""
    import zarr

    group = zarr.open_group(path, mode="w")
    extra = {} if compressed else {"compressors": None}
    x = group.create_array("x", shape=(n,) + tuple(sample_shape), chunks=(chunk,) + tuple(sample_shape),
                           dtype=dtype, **extra)
    label = group.create_array("label", shape=(n,), chunks=(chunk,), dtype="int64", **extra)
    for start in range(0, n, chunk * 16):
        ids = np.arange(start, min(n, start + chunk * 16))
        x[start:start + len(ids)] = zarr_sample(ids, sample_shape, dtype)
        label[start:start + len(ids)] = zarr_label(ids, classes)
    _consolidate(path)
    return path


def _consolidate(path: str) -> None:
    import zarr

    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        zarr.consolidate_metadata(path)


def folder_sample(sample_id: int, min_size: int = 16, max_size: int = 2048) -> bytes:
    """The bytes of sample `sample_id` of `write_folder` (varying sizes)."""
    return _random_bytes(np.random.default_rng(sample_id), f"sample-{sample_id:08d}|", min_size, max_size)


def _random_bytes(rng, head: str, min_size: int, max_size: int) -> bytes:
    """`head` then random bytes, min_size..max_size bytes in all (at least `head`)."""
    size = int(rng.integers(min_size, max_size + 1))
    return head.encode() + rng.integers(0, 256, size=max(0, size - len(head)), dtype=np.uint8).tobytes()


def write_folder(path: str, classes: int = 3, per_class: int = 20, min_size: int = 16, max_size: int = 2048) -> str:
    """A folder of class subfolders `class-XX`, files `s-XXXXXXXX.bin`, one per sample: sample
    `i` (in dmdask's order) has label `i // per_class` and bytes `folder_sample(i)`."""
    for c in range(classes):
        folder = os.path.join(path, f"class-{c:02d}")
        os.makedirs(folder, exist_ok=True)
        for j in range(per_class):
            i = c * per_class + j
            with open(os.path.join(folder, f"s-{i:08d}.bin"), "wb") as f:
                f.write(folder_sample(i, min_size, max_size))
    return path


def write_blobs(path: str, n: int = 5000, features: int = 16, classes: int = 3) -> None:
    """Gaussian blobs, one per class: arrays "x" (n, features) float32 and "y" (n,) int64."""
    import zarr

    rng = np.random.default_rng(0)
    y = rng.integers(0, classes, size=n)
    centers = rng.normal(scale=0.6, size=(classes, features))
    x = (centers[y] + rng.normal(size=(n, features))).astype("f4")
    g = zarr.open_group(path, mode="w")
    g.create_array("x", shape=x.shape, chunks=(512, features), dtype="f4")
    g.create_array("y", shape=y.shape, chunks=(512,), dtype="i8")
    g["x"][:] = x
    g["y"][:] = y
    _consolidate(path)


def tar_key(sample_id: int) -> str:
    """The key (member names up to the first dot) of sample `sample_id` of `write_tar_shards`."""
    return f"s{sample_id:08d}"


def tar_member(sample_id: int, ext: str, min_size: int = 16, max_size: int = 2048) -> bytes:
    """The bytes of member `<key>.<ext>` of sample `sample_id` of `write_tar_shards`."""
    rng = np.random.default_rng([sample_id, zlib.crc32(ext.encode())])
    return _random_bytes(rng, f"{ext}-{sample_id:08d}|", min_size, max_size)


def write_tar_shards(path: str, shards: int = 3, per_shard: int = 20, exts=("cls", "jpg"), prefix: str = "shard-",
                     skip=(), min_size: int = 16, max_size: int = 2048) -> list:
    """WebDataset shards `<prefix>000000.tar`, ... in folder `path`. Shard s holds samples
    s*per_shard .. (s+1)*per_shard-1, in order; sample i is the members `tar_key(i).<ext>`
    for each of `exts` in that order, holding `tar_member(i, ext)`, except the (i, ext)
    pairs in `skip`. Returns the shard paths."""
    os.makedirs(path, exist_ok=True)
    skip = set(skip)
    paths = []
    for s in range(shards):
        name = os.path.join(path, f"{prefix}{s:06d}.tar")
        with tarfile.open(name, "w", format=tarfile.PAX_FORMAT) as tar:
            for i in range(s * per_shard, (s + 1) * per_shard):
                for ext in exts:
                    if (i, ext) in skip:
                        continue
                    data = tar_member(i, ext, min_size, max_size)
                    info = tarfile.TarInfo(f"{tar_key(i)}.{ext}")
                    info.size, info.mtime, info.mode = len(data), 0, 0o644
                    tar.addfile(info, io.BytesIO(data))
        paths.append(name)
    return paths


def parquet_columns(ids: np.ndarray, width: int = 8) -> dict:
    """The columns of `write_parquet` for the given sample ids, as dmdask returns them ("blob" a list)."""
    ids = np.asarray(ids, dtype=np.int64)
    return {"x": zarr_sample(ids, (width,)), "label": zarr_label(ids), "name": hdf5_names(ids),
            "blob": [folder_sample(i, 0, 48) for i in ids.tolist()]}


def write_parquet(folder: str, rows_per_file, row_group: int, width: int = 8, columns=None,
                  prefix: str = "part", **options) -> list:
    """Parquet files `{prefix}-00000.parquet`, ... in `folder`: file i holds the next
    `rows_per_file[i]` samples, in row groups of `row_group` rows; its columns are those of
    `parquet_columns` ("x" a fixed-size list column), or the names in `columns`. `options`
    go to `pyarrow.parquet.write_table`. Returns the paths."""
    import pyarrow as pa
    import pyarrow.parquet as pq

    os.makedirs(folder, exist_ok=True)
    paths, start = [], 0
    for i, rows in enumerate(rows_per_file):
        values = parquet_columns(np.arange(start, start + rows), width)
        arrays = {"x": pa.FixedSizeListArray.from_arrays(pa.array(values["x"].reshape(-1)), width),
                  "label": pa.array(values["label"]), "name": pa.array(values["name"], pa.string()),
                  "blob": pa.array(values["blob"], pa.binary())}
        table = pa.table({name: arrays[name] for name in (columns or arrays)})
        path = os.path.join(folder, f"{prefix}-{i:05d}.parquet")
        pq.write_table(table, path, row_group_size=row_group, **options)
        paths.append(path)
        start += rows
    return paths


def hdf5_names(ids: np.ndarray) -> list:
    """The "name" strings of `write_hdf5` for the given sample ids."""
    return [f"sample-{i}" for i in np.asarray(ids, dtype=np.int64).tolist()]


def write_hdf5(path: str, n: int, sample_shape=(8,), chunk=64, group: str = "", names: bool = True,
               compression=None) -> str:
    """An HDF5 file (or, with `group`, a group in it) with "x" (`zarr_sample`) in chunks of
    `chunk` rows, "label" (`zarr_label`) in chunks of `chunk // 2`, and with `names` "name"
    (`hdf5_names`); `chunk=None` stores them contiguous. Also "classes", of another length."""
    import h5py

    ids = np.arange(n)
    with h5py.File(path, "a") as f:
        node = f.require_group(group) if group else f
        x_chunks = None if chunk is None else (chunk,) + tuple(sample_shape)
        node.create_dataset("x", data=zarr_sample(ids, sample_shape), chunks=x_chunks, compression=compression)
        node.create_dataset("label", data=zarr_label(ids), chunks=None if chunk is None else (max(1, chunk // 2),),
                            compression=compression)
        if names:
            node.create_dataset("name", data=hdf5_names(ids), dtype=h5py.string_dtype(),
                                chunks=None if chunk is None else (chunk,))
        node.create_dataset("classes", data=np.arange(10))
    return path
