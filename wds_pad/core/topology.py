"""Topology: who this rank is in the job, and which ranks must get different data.

Invariants:
- ``world_size == dp_size * cp_size`` and ``rank < world_size``.
- Context-parallel (and any other data-replicating) peers share a ``dp_rank`` and get
  identical data; ranks with different ``dp_rank`` get disjoint data.
- By default context-parallel peers are consecutive ranks
  (``rank = dp_rank * cp_size + cp_rank``), as in a DeviceMesh whose innermost
  dimension is ``"cp"``.
- An explicit process group or mesh always wins over environment variables; a
  malformed environment is an error, never a quiet fallback to rank 0.

torch is imported lazily, only by :meth:`Topology.detect` and :meth:`Topology.from_mesh`,
so the planner and the CLI start without it.
"""

from __future__ import annotations

import math
import os
from dataclasses import asdict, dataclass
from typing import Any, Mapping, Sequence

from ..errors import TopologyError
from .collective import dist_for

__all__ = ["Topology"]


def _check_int(name: str, value: object, minimum: int) -> int:
    if isinstance(value, bool) or not isinstance(value, int):
        raise TopologyError(f"Topology.{name} must be an int, got {value!r}")
    if value < minimum:
        raise TopologyError(f"Topology.{name} must be >= {minimum}, got {value}")
    return value


