"""The planner's rules: padding policies, modes, pad units and the limits every epoch obeys.

Pure and stateless: each function maps its arguments to a value or a ConfigError, never
to anything that depends on the process, the machine or the clock. Invariants:

- ``Policy``, ``Mode`` and ``PadTo`` are str Enums; a name outside them is a ConfigError
  listing the allowed values (``parse_enum``), never a bare ValueError or KeyError;
- the pad unit is one rule, ``PadTo.unit(dp_size, batch_size)``: dp_size * batch_size
  for ``batch``, dp_size for ``rank``;
- ``resolve_policy`` never returns ``AUTO``: it is cyclic for epoch-driven runs or
  explicit oversubscription, else drop (invariant 6: the same inputs resolve the same
  way for every epoch);
- a bucket's padded order is dealt round robin, one rule: dp_rank d's entry k is global
  position ``d + k * dp_size`` (``rank_position``), position p is rank ``p mod dp_size``'s
  entry ``p // dp_size`` (``position_rank``), and of ``length`` positions rank d holds
  ``ceil((length - d) / dp_size)`` (``rank_share``);
- ``padded_length(m, unit, ...)`` is ``m`` for ``none``, else a multiple of ``unit``:
  the next one up for ``cyclic``, the one below for ``drop``; a list shorter than one
  unit becomes 0 (dropped) unless cyclic with oversubscription fills it to one unit.
  It is only called for non-empty buckets (invariant 5);
- an epoch is an int in [0, MAX_EPOCH], and no bucket nor epoch plans more than
  MAX_PLANNED_ENTRIES entries, so every int64 position the planner computes is far
  from overflow; both are refused before anything is allocated.
"""

from __future__ import annotations

from enum import Enum
from typing import Any, Hashable

import numpy as np

from ..errors import ConfigError

__all__ = [
    "MAX_EPOCH",
    "MAX_PLANNED_ENTRIES",
    "Mode",
    "PadTo",
    "Policy",
    "check_bucket_size",
    "check_epoch",
    "check_planned_total",
    "check_positive",
    "padded_length",
    "parse_enum",
    "position_rank",
    "rank_position",
    "rank_share",
    "resolve_policy",
]


#: The largest epoch number accepted anywhere (planner, CLI, loaders, set_epoch). An epoch
#: is a count of passes over the data: 2**31 - 1 is far beyond any real run, fits every
#: int32/int64 field and state file, and refuses a step count or a timestamp passed by
#: mistake. Import it rather than repeating the number.
MAX_EPOCH = 2**31 - 1


#: The most entries (sample appearances, padded copies included) one epoch may plan,
#: summed over every bucket and dataset. 2**40 (about 1.1e12) is a thousand times the
#: largest index the planner is built for (10^9 samples), so real data never reaches it,
#: while every position, offset and cumulative sum the planner computes in int64
#: (``d + dp * k``, per-bucket bases, ...) stays 2**23 times below overflow. A plan above
#: it is a configuration mistake — a batch size or world size that makes one global step
#: (the pad unit every bucket is padded to) absurdly large, or absurd repeats — and is
#: refused before anything is allocated, instead of failing inside numpy.
MAX_PLANNED_ENTRIES = 2**40


def check_epoch(epoch: Any, what: str = "epoch") -> int:
    """``epoch`` as a Python int, or a ConfigError naming it as ``what``: not an int (a
    float, str or bool is never truncated or parsed), negative, or above MAX_EPOCH."""
    if isinstance(epoch, bool) or not isinstance(epoch, (int, np.integer)):
        raise ConfigError(
            f"{what} must be an int in [0, {MAX_EPOCH}], got {type(epoch).__name__} {epoch!r}; "
            "pass a whole number such as int(epoch)"
        )
    value = int(epoch)
    if not 0 <= value <= MAX_EPOCH:
        raise ConfigError(
            f"{what} must be in [0, MAX_EPOCH={MAX_EPOCH}], got {value}; an epoch counts passes "
            "over the data (pass the epoch number, not a step count or a timestamp)"
        )
    return value


def check_positive(name: str, value: Any, optional: bool = False) -> Any:
    """``value`` as an int >= 1 (an int or numpy integer, never a bool), or None when
    ``optional``; else a ConfigError naming ``name``."""
    if optional and value is None:
        return None
    if isinstance(value, bool) or not isinstance(value, (int, np.integer)) or value < 1:
        raise ConfigError(f"{name} must be an int >= 1{' or None' if optional else ''}, got {value!r}")
    return int(value)


def check_flag(name: str, value: Any) -> bool:
    """``value`` as a bool (``True``/``False``, or a numpy bool), or a ConfigError naming
    ``name``: a string is never parsed (``"false"`` is truthy), and an int is never taken
    for a flag, so a value from a config file that was not turned into a bool is refused."""
    if not isinstance(value, (bool, np.bool_)):
        raise ConfigError(f"{name} must be True or False, got {type(value).__name__} {value!r}; "
                          "pass a bool (a value read from a config file or the command line is a str: "
                          "compare it, e.g. value.lower() == 'true')")
    return bool(value)


