"""wds_pad: WebDataset shards for distributed training.

Bucketed, cyclically padded across data-parallel ranks, exactly resumable. Names that
need torch (the streaming datasets and the loader) are imported lazily, so that the
planner and the CLI start without importing torch.

The packages are the stages of the flow (docs/architecture.md): ``core`` (topology,
seed, plan; pure), ``io`` (filesystems, range reads), ``tar`` (tar headers: scanning,
parsing), ``index`` (buckets, the index file), ``state`` (resume), ``stream``
(webdataset stages, the loaders) and ``cli``. Import public names from here, ``wds_pad``.
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
    SharedMemoryWarning,
    StaleShardError,
    StateError,
    StateMismatchError,
    TarFormatError,
    TopologyError,
    TopologyMismatchError,
    WdsPadError,
    WorkerError,
    WorkerStartError,
    WorkerStartWarning,
    WriteError,
)
from .core.budgets.budget import Budget, BudgetModel
from .core.dataset import Dataset, IdRange
from .core.local.locality import Locality, ShardMap
from .core.budgets.packing import Pack
from .core.planning.plan import Batch, BucketStats, Plan, iter_steps, plan_epoch
from .core.policy import Mode, PadTo, Policy
from .core.collective import shared_seed
from .core.sampleseed import sample_rng
from .core.seed import derive_rng
from .core.topology import Topology
from .version import __version__

# public name -> module that defines it (imported on first use)
_LAZY: dict[str, str] = {
    "BucketedWebDataset": "stream.dataset",
    "Equalize": "stream.shards",
    "Index": "index.record",
    "Loader": "stream.loader",
    "PlanSpec": "state.spec",
    "PlannedSource": "stream.stages",
    "Position": "state.cursor",
    "RangeReader": "io.ranges",
    "ReadOptions": "io.options",
    "ShardInfo": "index.record",
    "ShardLoader": "stream.shardstream",
    "ShardStream": "stream.shardstream",
    "SplitByNode": "stream.shards",
    "StallReport": "stream.stallreport",
    "StallReporter": "stream.stallreport",
    "StreamStats": "stream.stats",
    "build_index": "index.build",
    "build_index_distributed": "index.distributed",
    "check_agreement": "stream.agreement",
    "equalize": "stream.shards",
    "fetch": "stream.fetch",
    "load_index": "index.codec",
    "load_state_file": "state.files",
    "pack_collate": "stream.packcollate",
    "plan_batched": "stream.stages",
    "save_state_file": "state.files",
    "split_by_node": "stream.shards",
    "stall_report": "stream.stallreport",
    "state_path": "state.files",
    "uint8_tensors": "stream.views",
    "verify_index": "index.verify",
    "wrap_callable": "index.buckets.user",
    "write_index": "index.output",
}

# sorted, the lazy names included (tests/test_api.py checks both)
__all__ = [
    "Batch",
    "BucketError",
    "BucketStats",
    "BucketedWebDataset",
    "Budget",
    "BudgetModel",
    "ConfigError",
    "Dataset",
    "DroppedBucketWarning",
    "Equalize",
    "IdRange",
    "Index",
    "IndexFormatError",
    "Loader",
    "Locality",
    "Mode",
    "Pack",
    "PadTo",
    "Plan",
    "PlanSpec",
    "PlannedSource",
    "Policy",
    "Position",
    "RangeReader",
    "ReadError",
    "ReadOptions",
    "SeedError",
    "ShardError",
    "ShardInfo",
    "ShardLoader",
    "ShardMap",
    "ShardStream",
    "SharedMemoryWarning",
    "SplitByNode",
    "StaleShardError",
    "StallReport",
    "StallReporter",
    "StateError",
    "StateMismatchError",
    "StreamStats",
    "TarFormatError",
    "Topology",
    "TopologyError",
    "TopologyMismatchError",
    "WdsPadError",
    "WorkerError",
    "WorkerStartError",
    "WorkerStartWarning",
    "WriteError",
    "build_index",
    "build_index_distributed",
    "check_agreement",
    "derive_rng",
    "equalize",
    "fetch",
    "iter_steps",
    "load_index",
    "load_state_file",
    "pack_collate",
    "plan_batched",
    "plan_epoch",
    "sample_rng",
    "save_state_file",
    "shared_seed",
    "split_by_node",
    "stall_report",
    "state_path",
    "uint8_tensors",
    "verify_index",
    "wrap_callable",
    "write_index",
]


def __getattr__(name: str) -> Any:
    module = _LAZY.get(name)
    if module is None:
        raise AttributeError(f"module 'wds_pad' has no attribute {name!r}")
    value = getattr(importlib.import_module(f".{module}", __name__), name)
    globals()[name] = value
    return value


def __dir__() -> list[str]:
    return sorted(set(globals()) | set(_LAZY))
