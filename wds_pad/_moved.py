"""Old module paths (``wds_pad.plan``, ``wds_pad.dataset``, ...) keep importing.

Before the stage packages, every module sat directly under ``wds_pad``. Scripts that
import from those paths get the module at its new place, under its old name too, with a
DeprecationWarning that names the new path; a module that was split offers the names of
all its parts. Public names are best imported from ``wds_pad`` itself.
"""

from __future__ import annotations

import importlib
import importlib.abc
import importlib.util
import sys
import warnings
from types import ModuleType
from typing import Any, Sequence

#: old module (under wds_pad) -> its new place
MOVED = {
    "topology": "core.topology", "seed": "core.seed", "_permute": "core.permute", "plan": "core.plan",
    "indexer": "index.build", "tarscan": "index.tarscan", "_tarrows": "index.tarrows",
    "buckets": "index.buckets", "_imagesize": "index.imagesize", "_progress": "index.progress",
    "read": "io.ranges", "_urls": "io.urls", "_atomic": "io.atomic",
    "stages": "stream.stages", "dataset": "stream.dataset", "shards": "stream.shards",
    "shardstream": "stream.shardstream", "_loaderargs": "stream.loaderargs",
    "_elastic": "state.elastic", "_cli_index": "cli.index", "_demo": "cli.demo", "_synth": "cli.synth",
}

#: old module -> the further modules that took part of its names when it was split; the
#: old path offers the names of all of them, those of its MOVED module first
SPLIT = {
    "dataset": ("stream.loader", "stream.agreement"),
    "stages": ("stream.fetch", "state.spec", "state.cursor"),
    "shards": ("core.shardsplit",),
    "indexer": ("index.verify", "index.shardfile"),
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
        package, _, name = fullname.rpartition(".")
        if package != "wds_pad" or name not in MOVED:
            return None
        parts = [f"wds_pad.{p}" for p in SPLIT.get(name, ())]
        return importlib.util.spec_from_loader(fullname, _Alias(f"wds_pad.{MOVED[name]}", parts))


if not any(isinstance(f, _Finder) for f in sys.meta_path):
    sys.meta_path.append(_Finder())
