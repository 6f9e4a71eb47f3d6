"""wds_pad: WebDataset shards for distributed training.

Bucketed, cyclically padded across data-parallel ranks, exactly resumable. Names that
need torch (the streaming datasets and the loader) are imported lazily, so that the
planner and the CLI start without importing torch.

The packages are the stages of the flow (docs/architecture.md): ``core`` (topology,
seed, plan; pure), ``io`` (filesystems, range reads), ``index`` (tar reading, buckets,
the index file), ``state`` (resume), ``stream`` (webdataset stages, the loaders) and
``cli``. Import public names from here, ``wds_pad``.
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
    WorkerStartError,
    WorkerStartWarning,
)
from . import _moved
from .core.dataset import Dataset, IdRange
from .core.locality import Locality, ShardMap
from .core.plan import Batch, BucketStats, Plan, iter_steps, plan_epoch
from .core.policy import Mode, PadTo, Policy
from .core.seed import derive_rng, shared_seed
from .core.topology import Topology

__version__ = "0.1.0"

# public name -> module that defines it (imported on first use)
_LAZY: dict[str, str] = {
    "BucketedWebDataset": "stream.dataset",
    "Equalize": "stream.shards",
    "Index": "index.format",
    "Loader": "stream.loader",
    "PlanSpec": "state.spec",
    "PlannedSource": "stream.stages",
    "Position": "state.cursor",
    "RangeReader": "io.ranges",
    "ReadOptions": "io.options",
    "ShardInfo": "index.format",
    "ShardLoader": "stream.shardstream",
    "ShardStream": "stream.shardstream",
    "SplitByNode": "stream.shards",
    "build_index": "index.build",
    "build_index_distributed": "index.distributed",
    "check_agreement": "stream.agreement",
    "equalize": "stream.shards",
    "fetch": "stream.fetch",
    "load_index": "index.format",
    "load_state_file": "state.files",
    "plan_batched": "stream.stages",
    "save_state_file": "state.files",
    "split_by_node": "stream.shards",
    "state_path": "state.files",
    "verify_index": "index.verify",
    "wrap_callable": "index.bucket_user",
    "write_index": "index.output",
}

__all__ = sorted(
    [
        "Batch",
        "BucketError",
        "BucketStats",
        "ConfigError",
        "Dataset",
        "IdRange",
        "Locality",
        "ShardMap",
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
        "WorkerStartError",
        "WorkerStartWarning",
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
