"""Old module paths (``wds_pad.plan``, ``wds_pad.dataset``, ...) keep importing.

Before the stage packages, every module sat directly under ``wds_pad``. Scripts that
import from those paths get the module at its new place, under its old name too, with a
DeprecationWarning that names the new path. Public names are best imported from
``wds_pad`` itself.
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
    "read": "io.read", "_urls": "io.urls", "_atomic": "io.atomic",
    "stages": "stream.stages", "dataset": "stream.dataset", "shards": "stream.shards",
    "shardstream": "stream.shardstream", "_loaderargs": "stream.loaderargs",
    "_elastic": "state.elastic", "_cli_index": "cli.index", "_demo": "cli.demo", "_synth": "cli.synth",
}


class _Alias(importlib.abc.Loader):
    def __init__(self, target: str) -> None:
        self.target = target

    def create_module(self, spec: Any) -> ModuleType:
        warnings.warn(f"{spec.name} moved to {self.target}; import public names from wds_pad",
                      DeprecationWarning, stacklevel=3)
        return importlib.import_module(self.target)

    def exec_module(self, module: ModuleType) -> None:
        pass  # the target module is already executed


class _Finder(importlib.abc.MetaPathFinder):
    def find_spec(self, fullname: str, path: Sequence[str] | None, target: Any = None) -> Any:
        package, _, name = fullname.rpartition(".")
        if package != "wds_pad" or name not in MOVED:
            return None
        return importlib.util.spec_from_loader(fullname, _Alias(f"wds_pad.{MOVED[name]}"))


if not any(isinstance(f, _Finder) for f in sys.meta_path):
    sys.meta_path.append(_Finder())
