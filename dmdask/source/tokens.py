"""Raw token files (`dmdask.Tokens(path, dtype)`): token ids of one integer dtype laid end to end,
as `numpy.memmap(path, dtype)` sees them (nanoGPT's `train.bin`). Each token is a sample of the
field "tokens"; a block is `block_len` consecutive tokens, read with one ranged read of their
bytes. Megatron's indexed datasets (`dmdask.source.megatron`) read their `.bin` the same way,
and may give each token's document too (field "document", int64)."""
from __future__ import annotations

import dataclasses

import numpy as np

from ..errors import SourceError, SourceNotFoundError, SpecError
from ..fs.metadata import version_of
from .base import DatasetInfo, Source, StoreReader, filesystem, options_json, protocol_of
from .registry import Format, Place

FIELD = "tokens"
DOCUMENT = "document"  # each token's document (int64), where the source knows the documents
DEFAULT_BLOCK_BYTES = 8 << 20  # a block of uint16 tokens: 4 Mi tokens, one ranged read


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
    """The tokens of `layout`'s file, in blocks of `info.block_len`; with `documents` (the
    token offset where each document starts, rising from 0), field "document" too."""

    def __init__(self, info: DatasetInfo, layout: TokenLayout, documents: np.ndarray | None = None):
        self.info, self.layout, self.documents = info, layout, documents

    def reader(self, k: int) -> TokenBlockReader:
        start, stop = self.info.block_range(k)
        if DOCUMENT not in self.info.fields:
            return TokenBlockReader(self.layout, k, start, stop)
        first = int(np.searchsorted(self.documents, start, side="right")) - 1  # the document of token `start`
        end = int(np.searchsorted(self.documents, stop, side="left"))
        return TokenBlockReader(self.layout, k, start, stop, (first, self.documents[first + 1:end] - start))


class TokenBlockReader(StoreReader):
    """Reads tokens start..stop-1 of the file: bytes start*itemsize .. stop*itemsize-1, one
    ranged read. A store that gives fewer bytes (a truncated file) is an error naming them.
    documents: None, or (the document of token `start`, the offsets in the block where the
    next documents start): the block gives "document" too, each token's document."""

    def __init__(self, layout: TokenLayout, index: int, start: int, stop: int, documents: tuple | None = None):
        self.itemsize = np.dtype(layout.dtype).itemsize
        per_token = self.itemsize + (0 if documents is None else 8)
        super().__init__(layout.url, layout.identity, index, start, stop, (stop - start) * per_token)
        self.layout, self.protocol, self.options = layout, layout.protocol, layout.options
        self.documents = documents

    def _read(self) -> dict[str, np.ndarray]:
        first, last = self.start * self.itemsize, self.stop * self.itemsize
        content = filesystem(self.protocol, self.options).cat_file(self.layout.path, start=first, end=last)
        if len(content) != last - first:
            raise OSError(f"the store gave {len(content)} bytes for bytes {first}..{last - 1} of {self.url} "
                          f"({self.stop - self.start} tokens of {self.layout.dtype}): the file is shorter than "
                          "when it was opened")
        out = {FIELD: np.frombuffer(content, dtype=self.layout.dtype)}
        if self.documents is not None:
            first, starts = self.documents
            marks = np.zeros(self.stop - self.start, dtype=np.int64)
            np.add.at(marks, starts, 1)  # a document of no tokens starts where the next one does
            out[DOCUMENT] = first + np.cumsum(marks)
        return out


def token_source(place: Place, path: str, dtype: str, *described, url: str | None = None,
                 tokens: int | None = None, documents: np.ndarray | None = None) -> TokenSource:
    """The tokens of the file at `path` on `place.fs` as a dataset (field "tokens"): one `info`
    request. `described`: what else names the data (for the identity); `url`: the file's URL
    (default `place.url`); `tokens`: how many of its first tokens are the dataset (default:
    all); `documents`: where each document starts (see `TokenSource`), which lets
    `Spec(keys=["tokens", "document"])` ask for each token's document. `SourceNotFoundError` if
    there is no such file, `SourceError` if it is empty, not a whole number of tokens, or
    shorter than `tokens`."""
    spec, url = place.spec, url or place.url
    offered = (FIELD,) if documents is None else (FIELD, DOCUMENT)
    if spec.keys is not None and (not set(spec.keys) <= set(offered) or FIELD not in spec.keys):
        raise SpecError("keys", f"None or {list(offered)} with {FIELD!r} (the fields of this token source"
                        + ("; 'document' is given only when named" if documents is not None else "") + ")",
                        list(spec.keys))
    fields = tuple(sorted(spec.keys)) if spec.keys is not None else (FIELD,)
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
    identity = place.identity("tokens", url, dtype, block_len, size, count, version_of(entry), fields, *described)
    types = {FIELD: np.dtype(dtype).str, DOCUMENT: np.dtype(np.int64).str}  # as `TokenBlockReader._read` gives them
    info = DatasetInfo(name=place.name, identity=identity, url=url, fields=fields, num_samples=count,
                       block_len=int(block_len), nbytes=count * (itemsize + 8 * (DOCUMENT in fields)),
                       field_types=tuple((f, types[f], ()) for f in fields))
    layout = TokenLayout(url, protocol_of(place.fs), options_json(place.options), path, dtype, identity)
    return TokenSource(info, layout, documents)


def open_tokens(place: Place) -> TokenSource:
    return token_source(place, place.path, place.tokens.dtype)


FORMAT = Format("tokens", claims=lambda place: place.tokens is not None, open=open_tokens)
