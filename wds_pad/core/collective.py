"""Where wds_pad talks to torch.distributed: the process group of a job, when there is one.

The design names the places that need it: the seed broadcast (core/seed.py), topology
detection (core/topology.py), the cross-rank checks and merges of stream/ (the agreement
check, a loader's merged state) and a distributed index job (index/distributed.py,
index/jobstore.py). Only ``wds-pad index --distributed`` makes a process group itself
(cli/index.py); everything else uses the caller's. They reach torch.distributed through these
functions, so "is there a process group, and which" is one rule.

Invariants:
- torch is imported lazily and only when a group may exist: without ``torch`` imported
  no process group can have been made, so nothing is imported (a planner-only process
  never pays for torch);
- ``group=None`` means the default group, used only when it is initialised; a given
  group is used as given (its owner made it).
"""

from __future__ import annotations

import os
import secrets
import sys
from typing import Any

from ..errors import SeedError
from .seed import SEED_BITS, check_seed

__all__ = ["all_gather", "broadcast", "default_store", "dist_for", "group_size", "shared_seed"]


def dist_for(group: Any = None) -> Any:
    """``torch.distributed`` when ``group`` can be talked to, else None.

    A given ``group`` is always usable (the caller made it); without one, the default
    group is used when it is initialised.
    """
    if group is None and "torch" not in sys.modules:  # no group exists without torch imported
        return None
    try:
        import torch.distributed as dist
    except ImportError:  # pragma: no cover - torch is a dependency
        return None
    if not dist.is_available():  # pragma: no cover - a torch built without distributed
        return None
    if group is not None and not isinstance(group, dist.ProcessGroup):
        from ..errors import ConfigError

        raise ConfigError(f"group= must be a torch.distributed process group, got {type(group).__name__} "
                          f"{group!r:.60}; pass dist.new_group(ranks), a DeviceMesh's mesh.get_group(dim), "
                          "or None for the default group")
    return dist if group is not None or dist.is_initialized() else None


def group_size(group: Any = None) -> int:
    """The ranks of ``group`` (the default group when None); 1 without a process group."""
    dist = dist_for(group)
    return dist.get_world_size(group) if dist is not None and dist.is_initialized() else 1


def all_gather(obj: Any, group: Any = None) -> list[Any] | None:
    """Every rank's ``obj`` in rank order (one ``all_gather_object``); None when the job
    has no process group or only one rank, so the caller's own value is the whole answer."""
    if group_size(group) == 1:
        return None
    dist = dist_for(group)
    gathered: list[Any] = [None] * dist.get_world_size(group)
    dist.all_gather_object(gathered, obj, group=group)
    return gathered


def broadcast(obj: Any, group: Any = None) -> Any:
    """Rank 0's ``obj`` on every rank of ``group`` (one ``broadcast_object_list``); ``obj``
    itself without a process group."""
    if group_size(group) == 1:
        return obj
    dist = dist_for(group)
    box = [obj]
    src = dist.get_global_rank(group, 0) if group is not None else 0
    dist.broadcast_object_list(box, src=src, group=group)
    return box[0]


def default_store() -> Any:
    """The default process group's key-value store (a distributed index job's heartbeats
    and progress), which outlives a rank that stops answering collectives."""
    import torch.distributed as dist

    return dist.distributed_c10d._get_default_store()


def shared_seed(seed: int | None = None, group: Any = None) -> int:
    """Return the seed every rank of the job agrees on.

    Args:
        seed: a configured seed, returned as is (after validation).
        group: the process group to broadcast over (default: the default group).

    Returns:
        The configured seed; or, if none, a fresh 63-bit seed drawn from the OS on the
        group's rank 0 and broadcast, so that every rank returns the same value. In a
        single process without torch.distributed, just a fresh draw.

    Raises:
        SeedError: several processes (WORLD_SIZE > 1) but no initialised process group
            to agree on a drawn seed — configure a seed or initialise torch.distributed.
    """
    if seed is not None:
        return check_seed(seed)
    dist = dist_for(group)
    if dist is None:
        world = os.environ.get("WORLD_SIZE", "1")
        if world.strip() not in ("", "1"):
            raise SeedError(
                f"WORLD_SIZE={world} but torch.distributed is not initialised, so a drawn "
                "seed cannot be shared; pass seed=<int> or init_process_group() first"
            )
        return secrets.randbits(SEED_BITS)
    import torch

    backend = dist.get_backend(group)
    device = torch.device("cuda", torch.cuda.current_device()) if backend == "nccl" else torch.device("cpu")
    value = secrets.randbits(SEED_BITS) if dist.get_rank(group) == 0 else 0
    tensor = torch.tensor([value], dtype=torch.int64, device=device)
    src = dist.get_global_rank(group, 0) if group is not None else 0
    dist.broadcast(tensor, src=src, group=group)
    return int(tensor.item())

