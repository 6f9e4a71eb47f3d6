"""Does a tar header name this sample? The identity check of the member-table fast path.

Streaming reads a sample's payloads straight from the offsets its index's member table
records (``stream.batchread``, ``stream.fetch``), without parsing the headers; before it
trusts them, it checks, per member, the 512-byte header right before the payload (the
member's own ustar header, whichever extended headers precede it) against the sample's
key. :func:`slice_sample` cuts one sample's bytes into ``{ext: payload}`` that way.

Invariants:
    * Plain ustar, PAX (per member or global; webdataset's TarWriter, ``tarfile``'s
      default, ``tar --format=posix``) and GNU headers: the name field begins with
      ``key + "."``; a name longer than the field (a PAX ``path`` record or a GNU
      ``././@LongLink`` holds the whole name) is checked on the field's ``NAME`` bytes,
      the whole name's first 100 bytes.
    * A ustar prefix (a long name split in two fields): ``prefix + "/" + name`` begins
      with ``key + "."`` (checked only when the first test fails).
    * A non-ASCII name that ``tarfile`` wrote as PAX: its name field holds the name with
      ``?`` for each character outside ASCII, and that is what is compared.
    * What it cannot see: the PAX or GNU long-name records themselves (not read: beyond
      100 bytes a name is not compared), the header's size field and checksum, and
      payload bytes. A header that does not name the sample is never read as it: the
      caller parses the sample's headers instead (``parse_sample``).
"""

from __future__ import annotations

from .members import key_bytes

__all__ = ["NAME", "names_sample", "slice_sample"]

NAME = 100  # bytes of a ustar header's name field


def names_sample(data: bytes, h: int, key: str) -> bool:
    """The rarer header forms of the identity check: a ustar prefix, or a name ``tarfile``
    wrote with ``?`` for its non-ASCII characters (see the module doc); the caller tests
    the common form first (``data.startswith(token, h)``, ``token`` being ``(key + ".")``'s
    first ``NAME`` bytes).

    Args:
        data: Bytes holding the header.
        h: Where the 512-byte header starts in ``data``.
        key: The sample's ``__key__``.

    Returns:
        Whether the header's name (prefix included) begins with ``key + "."``.
    """
    name = data[h : h + NAME].split(b"\0", 1)[0]
    prefix = data[h + 345 : h + 500].split(b"\0", 1)[0] if data[h + 257 : h + 262] == b"ustar" else b""
    full = prefix + b"/" + name if prefix else name
    truncated = not prefix and len(name) == NAME  # the whole name is in a PAX or GNU record
    for token in (key_bytes(key + "."), (key + ".").encode("ascii", "replace")):
        if full.startswith(token[:NAME] if truncated else token):
            return True
    return False


def slice_sample(data: bytes, key: str, members: tuple[bytes, list[str], list[int], list[int]]) -> dict[str, bytes] | None:
    """``{ext: payload}`` of one sample's bytes through its member table entry, or None
    when a header does not name the sample (the caller parses it on the exact path).

    Args:
        data: The sample's byte range.
        key: The sample's ``__key__``.
        members: Its name token (``(key + ".")[:NAME]``, bytes), its members' extensions,
            header offsets in ``data`` and payload sizes.
    """
    tok, exts, heads, sizes = members
    out = {}
    for e, h, n in zip(exts, heads, sizes):
        if not (data.startswith(tok, h) or names_sample(data, h, key)) or h + 512 + n > len(data):
            return None
        out[e] = data[h + 512 : h + 512 + n]
    return out
