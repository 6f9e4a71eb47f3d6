"""Old module paths (``wds_pad.plan``, ``wds_pad.index.tarscan``, ...) keep importing.

Before the stage packages, every module sat directly under ``wds_pad``; later, modules
moved between and within the packages (the tar layer out of ``index``, for one). Scripts
that import from those paths get the module at its new place, under its old name too,
with a DeprecationWarning that names the new path; a module that was split offers the
names of all its parts. Public names are best imported from ``wds_pad`` itself.

Invariants:
    * An old path (a key of ``MOVED``, dotted below ``wds_pad``) imports only when no
      module or package stands there now: the finder is asked last, after the real ones.
    * An old path that was not split is the new module itself (the same object).
"""

from __future__ import annotations

import importlib
import importlib.abc
import importlib.util
import sys
import warnings
from types import ModuleType
from typing import Any, Sequence

#: old module (its path under wds_pad, dotted) -> its new place
MOVED = {
    "topology": "core.topology", "seed": "core.seed", "_permute": "core.permute", "plan": "core.plan",
    "indexer": "index.build", "tarscan": "tar.scan", "_tarrows": "tar.lean",
    "buckets": "index.buckets", "_imagesize": "index.buckets.imagesize", "_progress": "index.progress",
    "read": "io.ranges", "_urls": "io.urls", "_atomic": "io.atomic",
    "stages": "stream.stages", "dataset": "stream.dataset", "shards": "stream.shards",
    "shardstream": "stream.shardstream", "_loaderargs": "stream.loaderargs",
    "_elastic": "state.elastic", "_cli_index": "cli.index", "_demo": "cli.demo", "_synth": "cli.synth",
    "index.tarentry": "tar.headers", "index.tarread": "tar.members", "index.tarscan": "tar.scan",
    "index.tarrows": "tar.lean", "index.tarcols": "tar.columns",
    "index.bucket_spec": "index.buckets.spec", "index.bucket_protocol": "index.buckets.protocol",
    "index.bucket_columns": "index.buckets.columns", "index.bucket_ratios": "index.buckets.ratios",
    "index.bucket_user": "index.buckets.user", "index.imagesize": "index.buckets.imagesize",
    "index.format": "index.record",
}

#: old module -> the further modules that took part of its names when it was split; the
#: old path offers the names of all of them, those of its MOVED module first
SPLIT = {
    "dataset": ("stream.loader", "stream.agreement"),
    "stages": ("stream.fetch", "state.spec", "state.cursor"),
    "shards": ("core.shardsplit",),
    "indexer": ("index.verify", "index.shardfile"),
    "index.format": ("index.layout", "index.codec", "index.merge", "index.rows"),
}


class _Alias(importlib.abc.Loader):
    def __init__(self, target: str, parts: Sequence[str] = ()) -> None:
        self.target = target
        self.parts = tuple(parts)

    def create_module(self, spec: Any) -> ModuleType:
        also = f" (and {', '.join(self.parts)})" if self.parts else ""
        warnings.warn(f"{spec.name} moved to {self.target}{also}; import public names from wds_pad",
                      DeprecationWarning, stacklevel=3)
        module = importlib.import_module(self.target)
        if not self.parts:
            return module
        # a split module: one namespace over its parts, as the old module had
        merged = ModuleType(spec.name, module.__doc__)
        names: set[str] = set()
        for part in (*[importlib.import_module(p) for p in reversed(self.parts)], module):
            merged.__dict__.update({k: v for k, v in vars(part).items() if not k.startswith("__")})
            names.update(getattr(part, "__all__", ()))
        merged.__all__ = sorted(names)  # type: ignore[attr-defined]
        return merged

    def exec_module(self, module: ModuleType) -> None:
        pass  # the target module is already executed


class _Finder(importlib.abc.MetaPathFinder):
    def find_spec(self, fullname: str, path: Sequence[str] | None, target: Any = None) -> Any:
        root, _, old = fullname.partition(".")  # "wds_pad.index.tarscan" -> "index.tarscan"
        if root != "wds_pad" or old not in MOVED:
            return None
        parts = [f"wds_pad.{p}" for p in SPLIT.get(old, ())]
        return importlib.util.spec_from_loader(fullname, _Alias(f"wds_pad.{MOVED[old]}", parts))


if not any(isinstance(f, _Finder) for f in sys.meta_path):
    sys.meta_path.append(_Finder())
