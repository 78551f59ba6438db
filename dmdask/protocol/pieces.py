"""`Pieces`: many byte ranges of one buffer (rows of an arena), sent in order by the kernel
straight from that buffer: one `sendmsg` system call per `IOV_MAX` pieces with the iovec
array built by numpy (libc's `sendmsg` through ctypes, which releases the GIL), so no
Python object is made per piece and no byte is copied in user space. Linux (or any
LP64 POSIX system, where `struct iovec` is two 8-byte words)."""
from __future__ import annotations

import ctypes
import errno
import os
import socket
import ssl

import numpy as np

IOV_MAX = 1024  # buffers a sendmsg call takes (Linux's UIO_MAXIOV)


class _MsgHdr(ctypes.Structure):
    _fields_ = [("msg_name", ctypes.c_void_p), ("msg_namelen", ctypes.c_uint32),
                ("msg_iov", ctypes.c_void_p), ("msg_iovlen", ctypes.c_size_t),
                ("msg_control", ctypes.c_void_p), ("msg_controllen", ctypes.c_size_t),
                ("msg_flags", ctypes.c_int)]


_libc = ctypes.CDLL(None, use_errno=True)
_sendmsg = _libc.sendmsg
_sendmsg.argtypes = [ctypes.c_int, ctypes.POINTER(_MsgHdr), ctypes.c_int]
_sendmsg.restype = ctypes.c_ssize_t


def byte_view(array: np.ndarray) -> memoryview:
    """The bytes of a C-contiguous array as a flat, writable-if-the-array-is memoryview, for
    any dtype (the buffer protocol refuses datetime64 and timedelta64)."""
    return memoryview(array.reshape(-1).view(np.uint8))


class Pieces:
    """Byte ranges `starts[i] .. starts[i] + lengths[i]` of `buffer` (a contiguous array,
    kept referenced until sent), in that order."""

    def __init__(self, buffer: np.ndarray, starts: np.ndarray, lengths: np.ndarray):
        self.buffer = buffer
        self.starts = np.asarray(starts, dtype=np.uint64)
        self.lengths = np.asarray(lengths, dtype=np.uint64)
        self.nbytes = int(self.lengths.sum())

    def views(self) -> list[memoryview]:
        """The pieces as memoryviews (for a socket without `sendmsg`, such as TLS)."""
        flat = byte_view(self.buffer)
        return [flat[a:a + n] for a, n in zip(self.starts.tolist(), self.lengths.tolist())]


def send_pieces(sock: socket.socket, pieces: Pieces) -> None:
    """All of `pieces`, in order, on a blocking socket; OSError as `socket.sendall` raises."""
    if isinstance(sock, ssl.SSLSocket):
        for view in pieces.views():
            sock.sendall(view)
        return
    iov = np.empty((len(pieces.starts), 2), dtype=np.uint64)  # struct iovec: base address, length
    iov[:, 0] = pieces.starts + np.uint64(pieces.buffer.ctypes.data)
    iov[:, 1] = pieces.lengths
    header = _MsgHdr()
    fd, at = sock.fileno(), 0
    while at < len(iov):
        count = min(IOV_MAX, len(iov) - at)
        header.msg_iov, header.msg_iovlen = iov.ctypes.data + 16 * at, count
        sent = _sendmsg(fd, ctypes.byref(header), socket.MSG_NOSIGNAL)
        if sent < 0:
            code = ctypes.get_errno()
            if code == errno.EINTR:
                continue
            raise OSError(code, os.strerror(code))
        ends = np.cumsum(iov[at:at + count, 1])
        done = int(np.searchsorted(ends, sent, side="right"))  # pieces sent whole
        at += done
        rest = sent - (int(ends[done - 1]) if done else 0)
        if rest:  # part of the next piece went
            iov[at, 0] += np.uint64(rest)
            iov[at, 1] -= np.uint64(rest)
