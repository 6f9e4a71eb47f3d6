"""wds_pad: WebDataset shards for distributed training.

Bucketed, cyclically padded across data-parallel ranks, exactly resumable. Names that
need torch (the streaming datasets and the loader) are imported lazily, so that the
planner and the CLI start without importing torch.
"""

from __future__ import annotations

import importlib
from typing import Any

from .errors import (
    BucketError,
    ConfigError,
    DroppedBucketWarning,
    IndexFormatError,
    ReadError,
    SeedError,
    ShardError,
    StaleShardError,
    StateError,
    StateMismatchError,
    TarFormatError,
    TopologyError,
    TopologyMismatchError,
    WdsPadError,
)
from .plan import Batch, BucketStats, Dataset, Mode, PadTo, Plan, Policy, iter_steps, plan_epoch
from .seed import derive_rng, shared_seed
from .topology import Topology

__version__ = "0.1.0"

# public name -> module that defines it (imported on first use)
_LAZY: dict[str, str] = {
    "BucketedWebDataset": "dataset",
    "Equalize": "shards",
    "Index": "index",
    "Loader": "dataset",
    "PlanSpec": "stages",
    "PlannedSource": "stages",
    "RangeReader": "read",
    "ReadOptions": "read",
    "ShardInfo": "index",
    "ShardLoader": "shardstream",
    "ShardStream": "shardstream",
    "SplitByNode": "shards",
    "build_index": "indexer",
    "check_agreement": "dataset",
    "equalize": "shards",
    "fetch": "stages",
    "load_index": "index",
    "load_state_file": "state",
    "plan_batched": "stages",
    "save_state_file": "state",
    "split_by_node": "shards",
    "verify_index": "indexer",
    "write_index": "index",
}

__all__ = sorted(
    [
        "Batch",
        "BucketError",
        "BucketStats",
        "ConfigError",
        "Dataset",
        "DroppedBucketWarning",
        "IndexFormatError",
        "Mode",
        "PadTo",
        "Plan",
        "Policy",
        "ReadError",
        "SeedError",
        "ShardError",
        "StaleShardError",
        "StateError",
        "StateMismatchError",
        "TarFormatError",
        "Topology",
        "TopologyError",
        "TopologyMismatchError",
        "WdsPadError",
        "derive_rng",
        "iter_steps",
        "plan_epoch",
        "shared_seed",
    ]
    + list(_LAZY)
)


def __getattr__(name: str) -> Any:
    module = _LAZY.get(name)
    if module is None:
        raise AttributeError(f"module 'wds_pad' has no attribute {name!r}")
    value = getattr(importlib.import_module(f".{module}", __name__), name)
    globals()[name] = value
    return value


def __dir__() -> list[str]:
    return sorted(set(globals()) | set(_LAZY))