class Policy(str, Enum):
    """How a bucket is made a multiple of the pad unit."""

    AUTO = "auto"
    CYCLIC = "cyclic"
    DROP = "drop"
    NONE = "none"


class Mode(str, Enum):
    """``epochs``: one epoch per plan, driven by set_epoch; ``steps``: endless epochs."""

    EPOCHS = "epochs"
    STEPS = "steps"


class PadTo(str, Enum):
    """The pad unit: ``batch`` = dp_size * batch_size (default), ``rank`` = dp_size."""

    BATCH = "batch"
    RANK = "rank"

    def unit(self, dp_size: int, batch_size: int) -> int:
        """The pad unit on ``dp_size`` DP ranks with ``batch_size`` samples per batch: every
        bucket's padded length is a multiple of it (one global step for ``batch``)."""
        return dp_size * batch_size if self is PadTo.BATCH else dp_size


def parse_enum(cls: type[Enum], value: Any, what: str) -> Any:
    """``value`` (a member or its value) as a member of ``cls``, or a ConfigError naming
    ``what`` and listing the allowed values: every mode the planner takes is parsed here."""
    try:
        return cls(value.value if isinstance(value, Enum) else value)
    except ValueError:
        allowed = ", ".join(m.value for m in cls)  # type: ignore[attr-defined]
        raise ConfigError(f"unknown {what} {value!r}; expected one of: {allowed}") from None


def resolve_policy(policy: Policy | str, mode: Mode | str, oversubscribe: bool) -> Policy:
    """The concrete policy: ``auto`` is cyclic for epochs or oversubscription, else drop."""
    policy = parse_enum(Policy, policy, "padding policy")
    mode = parse_enum(Mode, mode, "mode")
    if policy is Policy.AUTO:
        return Policy.CYCLIC if mode is Mode.EPOCHS or oversubscribe else Policy.DROP
    return policy


def padded_length(m: int, unit: int, policy: Policy, oversubscribe: bool) -> int:
    if policy is Policy.NONE:
        return m
    if m < unit:
        return unit if (policy is Policy.CYCLIC and oversubscribe) else 0
    if policy is Policy.CYCLIC:
        return -(-m // unit) * unit
    return (m // unit) * unit


def rank_position(d: Any, k: Any, dp: int) -> Any:
    """The global position of dp_rank ``d``'s entry ``k`` (ints or int64 arrays): the
    round-robin deal every planner splits a bucket's order by."""
    return d + k * dp


def position_rank(pos: Any, dp: int) -> tuple[Any, Any]:
    """(dp_rank, entry number) of global position ``pos``: the inverse of :func:`rank_position`."""
    return pos % dp, pos // dp


def rank_share(length: Any, dp: int, d: Any) -> Any:
    """How many of ``length`` global positions dp_rank ``d`` holds (0 when d >= length)."""
    return np.maximum(0, -(-(np.asarray(length, np.int64) - d) // dp))


def check_bucket_size(
    name: str, key: Hashable, n: int, passes: int, length: int, dp: int, bs: int, unit: int,
    oversubscribe: bool,
) -> None:
    """Refuse a bucket whose epoch (before or after padding) exceeds MAX_PLANNED_ENTRIES."""
    m = n * passes
    if m > MAX_PLANNED_ENTRIES:
        raise ConfigError(
            f"dataset {name!r} bucket {key!r} would hold {m} entries per epoch ({n} samples x "
            f"{passes} passes), above the planner's limit of MAX_PLANNED_ENTRIES = 2**40 = "
            f"{MAX_PLANNED_ENTRIES}; lower the dataset's repeats"
        )
    if length > MAX_PLANNED_ENTRIES:
        how = "filled cyclically (oversubscribe) to one global step of" if oversubscribe and m < unit else "padded to"
        raise ConfigError(
            f"dataset {name!r} bucket {key!r} ({m} entries) would be {how} {length} entries per "
            f"epoch (pad unit {unit} = {dp} DP ranks x batch {bs}), above the planner's limit of "
            f"MAX_PLANNED_ENTRIES = 2**40 = {MAX_PLANNED_ENTRIES}; lower the batch size or the world "
            "size, or turn oversubscribe off (oversubscribe=False, no --oversubscribe) so buckets "
            "smaller than one global step are dropped"
        )


def check_planned_total(planned: int, epoch: int, size: str, dp: int) -> None:
    """Refuse an epoch whose buckets together plan more than MAX_PLANNED_ENTRIES entries
    (``size``: the batch size or the budget, as the message names it)."""
    if planned > MAX_PLANNED_ENTRIES:
        raise ConfigError(
            f"epoch {epoch} would plan {planned} entries over all buckets and datasets, above the "
            f"planner's limit of MAX_PLANNED_ENTRIES = 2**40 = {MAX_PLANNED_ENTRIES}; lower repeats, "
            f"the batch size ({size}) or the world size ({dp} DP ranks), or turn oversubscribe off"
        )
