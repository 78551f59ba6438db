"""Megatron's indexed datasets: a `.bin` of token ids and its `.idx` (the MMIDIDX layout), named
by either file or by their common prefix, as Megatron's `--data-path` names them.

The `.idx` (small: 12 bytes a sequence) is read whole where the dataset is opened, once per
cluster; the `.bin` is read as a raw token file (`dmdask.source.tokens`: blocks of tokens, one
ranged read each). The samples are the tokens of the sequences laid end to end, as Megatron's
GPTDataset concatenates documents (field "tokens"); windows (`dmdask.Window`) may cross
document boundaries. `Spec(keys=["tokens", "document"])` adds each token's document (int64,
from doc_idx), from which a window's attention mask and positions within documents follow.

The `.idx` layout, all little-endian (Megatron-LM's documented `MMapIndexedDataset` index):

    magic      9 bytes   b"MMIDIDX\\x00\\x00"
    version    uint64    1
    dtype      uint8     code of the token ids' dtype (`DTYPES`)
    sequences  uint64    S
    documents  uint64    D (document i is sequences doc_idx[i] .. doc_idx[i+1]-1)
    sizes      int32[S]  tokens of each sequence
    pointers   int64[S]  byte offset of each sequence in the .bin
    doc_idx    int64[D]
"""
from __future__ import annotations

import dataclasses
import hashlib
import struct

import numpy as np

from ..errors import SourceError, SourceNotFoundError
from .registry import Format, Place
from ..fs.metadata import version_of
from .tokens import TokenSource, token_source

MAGIC = b"MMIDIDX\x00\x00"
HEADER = struct.Struct("<9sQBQQ")  # magic, version, dtype code, sequences, documents: 34 bytes
DTYPES = {1: "|u1", 2: "|i1", 3: "<i2", 4: "<i4", 5: "<i8", 8: "<u2"}  # Megatron's integer codes
SUFFIXES = (".bin", ".idx")


@dataclasses.dataclass(frozen=True)
class Index:
    """A parsed `.idx`: the token dtype, each sequence's size and byte offset, the document starts."""

    dtype: str
    sizes: np.ndarray
    pointers: np.ndarray
    doc_idx: np.ndarray

    @property
    def tokens(self) -> int:
        return int(self.sizes.sum(dtype=np.int64))

    def document_starts(self, where: str) -> np.ndarray:
        """The token offset where each document starts (document i: sequences doc_idx[i] ..
        doc_idx[i+1]-1), rising from 0; `SourceError` naming `where` unless doc_idx rises from 0
        to the number of sequences."""
        doc_idx, count = self.doc_idx, len(self.sizes)
        if len(doc_idx) < 2 or doc_idx[0] != 0 or doc_idx[-1] != count or (np.diff(doc_idx) < 0).any():
            raise SourceError(f"{where}: its document indices must rise from 0 to its {count} sequences "
                              f"(they are {doc_idx[:3].tolist()} .. {doc_idx[-1:].tolist()})")
        starts = np.concatenate([[0], np.cumsum(self.sizes, dtype=np.int64)])
        return starts[doc_idx[:-1]]


def parse_index(content: bytes, where: str) -> Index:
    """The index in `content` (the bytes of a `.idx`); `SourceError` naming `where` and what is
    wrong for anything but the layout above, or sequences not laid end to end in the `.bin`."""
    if len(content) < HEADER.size or not content.startswith(MAGIC):
        raise SourceError(f"{where} is not a Megatron index: it does not start with {MAGIC!r} (the MMIDIDX "
                          "header of a .idx)")
    _, version, code, sequences, documents = HEADER.unpack_from(content)
    if version != 1:
        raise SourceError(f"{where} is a Megatron index of version {version}; dmdask reads version 1")
    if code not in DTYPES:
        raise SourceError(f"{where} holds tokens of dtype code {code}; dmdask reads the integer codes "
                          f"{sorted(DTYPES)} ({', '.join(DTYPES.values())})")
    end = HEADER.size + 12 * sequences + 8 * documents
    if len(content) < end:
        raise SourceError(f"{where} is {len(content)} bytes but its header describes {sequences} sequences and "
                          f"{documents} document indices ({end} bytes): the index is truncated")
    at = HEADER.size
    sizes = np.frombuffer(content, "<i4", sequences, at)
    pointers = np.frombuffer(content, "<i8", sequences, at + 4 * sequences)
    doc_idx = np.frombuffer(content, "<i8", documents, at + 12 * sequences)
    dtype = DTYPES[code]
    if (sizes < 0).any():
        raise SourceError(f"{where} gives a sequence a negative size")
    ends = np.cumsum(sizes, dtype=np.int64) * np.dtype(dtype).itemsize
    if sequences and (pointers[0] != 0 or not np.array_equal(pointers[1:], ends[:-1])):
        raise SourceError(f"{where}: the sequences are not laid end to end in the .bin from its first byte "
                          "(each pointer the end of the sequence before); dmdask reads such .bin files only")
    return Index(dtype, sizes, pointers, doc_idx)


def claims(place: Place) -> bool:
    """Whether `place` names a Megatron dataset by its `.bin`, its `.idx` or (a path that is no
    file or folder) their prefix, and the `.idx` is there (one HEAD over HTTP); or names a
    `.bin` file (whose missing `.idx` `open_megatron` reports, pointing at `dmdask.Tokens`)."""
    if place.url is None or place.tokens is not None:
        return False
    if place.path.endswith(".bin") and place.exists:
        return True
    if not place.path.endswith(SUFFIXES) and (place.is_glob or place.exists):
        return False
    return place.has(prefix_of(place.path) + ".idx")


def prefix_of(path: str) -> str:
    """`path` without `.bin` or `.idx`."""
    return path[:-4] if path.endswith(SUFFIXES) else path


def url_of(place: Place, suffix: str) -> str:
    """The URL of the dataset's file with `suffix`, as the place's URL spells it."""
    return prefix_of(place.url) + suffix


def open_megatron(place: Place) -> TokenSource:
    prefix = prefix_of(place.path)
    where = url_of(place, ".idx")
    try:
        entry = place.fs.info(prefix + ".idx")
        content = place.fs.cat_file(prefix + ".idx")
    except FileNotFoundError as exc:
        raise SourceNotFoundError(f"Megatron index {where} does not exist (for a raw file of token ids with no index, "
                                  f"such as nanoGPT's train.bin, pass dmdask.Tokens({place.url!r}, dtype='uint16') "
                                  f"or the dtype it holds): {exc}") from exc
    index = parse_index(content, where)
    if not index.tokens:
        raise SourceError(f"Megatron dataset {url_of(place, '')} holds no tokens ({where} has "
                          f"{len(index.sizes)} sequences, all empty)")
    digest = hashlib.blake2b(content, digest_size=8).hexdigest()  # a changed index is another dataset
    return token_source(place, prefix + ".bin", index.dtype, "megatron", digest, version_of(entry),
                        url=url_of(place, ".bin"), tokens=index.tokens, documents=index.document_starts(where))


FORMAT = Format("megatron", claims=claims, open=open_megatron)
