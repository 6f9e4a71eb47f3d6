"""A shard's bytes at absolute offsets: the read-ahead buffer under both tar drivers.

:class:`Reader` serves the bytes of a local file (``os.pread``), a seekable file object
or a forward-only stream through one method, ``at(off, n)``, which is short only at end
of file, so the entry readers in :mod:`.headers` see the same bytes in every mode.
"""

from __future__ import annotations

import os
import stat
from typing import BinaryIO

from ..errors import ShardError

_CHUNK = 1 << 20  # stream mode read size
WINDOW = 4096  # seek mode read size: a header plus a small payload (json) in one read


class Reader:
    """Bytes of a shard at absolute offsets, with a read-ahead buffer.

    ``at(off, n)`` is short only at end of file; ``eof`` is the file size once known
    (from the start in seek mode, when the stream runs dry in stream mode), else -1.
    The per-member loops read the buffer in place: ``buf`` holds the bytes from offset
    ``base``; ``fd`` is the descriptor of a regular local file in seek mode (``os.pread``
    reads it), else -1; ``file`` the file object (None: ``buf`` is all the bytes);
    ``seek_mode`` whether it seeks (else it reads forward only).
    """

    __slots__ = ("file", "fd", "buf", "base", "seek_mode", "url", "eof")

    def __init__(self, f: BinaryIO | None, url: str, seek: bool, data: bytes = b"") -> None:
        self.file, self.url, self.seek_mode = f, url, seek
        self.fd = -1
        self.buf, self.base, self.eof = data, 0, len(data) if f is None else -1
        if f is None or not seek:
            return
        try:
            fd = f.fileno()
            st = os.fstat(fd)
            if stat.S_ISREG(st.st_mode):
                self.fd, self.eof = fd, st.st_size
        except (AttributeError, OSError, ValueError):
            pass
        if self.fd < 0:
            self.eof = self._io(lambda: f.seek(0, os.SEEK_END), 0)

    def _io(self, call, offset: int):  # type: ignore[no-untyped-def]
        try:
            return call()
        except OSError as exc:
            raise ShardError(f"{self.url}: reading at byte offset {offset} failed: {exc}") from exc

    def at(self, off: int, n: int) -> bytes:
        rel = off - self.base
        if rel >= 0 and rel + n <= len(self.buf):
            return self.buf[rel : rel + n]
        if self.file is None:
            return self.buf[max(rel, 0) : rel + n] if rel < len(self.buf) else b""
        return self._fill_seek(off, n) if self.seek_mode else self._fill_stream(off, n)

    def _fill_seek(self, off: int, n: int) -> bytes:
        want = max(n, WINDOW)
        if self.fd >= 0:
            parts = [self._io(lambda: os.pread(self.fd, want, off), off)]
        else:
            self._io(lambda: self.file.seek(off), off)  # type: ignore[union-attr]
            parts = [self._io(lambda: self.file.read(want), off)]  # type: ignore[union-attr]
        got = len(parts[0])
        while parts[-1] and got < want and off + got < self.eof:  # short reads before EOF
            if self.fd >= 0:
                parts.append(self._io(lambda: os.pread(self.fd, want - got, off + got), off + got))
            else:
                parts.append(self._io(lambda: self.file.read(want - got), off + got))  # type: ignore[union-attr]
            got += len(parts[-1])
        self.buf, self.base = b"".join(parts) if len(parts) > 1 else parts[0], off
        return self.buf[:n]

    def _fill_stream(self, off: int, n: int) -> bytes:
        buf, base, read = self.buf, self.base, self.file.read  # type: ignore[union-attr]
        end = base + len(buf)
        if off < base:
            raise RuntimeError(f"stream reader asked to go back from {base} to {off}")
        if off < end:
            parts, base = [buf[off - base :]], off
        else:  # drop whole chunks until one reaches `off`; it becomes the buffer, uncopied
            parts = []
            while self.eof < 0:
                chunk = self._io(lambda: read(_CHUNK), end)
                if not chunk:
                    self.eof = end
                elif end + len(chunk) > off:
                    parts, base = [chunk], end
                    end += len(chunk)
                    break
                end += len(chunk)
            if not parts:
                self.buf, self.base = b"", end
                return b""
        have = end - off
        while have < n and self.eof < 0:
            chunk = self._io(lambda: read(max(_CHUNK, n - have)), end)
            if not chunk:
                self.eof = end
            parts.append(chunk)
            have += len(chunk)
            end += len(chunk)
        self.buf, self.base = b"".join(parts) if len(parts) > 1 else parts[0], base
        rel = off - base
        return self.buf[rel : rel + n]


class FdFile:
    """A file-like over a descriptor, for a :class:`Reader` in seek mode (reads use ``os.pread``)."""

    __slots__ = ("fd",)

    def __init__(self, fd: int) -> None:
        self.fd = fd

    def fileno(self) -> int:
        return self.fd
