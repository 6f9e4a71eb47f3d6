"""Collating a packed batch: B packs of token samples into (B, seq_len) model inputs.

Under a :class:`~wds_pad.core.budgets.packing.Pack` every sample of a batch carries ``__pack__``,
its pack's number in the batch (0 .. B - 1); :func:`pack_collate` returns the collation
function that lays each pack's samples end to end in one row of ``seq_len`` tokens.

Invariants:
- row b holds the tokens of the samples with ``__pack__ == b``, in batch order, then
  ``pad_id`` to ``seq_len`` (a sample longer than ``seq_len``, planned with
  ``oversize="alone"``, is cut to ``seq_len``);
- ``position_ids`` restart at 0 at every sample; ``segment_ids`` number the samples of a
  row from 0 (-1 on padding); ``loss_mask`` is True exactly on the tokens of real samples
  (not padded copies, not padding);
- ``cu_seqlens`` are the segment boundaries in the batch flattened to B x seq_len tokens
  (each row's padding tail a segment of its own), ``[0, ..., B * seq_len]``, what
  variable-length attention kernels take; ``max_seqlen`` their longest;
- a token member is a ``.npy`` array (bytes or decoded) or raw bytes of ``dtype``; a
  sample without ``__pack__`` or ``field`` is a ConfigError naming it.
"""

from __future__ import annotations

import io
from typing import Any, Callable

import numpy as np

from ..errors import ConfigError

__all__ = ["pack_collate"]


def _tokens(sample: dict[str, Any], field: str, dtype: np.dtype) -> np.ndarray:
    if field not in sample:
        raise ConfigError(f"pack_collate({field!r}): sample {sample.get('__key__')!r} has no member {field!r} "
                          f"(it has {', '.join(sorted(k for k in sample if not k.startswith('__')))})")
    value = sample[field]
    if isinstance(value, (bytes, bytearray, memoryview)):
        raw = bytes(value)
        if raw[:6] == b"\x93NUMPY":
            return np.load(io.BytesIO(raw)).reshape(-1)
        return np.frombuffer(raw, dtype=dtype)
    return np.asarray(value).reshape(-1)


def pack_collate(field: str, dtype: Any = "int32", seq_len: int | None = None, *, packs: int | None = None,
                 pad_id: int = 0, tensors: bool = True) -> Callable[[list[dict[str, Any]]], dict[str, Any]]:
    """The collation function of packed batches (``BucketedWebDataset(..., batch_size=Pack(...),
    collation_fn=pack_collate("tokens.npy", seq_len=L))``).

    Args:
        field: the member holding a sample's tokens (``"tokens.npy"``, ``"tokens.bin"``).
        dtype: the dtype of raw token bytes (``int32``, ``uint16``); ``.npy`` carries its own.
        seq_len: L, the pack's length (the Pack's ``seq_len``).
        packs: B, packs per batch (None: one more than the largest ``__pack__`` seen).
        pad_id: the token that fills a pack's tail.
        tensors: torch tensors (True) or numpy arrays.

    Returns:
        ``collate(samples) -> dict`` with ``input_ids`` (B, L) int64, ``position_ids``
        (B, L) int64, ``segment_ids`` (B, L) int64, ``loss_mask`` (B, L) bool,
        ``cu_seqlens`` int32, ``max_seqlen`` int, and ``__key__`` / ``__pad__`` /
        ``__pack__`` lists of the samples.

    Raises:
        ConfigError: ``seq_len`` missing or not an int >= 1.
    """
    if isinstance(seq_len, bool) or not isinstance(seq_len, int) or seq_len < 1:
        raise ConfigError(f"pack_collate: seq_len must be the Pack's seq_len, an int >= 1, got {seq_len!r}")
    dt = np.dtype(dtype)

    def collate(samples: list[dict[str, Any]]) -> dict[str, Any]:
        nums = []
        for s in samples:
            if "__pack__" not in s:
                raise ConfigError(f"pack_collate: sample {s.get('__key__')!r} has no '__pack__': plan the dataset "
                                  "with batch_size=wds_pad.Pack(...) and collate before any stage drops '__' keys")
            nums.append(int(s["__pack__"]))
        B = packs if packs is not None else max(nums, default=-1) + 1
        ids = np.full((B, seq_len), pad_id, np.int64)
        pos = np.zeros((B, seq_len), np.int64)
        seg = np.full((B, seq_len), -1, np.int64)
        mask = np.zeros((B, seq_len), bool)
        fill = np.zeros(B, np.int64)
        counts = np.zeros(B, np.int64)
        bounds: list[list[int]] = [[] for _ in range(B)]
        for s, b in zip(samples, nums):
            tok = _tokens(s, field, dt)[: seq_len - int(fill[b])]
            lo, n = int(fill[b]), int(tok.size)
            ids[b, lo:lo + n] = tok
            pos[b, lo:lo + n] = np.arange(n)
            seg[b, lo:lo + n] = counts[b]
            mask[b, lo:lo + n] = not s.get("__pad__", False)
            fill[b] += n
            counts[b] += 1
            bounds[b].append(n)
        cu = [0]
        for b in range(B):
            for n in bounds[b] + ([seq_len - int(fill[b])] if fill[b] < seq_len else []):
                cu.append(cu[-1] + n)
        cu_arr = np.asarray(cu, np.int32)
        out: dict[str, Any] = {"input_ids": ids, "position_ids": pos, "segment_ids": seg, "loss_mask": mask,
                               "cu_seqlens": cu_arr, "max_seqlen": int(np.diff(cu_arr).max(initial=0))}
        if tensors:
            import torch

            out = {k: torch.from_numpy(v) if isinstance(v, np.ndarray) else v for k, v in out.items()}
        out["__key__"] = [s.get("__key__") for s in samples]
        out["__pad__"] = [bool(s.get("__pad__", False)) for s in samples]
        out["__pack__"] = nums
        return out

    return collate
