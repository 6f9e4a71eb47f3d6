"""A batch of sample dicts that pickles at about memcpy cost (DataLoader workers -> trainer).

``SampleBatch`` is a ``list`` of sample dicts, the list ``BucketedWebDataset`` yields with
the default collation. Pickled (a DataLoader worker hands it to the main process), its
samples' ``bytes`` members travel as one buffer with their sizes, and the other values
(``__key__``, ``__url__``, ``__pad__``, ...) as one tuple per sample against a few shared
key layouts; unpickling rebuilds the same dicts, keys in the same order.

Invariants:
- ``pickle.loads(pickle.dumps(b)) == b`` and is a ``SampleBatch``, for any contents;
- a batch holding anything but dicts, or a member (a key not starting with ``__``) that
  is not exactly ``bytes`` (a decoded image, a tensor), pickles as a plain list does.
"""

from __future__ import annotations

from array import array
from operator import itemgetter
from typing import Any, Callable

__all__ = ["SampleBatch"]


def _getter(positions: list[int]) -> Callable[[Any], tuple[Any, ...]]:
    if len(positions) == 1:
        p = positions[0]
        return lambda v: (v[p],)
    if not positions:
        return lambda v: ()
    return itemgetter(*positions)


class SampleBatch(list):  # type: ignore[type-arg]
    """A list of sample dicts whose pickle packs the ``bytes`` members into one buffer."""

    __slots__ = ()

    def __reduce__(self) -> Any:
        packed = _pack(self)
        if packed is None:
            return (SampleBatch, (list(self),))
        return (_unpack, packed)


def _pack(samples: list[Any]) -> tuple[Any, ...] | None:
    layouts: dict[tuple[Any, ...], tuple[int, Any, Any]] = {}
    lids = array("H")
    metas: list[tuple[Any, ...]] = []
    chunks: list[bytes] = []
    for s in samples:
        if type(s) is not dict:
            return None
        keys = tuple(s)
        lay = layouts.get(keys)
        if lay is None:
            if len(layouts) >= 65535:
                return None
            meta = [i for i, k in enumerate(keys) if isinstance(k, str) and k.startswith("__")]
            members = [i for i in range(len(keys)) if i not in set(meta)]
            lay = layouts[keys] = (len(layouts), _getter(meta), _getter(members))
        lid, get_meta, get_members = lay
        values = tuple(s.values())
        mem = get_members(values)
        for v in mem:
            if type(v) is not bytes:
                return None
        lids.append(lid)
        metas.append(get_meta(values))
        chunks.extend(mem)
    sizes = array("q", map(len, chunks))
    return (list(layouts), lids.tobytes(), metas, sizes.tobytes(), b"".join(chunks))


def _unpack(layouts: list[tuple[Any, ...]], lids: bytes, metas: list[tuple[Any, ...]], sizes: bytes,
            buffer: bytes) -> SampleBatch:
    plans = []
    for keys in layouts:
        meta = [i for i, k in enumerate(keys) if isinstance(k, str) and k.startswith("__")]
        members = [i for i in range(len(keys)) if i not in set(meta)]
        prefix = meta == list(range(len(meta)))  # metadata first, then members: one zip
        order = None if prefix else [*meta, *members]
        plans.append((keys, len(members), order))
    size_list = array("q", sizes).tolist()
    out = SampleBatch()
    append = out.append
    pos = m = 0
    for lid, meta_values in zip(array("H", lids).tolist(), metas):
        keys, count, order = plans[lid]
        vals = list(meta_values)
        for size in size_list[m : m + count]:
            vals.append(buffer[pos : pos + size])
            pos += size
        m += count
        if order is None:
            append(dict(zip(keys, vals)))
        else:
            d = dict.fromkeys(keys)
            for i, v in zip(order, vals):
                d[keys[i]] = v
            append(d)
    return out
