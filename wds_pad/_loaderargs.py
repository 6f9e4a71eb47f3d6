"""The DataLoader arguments our loaders refuse, checked in one place.

Both ``Loader`` and ``ShardLoader`` decide batches and order themselves and restart
every worker at a saved position, so DataLoader's own batching, sampling, shuffling and
persistent workers would break exactness.
"""

from __future__ import annotations

from typing import Any

from .errors import ConfigError

REFUSED = ("batch_size", "sampler", "batch_sampler", "shuffle", "persistent_workers")


def check_loader_args(owner: str, num_workers: Any, kwargs: dict[str, Any], why: str) -> dict[str, Any]:
    """Validate ``num_workers`` and drop the refused DataLoader keywords (set falsy).

    Raises:
        ConfigError: a negative or non-int ``num_workers``, or a refused keyword set,
            named with ``why`` (what to do instead).
    """
    if isinstance(num_workers, bool) or not isinstance(num_workers, int) or num_workers < 0:
        raise ConfigError(f"num_workers must be an int >= 0, got {num_workers!r}")
    for bad in REFUSED:
        if kwargs.get(bad):
            raise ConfigError(f"{owner} does not take {bad}={kwargs[bad]!r}: {why}")
        kwargs.pop(bad, None)
    return kwargs
