"""The DataLoader arguments our loaders accept or refuse, checked in one place.

Both ``Loader`` and ``ShardLoader`` decide batches and order themselves and restart
every worker at a saved position, so DataLoader's own batching, sampling, shuffling and
persistent workers would break exactness. ``Loader`` keeps its workers between epochs
itself (``persistent_workers=True``: it tells them each epoch's start), so it is given
that keyword back to act on.

The DataLoader is built only when iteration starts, and torch checks some arguments
with bare asserts deep inside its worker iterator (``prefetch_factor=0``), raises raw
ValueError/TypeError for others, or fails on an unknown keyword only then. So every
keyword is checked here, when the loader is constructed, and a wrong one is a
ConfigError that names the argument and the fix.
"""

from __future__ import annotations

import math
import multiprocessing
from typing import Any

from ..core.policy import check_flag
from ..errors import ConfigError

REFUSED = ("batch_size", "sampler", "batch_sampler", "shuffle", "persistent_workers", "drop_last")

# DataLoader keywords passed through (besides the ones refused above and the dataset and
# num_workers the loaders set themselves); a newer torch's own keywords are added below
PASSED = frozenset({
    "collate_fn", "pin_memory", "timeout", "worker_init_fn", "multiprocessing_context",
    "generator", "prefetch_factor", "pin_memory_device", "in_order",
})


def _passed() -> frozenset[str]:
    import inspect

    from torch.utils.data import DataLoader

    params = inspect.signature(DataLoader.__init__).parameters
    return PASSED | (frozenset(params) - {"self", "dataset", "num_workers"} - set(REFUSED))


def _is_int(value: Any) -> bool:
    return isinstance(value, int) and not isinstance(value, bool)


def check_loader_args(owner: str, num_workers: Any, kwargs: dict[str, Any], why: str,
                      keeps_workers: bool = False) -> dict[str, Any]:
    """Validate ``num_workers`` and the DataLoader keywords; drop the refused ones (set falsy).

    Args:
        owner: the loader's class name, for the messages.
        num_workers: the worker count given to the loader.
        kwargs: the DataLoader keywords given to the loader (modified in place).
        why: what to do instead of a refused keyword.
        keeps_workers: the loader keeps its workers between epochs itself: a
            ``persistent_workers`` bool is left in ``kwargs`` for it (with workers only).

    Returns:
        ``kwargs`` without the refused keywords.

    Raises:
        ConfigError: ``num_workers`` is not an int >= 0; a refused keyword is set
            (named with ``why``); an unknown keyword; ``prefetch_factor`` is not a
            positive int or is given without workers; ``timeout`` is not a finite
            number >= 0; ``multiprocessing_context`` is not a start method or context,
            or is given without workers; a flag that is not a bool; a hook that is not
            callable.
    """
    if not _is_int(num_workers) or num_workers < 0:
        raise ConfigError(
            f"{owner}: num_workers must be an int >= 0, got {num_workers!r}; "
            "use 0 to load in the main process"
        )
    if keeps_workers and "persistent_workers" in kwargs:
        _check_persistent(owner, num_workers, kwargs["persistent_workers"])
    for bad in REFUSED:
        if keeps_workers and bad == "persistent_workers":
            continue
        if kwargs.get(bad):
            raise ConfigError(f"{owner} does not take {bad}={kwargs[bad]!r}: {why}")
        kwargs.pop(bad, None)
    passed = _passed()
    unknown = sorted(set(kwargs) - passed - ({"persistent_workers"} if keeps_workers else set()))
    if unknown:
        raise ConfigError(
            f"{owner} got unknown DataLoader argument(s) {', '.join(unknown)}; "
            f"it passes on only {', '.join(sorted(passed))}"
        )
    _check_workers_args(owner, num_workers, kwargs)
    for flag in ("pin_memory", "in_order"):
        if flag in kwargs:
            kwargs[flag] = check_flag(f"{owner}: {flag}", kwargs[flag])
    check_callables(owner, {hook: kwargs.get(hook) for hook in ("collate_fn", "worker_init_fn")})
    if "pin_memory_device" in kwargs and not isinstance(kwargs["pin_memory_device"], str):
        raise ConfigError(f"{owner}: pin_memory_device must be a str, got {kwargs['pin_memory_device']!r}")
    return kwargs


def check_callables(owner: str, hooks: dict[str, Any]) -> None:
    """A ConfigError naming the first of ``hooks`` (name -> value) that is neither a
    callable nor None: refused when the object is made, not at the first batch."""
    for hook, fn in hooks.items():
        if fn is not None and not callable(fn):
            raise ConfigError(f"{owner}: {hook} must be a callable or None, got {type(fn).__name__} {fn!r}")


def _check_persistent(owner: str, num_workers: int, value: Any) -> None:
    value = check_flag(f"{owner}: persistent_workers", value)
    if value and num_workers == 0:
        raise ConfigError(
            f"{owner}: persistent_workers=True needs num_workers > 0 (got num_workers=0); "
            "pass num_workers >= 1, or leave persistent_workers out"
        )


def _check_workers_args(owner: str, num_workers: int, kwargs: dict[str, Any]) -> None:
    """prefetch_factor, timeout and multiprocessing_context, which torch checks late or by assert."""
    prefetch = kwargs.get("prefetch_factor")
    if prefetch is not None:
        if not _is_int(prefetch) or prefetch < 1:
            raise ConfigError(
                f"{owner}: prefetch_factor must be a positive int (batches loaded ahead per "
                f"worker), got {prefetch!r}; use e.g. prefetch_factor=2, or leave it out"
            )
        if num_workers == 0:
            raise ConfigError(
                f"{owner}: prefetch_factor={prefetch} needs num_workers > 0 (got num_workers=0); "
                "pass num_workers >= 1, or leave prefetch_factor out"
            )
    if "timeout" in kwargs:
        timeout = kwargs["timeout"]
        if (isinstance(timeout, bool) or not isinstance(timeout, (int, float))
                or not math.isfinite(timeout) or timeout < 0):
            raise ConfigError(
                f"{owner}: timeout must be a finite number of seconds >= 0 (0: wait forever), "
                f"got {timeout!r}"
            )
    context = kwargs.get("multiprocessing_context")
    if context is not None:
        if num_workers == 0:
            raise ConfigError(
                f"{owner}: multiprocessing_context={context!r} needs num_workers > 0 "
                "(got num_workers=0); pass num_workers >= 1, or leave it out"
            )
        methods = multiprocessing.get_all_start_methods()
        if isinstance(context, str):
            if context not in methods:
                raise ConfigError(
                    f"{owner}: multiprocessing_context {context!r} is not a start method here; "
                    f"use one of {', '.join(methods)}"
                )
        elif not isinstance(context, multiprocessing.context.BaseContext):
            raise ConfigError(
                f"{owner}: multiprocessing_context must be a start method name "
                f"({', '.join(methods)}) or a multiprocessing context, got "
                f"{type(context).__name__} {context!r}"
            )


def check_start_timeout(owner: str, value: Any) -> float:
    """``worker_start_timeout``: a finite number of seconds > 0."""
    if (isinstance(value, bool) or not isinstance(value, (int, float))
            or not math.isfinite(value) or value <= 0):
        raise ConfigError(
            f"{owner}: worker_start_timeout must be a finite number of seconds > 0 (how long a "
            f"forked DataLoader worker may take to start), got {value!r}; e.g. worker_start_timeout=30"
        )
    return float(value)
