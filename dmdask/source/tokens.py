"""Raw token files (`dmdask.Tokens(path, dtype)`): token ids of one integer dtype laid end to end,
as `numpy.memmap(path, dtype)` sees them (nanoGPT's `train.bin`). Each token is a sample of the
field "tokens"; a block is `block_len` consecutive tokens, read with one ranged read of their
bytes. Megatron's indexed datasets (`dmdask.source.megatron`) read their `.bin` the same way."""
from __future__ import annotations

import dataclasses

import numpy as np

from ..errors import SourceError, SourceNotFoundError, SpecError
from .base import DatasetInfo, Source, StoreReader, filesystem, options_json, protocol_of
from .registry import Format, Place

FIELD = "tokens"
DEFAULT_BLOCK_BYTES = 8 << 20  # a block of uint16 tokens: 4 Mi tokens, one ranged read
VERSION_FIELDS = ("mtime", "LastModified", "last_modified", "ETag", "etag")


@dataclasses.dataclass(frozen=True)
class TokenLayout:
    """Where a token file's blocks are: shared by all of its block readers."""

    url: str
    protocol: str
    options: str  # storage options as JSON
    path: str  # the file, as its filesystem names it
    dtype: str  # numpy dtype string of the token ids ("<u2")
    identity: str


class TokenSource(Source):
    """`num_tokens` tokens of `layout`'s file, in blocks of `block_len`."""

    def __init__(self, info: DatasetInfo, layout: TokenLayout):
        self.info, self.layout = info, layout

    def reader(self, k: int) -> TokenBlockReader:
        start, stop = self.info.block_range(k)
        return TokenBlockReader(self.layout, k, start, stop)


class TokenBlockReader(StoreReader):
    """Reads tokens start..stop-1 of the file: bytes start*itemsize .. stop*itemsize-1, one
    ranged read. A store that gives fewer bytes (a truncated file) is an error naming them."""

    def __init__(self, layout: TokenLayout, index: int, start: int, stop: int):
        self.itemsize = np.dtype(layout.dtype).itemsize
        super().__init__(layout.url, layout.identity, index, start, stop, (stop - start) * self.itemsize)
        self.layout, self.protocol, self.options = layout, layout.protocol, layout.options

    def _read(self) -> dict[str, np.ndarray]:
        first, last = self.start * self.itemsize, self.stop * self.itemsize
        content = filesystem(self.protocol, self.options).cat_file(self.layout.path, start=first, end=last)
        if len(content) != last - first:
            raise OSError(f"the store gave {len(content)} bytes for bytes {first}..{last - 1} of {self.url} "
                          f"({self.stop - self.start} tokens of {self.layout.dtype}): the file is shorter than "
                          "when it was opened")
        return {FIELD: np.frombuffer(content, dtype=self.layout.dtype)}


def version_of(entry: dict) -> dict:
    """The fields of a file's info that change when it is rewritten (its modification time, ETag)."""
    return {k: str(entry[k]) for k in VERSION_FIELDS if k in entry}


def token_source(place: Place, path: str, dtype: str, *described, url: str | None = None,
                 tokens: int | None = None) -> TokenSource:
    """The tokens of the file at `path` on `place.fs` as a dataset (field "tokens"): one `info`
    request. `described`: what else names the data (for the identity); `url`: the file's URL
    (default `place.url`); `tokens`: how many of its first tokens are the dataset (default:
    all). `SourceNotFoundError` if there is no such file, `SourceError` if it is empty, not a
    whole number of tokens, or shorter than `tokens`."""
    spec, url = place.spec, url or place.url
    if spec.keys is not None and tuple(spec.keys) != (FIELD,):
        raise SpecError("keys", f"None or [{FIELD!r}] (a token file has the one field {FIELD!r})", list(spec.keys))
    try:
        entry = place.fs.info(path)
    except FileNotFoundError as exc:
        raise SourceNotFoundError(f"token file {url} does not exist: {exc}") from exc
    size, itemsize = int(entry.get("size") or 0), np.dtype(dtype).itemsize
    if entry.get("type") == "directory" or size == 0:
        raise SourceError(f"token file {url} holds no tokens (it is {'a folder' if size else 'empty'})")
    if tokens is None and size % itemsize:
        raise SourceError(f"token file {url} is {size} bytes, not a whole number of {dtype} tokens "
                          f"({itemsize} bytes each): is the dtype right?")
    count = size // itemsize if tokens is None else tokens
    if count * itemsize > size or count <= 0:
        raise SourceError(f"token file {url} is {size} bytes, but its index describes {count} tokens of {dtype} "
                          f"({count * itemsize} bytes): the file is truncated, or not the index's")
    block_len = spec.block_size or max(1, DEFAULT_BLOCK_BYTES // itemsize)
    identity = place.identity("tokens", url, dtype, block_len, size, count, version_of(entry), *described)
    info = DatasetInfo(name=place.name, identity=identity, url=url, fields=(FIELD,),
                       num_samples=count, block_len=int(block_len), nbytes=count * itemsize)
    layout = TokenLayout(url, protocol_of(place.fs), options_json(place.options), path, dtype, identity)
    return TokenSource(info, layout)


def open_tokens(place: Place) -> TokenSource:
    return token_source(place, place.path, place.tokens.dtype)


FORMAT = Format("tokens", claims=lambda place: place.tokens is not None, open=open_tokens)
