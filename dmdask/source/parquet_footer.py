"""Parquet footers: read from the store (`read_footers`), and cut to some of their row
groups (`Footer.subset`) so that each block reader carries only its own."""
from __future__ import annotations

import struct
from collections.abc import Sequence

MAGIC = b"PAR1"


def read_footers(fs, files: list[str], sizes: list[int]) -> list:
    """Each file's footer bytes (two rounds of concurrent range reads), or a string saying
    why there is none."""
    out: list = [f"the file has {s} bytes, too few for a Parquet file (truncated?)" if s < 12 else None
                 for s in sizes]
    rest = [i for i, why in enumerate(out) if why is None]
    tails = fs.cat_ranges([files[i] for i in rest], [sizes[i] - 8 for i in rest], [sizes[i] for i in rest])
    want = []
    for i, tail in zip(rest, tails):
        if isinstance(tail, BaseException) or len(tail) != 8:
            out[i] = f"cannot read its last 8 bytes: {tail!r}"
            continue
        length = struct.unpack("<I", tail[:4])[0]
        if tail[4:] == b"PARE":
            out[i] = "its footer is encrypted, which dmdask does not read"
        elif tail[4:] != MAGIC:
            out[i] = "it does not end with the Parquet magic bytes PAR1 (truncated, or not a Parquet file)"
        elif length > sizes[i] - 12:
            out[i] = f"its footer length {length} exceeds the file's {sizes[i]} bytes (corrupt or truncated)"
        else:
            want.append((i, sizes[i] - 8 - length, sizes[i] - 8))
    data = fs.cat_ranges([files[i] for i, _, _ in want], [a for _, a, _ in want], [b for _, _, b in want])
    for (i, _, _), footer in zip(want, data):
        out[i] = f"cannot read its footer: {footer!r}" if isinstance(footer, BaseException) else footer
    return out


class Footer:
    """A Parquet footer (Thrift compact `FileMetaData`), cut so that the footer of some of
    its row groups can be made (`subset`): the same bytes, with only those row groups
    and their number of rows. Raises ValueError if the bytes are not such a struct."""

    def __init__(self, data: bytes):
        self.parts: list[bytes | None] = []  # raw bytes; None where the row groups go, b"" for num_rows
        self.row_groups: list[bytes] = []
        try:
            end = self._cut(memoryview(data))
        except IndexError:
            raise ValueError("the footer ends in the middle of a field") from None
        if end != len(data):
            raise ValueError(f"the footer's metadata ends at byte {end} of {len(data)}")
        if None not in self.parts or b"" not in self.parts:
            raise ValueError("the footer has no row groups or no number of rows")

    def _cut(self, buf) -> int:
        pos, last = 0, 0
        while True:
            start, head = pos, buf[pos]
            pos += 1
            if head == 0:
                self.parts.append(b"\0")
                return pos
            kind, delta = head & 15, head >> 4
            if delta:
                field = last + delta
            else:
                zigzag, pos = _varint(buf, pos)
                field = (zigzag >> 1) ^ -(zigzag & 1)
            last, value = field, pos
            if field == 4 and kind == 9:  # row_groups: list<RowGroup>
                size, element, pos = _list_head(buf, pos)
                if element != 12:
                    raise ValueError("the footer's row groups are not structs")
                for _ in range(size):
                    begin, pos = pos, _skip(buf, pos, 12)
                    self.row_groups.append(bytes(buf[begin:pos]))
                self.parts += [bytes(buf[start:value]), None]
            elif field == 3 and kind == 6:  # num_rows: i64
                pos = _skip(buf, pos, kind)
                self.parts += [bytes(buf[start:value]), b""]
            else:
                pos = _skip(buf, pos, kind)
                self.parts.append(bytes(buf[start:pos]))

    def subset(self, row_groups: Sequence[int], num_rows: int) -> bytes:
        out = bytearray()
        for part in self.parts:
            if part is None:
                n = len(row_groups)
                out += bytes([(n << 4) | 12]) if n < 15 else bytes([0xF0 | 12]) + _uvarint(n)
                for i in row_groups:
                    out += self.row_groups[i]
            elif part == b"":
                out += _uvarint((num_rows << 1) ^ (num_rows >> 63))
            else:
                out += part
        return bytes(out)


def framed(footer: bytes) -> bytes:
    """A footer as the tail of a Parquet file (what `pyarrow.parquet.read_metadata` parses)."""
    return MAGIC + footer + struct.pack("<I", len(footer)) + MAGIC


def _varint(buf, pos: int) -> tuple[int, int]:
    shift = value = 0
    while True:
        byte = buf[pos]
        pos += 1
        value |= (byte & 0x7F) << shift
        if not byte & 0x80:
            return value, pos
        shift += 7


def _uvarint(value: int) -> bytes:
    out = bytearray()
    while True:
        byte, value = value & 0x7F, value >> 7
        if not value:
            out.append(byte)
            return bytes(out)
        out.append(byte | 0x80)


def _list_head(buf, pos: int) -> tuple[int, int, int]:
    head = buf[pos]
    size, element, pos = head >> 4, head & 15, pos + 1
    if size == 15:
        size, pos = _varint(buf, pos)
    return size, element, pos


def _skip(buf, pos: int, kind: int, in_list: bool = False) -> int:
    """The position after a value of Thrift compact type `kind` at `pos`."""
    if kind in (1, 2):  # booleans: in the field header, a byte in a list
        return pos + 1 if in_list else pos
    if kind == 3:
        return pos + 1
    if kind in (4, 5, 6):
        return _varint(buf, pos)[1]
    if kind == 7:
        return pos + 8
    if kind == 8:
        size, pos = _varint(buf, pos)
        return pos + size
    if kind in (9, 10):
        size, element, pos = _list_head(buf, pos)
        for _ in range(size):
            pos = _skip(buf, pos, element, True)
        return pos
    if kind == 11:
        size, pos = _varint(buf, pos)
        if size:
            types, pos = buf[pos], pos + 1
            for _ in range(size):
                pos = _skip(buf, _skip(buf, pos, types >> 4, True), types & 15, True)
        return pos
    if kind == 12:
        while True:
            head, pos = buf[pos], pos + 1
            if head == 0:
                return pos
            if not head >> 4:
                pos = _varint(buf, pos)[1]
            pos = _skip(buf, pos, head & 15)
    raise ValueError(f"unknown Thrift type {kind} in the footer")

