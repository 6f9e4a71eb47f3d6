"""Members as uint8 tensors without a copy: what GPU decoders take.

``uint8_tensors("jpg", ...)`` is a per-sample stage (``.compose(...)`` or
``wds.DataPipeline``): each named member becomes a 1-D ``torch.uint8`` tensor over the
member's own memory, no byte copied. With ``zero_copy=True`` that memory is the batch's
buffer (a view of the buffer the DataLoader worker read the batch into); with ``bytes``
members it is the ``bytes`` object. Decoders that take encoded bytes as a uint8 tensor
(``torchvision.io.decode_jpeg``, on the CPU or with ``device="cuda"`` through nvJPEG)
take these as they are.

Invariants:
- a tensor shares the member's memory and keeps it alive; it is read-only by contract
  (the buffer is shared with the rest of the batch): write to a ``.clone()``;
- members not named, and ``__``-fields, pass unchanged; a named member a sample lacks
  is left lacking (the decoder, or ``to_tuple``, says which).
"""

from __future__ import annotations

import warnings
from typing import Any, Callable, Iterable, Iterator

import torch

from ..errors import ConfigError

__all__ = ["uint8_tensors"]


def _tensor(member: Any) -> torch.Tensor:
    with warnings.catch_warnings():  # read-only by contract (module doc): torch warns once that it is
        warnings.filterwarnings("ignore", message="The given buffer is not writable")
        return torch.frombuffer(member, dtype=torch.uint8) if len(member) else torch.empty(0, dtype=torch.uint8)


class _Uint8Tensors:
    """The configured stage (picklable into DataLoader workers)."""

    def __init__(self, exts: tuple[str, ...]) -> None:
        self.exts = exts

    def __call__(self, src: Iterable[dict[str, Any]]) -> Iterator[dict[str, Any]]:
        exts = self.exts
        for sample in src:
            out = dict(sample)
            for e in exts:
                m = out.get(e)
                if isinstance(m, (bytes, memoryview)):
                    out[e] = _tensor(m)
            yield out


def uint8_tensors(*exts: str) -> Callable[[Iterable[dict[str, Any]]], Iterator[dict[str, Any]]]:
    """A stage turning the members ``exts`` of each sample into 1-D uint8 tensors, no copy.

    Args:
        exts: member extensions, such as ``"jpg"``.

    Raises:
        ConfigError: no extension given, or one that is not a str.
    """
    if not exts or not all(isinstance(e, str) and e for e in exts):
        raise ConfigError(f"uint8_tensors() takes member extensions such as 'jpg', got {exts!r}")
    return _Uint8Tensors(tuple(exts))