@dataclass(frozen=True, repr=False)
class Topology:
    """A frozen record of this rank's place in the job.

    Args:
        world_size: number of processes in the job.
        rank: this process's rank, ``0 <= rank < world_size``.
        cp_size: ranks per data-parallel replica (context-parallel peers and any
            other peers that replicate data). Default: ``world_size // dp_size`` if
            ``dp_size`` is given, else 1.
        dp_size: effective data-parallel size. Default ``world_size // cp_size``.
        dp_rank: this rank's data-parallel index. Default ``rank // cp_size``.
        cp_rank: this rank's index among its replica peers. Default ``rank % cp_size``.
        local_world_size: processes per node (machine), as torchrun's ``LOCAL_WORLD_SIZE``;
            a rank's node is ``rank // local_world_size``, as torchrun assigns ranks.
            None: unknown (one node's worth of sharing is not planned for).

    Raises:
        TopologyError: for any impossible combination, with both values named.
    """

    world_size: int = 1
    rank: int = 0
    cp_size: int | None = None
    dp_size: int | None = None
    dp_rank: int | None = None
    cp_rank: int | None = None
    local_world_size: int | None = None

    def __post_init__(self) -> None:
        world = _check_int("world_size", self.world_size, 1)
        if self.local_world_size is not None:
            local = _check_int("local_world_size", self.local_world_size, 1)
            if local > world:
                raise TopologyError(
                    f"local_world_size {local} (processes per node) is more than world_size {world} (processes "
                    f"of the whole job): pass the processes each node runs (torchrun's --nproc-per-node), at most "
                    f"{world}")
            if world % local:
                raise TopologyError(
                    f"world_size {world} is not divisible by local_world_size {local}: every node must run "
                    "the same number of processes (torchrun's --nproc-per-node)")
        rank = _check_int("rank", self.rank, 0)
        if rank >= world:
            raise TopologyError(
                f"rank {rank} is out of range for world_size {world} (expected 0..{world - 1})"
            )
        cp, dp = self.cp_size, self.dp_size
        if cp is not None:
            _check_int("cp_size", cp, 1)
        if dp is not None:
            _check_int("dp_size", dp, 1)
        if cp is None:
            cp = world // dp if dp is not None else 1
            if dp is not None and world % dp:
                raise TopologyError(
                    f"world_size {world} is not divisible by dp_size {dp}; "
                    "each data-parallel replica must have the same number of ranks"
                )
        if world % cp:
            raise TopologyError(
                f"world_size {world} is not divisible by cp_size {cp}; "
                "choose a cp_size that divides the number of processes"
            )
        if dp is None:
            dp = world // cp
        if dp * cp != world:
            raise TopologyError(
                f"dp_size {dp} x cp_size {cp} = {dp * cp} does not equal world_size {world}"
            )
        dp_rank = self.dp_rank if self.dp_rank is not None else rank // cp
        cp_rank = self.cp_rank if self.cp_rank is not None else rank % cp
        _check_int("dp_rank", dp_rank, 0)
        _check_int("cp_rank", cp_rank, 0)
        if dp_rank >= dp:
            raise TopologyError(f"dp_rank {dp_rank} is out of range for dp_size {dp}")
        if cp_rank >= cp:
            raise TopologyError(f"cp_rank {cp_rank} is out of range for cp_size {cp}")
        object.__setattr__(self, "cp_size", cp)
        object.__setattr__(self, "dp_size", dp)
        object.__setattr__(self, "dp_rank", dp_rank)
        object.__setattr__(self, "cp_rank", cp_rank)

    def __repr__(self) -> str:
        shown = [f"{k}={v!r}" for k, v in asdict(self).items() if k != "local_world_size" or v is not None]
        return f"Topology({', '.join(shown)})"

    # -- conversions -------------------------------------------------------------------
    def to_dict(self) -> dict[str, int]:
        """The six layout fields as a JSON-safe dict (the form saved in loader states; the
        node layout is not part of it: a state resumes on any machines)."""
        return {k: int(v) for k, v in asdict(self).items() if k != "local_world_size"}

    # -- nodes -------------------------------------------------------------------------
    @property
    def node(self) -> int:
        """This rank's node: ``rank // local_world_size`` (0 when the node layout is unknown)."""
        return self.rank // self.local_world_size if self.local_world_size else 0

    @property
    def nodes(self) -> int:
        """Nodes of the job (1 when the node layout is unknown)."""
        return self.world_size // self.local_world_size if self.local_world_size else 1

    @property
    def node_ranks(self) -> int:
        """DP ranks whose data one node reads: ``local_world_size // cp_size``, or 1 when a
        data-parallel replica spans several nodes (each node then holds part of one DP rank).
        The one rule for it: node locality deals shards to groups of this many DP ranks.

        Raises:
            TopologyError: the node layout is unknown, or it does not line up with the CP
                layout (neither of local_world_size and cp_size divides the other).
        """
        local, cp = self.local_world_size, int(self.cp_size)  # type: ignore[arg-type]
        if not local:
            raise TopologyError(
                "this topology has no node layout (local_world_size, the processes per node): run under "
                "torchrun (LOCAL_WORLD_SIZE) or pass Topology(..., local_world_size=N)")
        if local % cp and cp % local:
            raise TopologyError(
                f"local_world_size {local} and cp_size {cp} do not divide one another, so a node does not hold "
                "whole data-parallel replicas; choose a cp_size that divides the processes per node (or a "
                "multiple of it)")
        return max(1, local // cp)

    def node_dp_ranks(self, node: int | None = None) -> list[int]:
        """The DP ranks whose data the ranks of ``node`` (default: this rank's) read: every
        ``rank // cp_size`` of the node's ranks (the default layout, CP peers consecutive).

        Raises:
            TopologyError: the node layout is unknown, or the DP layout is not the default
                one (``dp_rank`` / ``cp_rank`` given explicitly), so other ranks' DP ranks
                cannot be known here.
        """
        self.node_ranks  # noqa: B018 - the node layout is known and lines up with CP, or a TopologyError
        if self.dp_rank != self.rank // self.cp_size or self.cp_rank != self.rank % self.cp_size:  # type: ignore[operator]
            raise TopologyError(
                f"rank {self.rank} has dp_rank {self.dp_rank} and cp_rank {self.cp_rank}, not the default layout "
                f"(rank // cp_size, rank % cp_size): the DP ranks of a node cannot be known from it")
        n = self.node if node is None else int(node)
        first, last = n * self.local_world_size, (n + 1) * self.local_world_size
        return sorted({r // self.cp_size for r in range(first, last)})  # type: ignore[operator]

    @classmethod
    def from_dict(cls, data: Mapping[str, Any]) -> "Topology":
        """Rebuild a topology saved with :meth:`to_dict`."""
        keys = ("world_size", "rank", "cp_size", "dp_size", "dp_rank", "cp_rank")
        missing = [k for k in keys if k not in data]
        if missing:
            raise TopologyError(f"topology record lacks field(s) {', '.join(missing)}")
        return cls(**{k: data[k] for k in keys})

    def peers(self) -> list[int]:
        """Ranks sharing this rank's data (only meaningful for the default layout)."""
        base = self.dp_rank * self.cp_size  # type: ignore[operator]
        return list(range(base, base + self.cp_size))  # type: ignore[operator]

    # -- detection ---------------------------------------------------------------------
    @classmethod
    def detect(cls, *, group: Any = None, cp_size: int = 1, dp_size: int | None = None) -> "Topology":
        """Detect the topology of this process.

        Order: the ``group`` passed in; else an initialised default process group;
        else the ``RANK``/``WORLD_SIZE`` environment variables (as set by torchrun);
        else a single process. An explicit group always wins over the environment.

        Args:
            group: a torch.distributed process group whose ranks are the job.
            cp_size: ranks per data-parallel replica (consecutive ranks).
            dp_size: explicit effective data-parallel size (alternative to cp_size).

        Raises:
            TopologyError: malformed environment variables or impossible sizes.
        """
        sizes: dict[str, Any] = {"dp_size": dp_size} if dp_size is not None else {"cp_size": cp_size}
        if group is None:  # the machine's processes, as torchrun says; a given group may be a subset
            sizes["local_world_size"] = _local_world_size()
        dist = dist_for(group)
        if dist is not None:
            return cls(world_size=dist.get_world_size(group), rank=dist.get_rank(group), **sizes)
        env_rank, env_world = os.environ.get("RANK"), os.environ.get("WORLD_SIZE")
        if env_rank is None and env_world is None:
            return cls(world_size=1, rank=0, **sizes)
        if env_rank is None or env_world is None:
            raise TopologyError(
                f"RANK={env_rank!r} and WORLD_SIZE={env_world!r}: set both (torchrun does) "
                "or neither, or pass a process group"
            )
        try:
            rank, world = int(env_rank), int(env_world)
        except ValueError:
            raise TopologyError(
                f"RANK={env_rank!r} / WORLD_SIZE={env_world!r} are not integers; "
                "fix the launcher environment or pass a process group"
            ) from None
        return cls(world_size=world, rank=rank, **sizes)

    @classmethod
    def from_mesh(cls, mesh: Any, dp_dims: Sequence[str] = ("dp",)) -> "Topology":
        """Topology from a torch ``DeviceMesh`` given its data-parallel dimension names.

        Every other dimension (cp, tp, pp, ...) replicates data. ``dp_rank`` is the
        row-major index over ``dp_dims``; ``cp_rank`` over the remaining dimensions.

        Raises:
            TopologyError: a named dimension is not in the mesh, or this rank is not in it.
        """
        names = tuple(mesh.mesh_dim_names or ())
        unknown = [d for d in dp_dims if d not in names]
        if unknown:
            raise TopologyError(
                f"DeviceMesh has dimensions {names}, not {unknown}; pass dp_dims=<names of "
                "the data-parallel dimensions>"
            )
        coord = mesh.get_coordinate()
        if coord is None:
            raise TopologyError("this rank is not part of the DeviceMesh it was given")
        shape = tuple(int(s) for s in mesh.mesh.shape)
        dp_idx = [names.index(d) for d in dp_dims]
        rest = [i for i in range(len(names)) if i not in dp_idx]
        dp_size = math.prod(shape[i] for i in dp_idx)
        cp_size = math.prod(shape[i] for i in rest)
        dp_rank = _row_major([coord[i] for i in dp_idx], [shape[i] for i in dp_idx])
        cp_rank = _row_major([coord[i] for i in rest], [shape[i] for i in rest])
        dist = dist_for()  # a mesh object needs no process group to be read
        rank = dist.get_rank() if dist is not None else int(dp_rank * cp_size + cp_rank)
        return cls(world_size=dp_size * cp_size, rank=rank, cp_size=cp_size, dp_size=dp_size,
                   dp_rank=dp_rank, cp_rank=cp_rank)


def _local_world_size() -> int | None:
    """``LOCAL_WORLD_SIZE`` (set by torchrun) as an int, None when unset.

    Raises:
        TopologyError: set but not an int >= 1.
    """
    value = os.environ.get("LOCAL_WORLD_SIZE")
    if value is None:
        return None
    try:
        local = int(value)
    except ValueError:
        local = 0
    if local < 1:
        raise TopologyError(f"LOCAL_WORLD_SIZE={value!r} is not an int >= 1; fix the launcher environment, "
                            "or pass topology=Topology(..., local_world_size=N)")
    return local


def _row_major(coord: Sequence[int], shape: Sequence[int]) -> int:
    index = 0
    for c, s in zip(coord, shape):
        index = index * s + int(c)
    return index

