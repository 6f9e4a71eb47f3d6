"""The package face: ``__all__`` is sorted, complete and every name in it imports."""

from __future__ import annotations

import wds_pad


def test_all_is_a_sorted_list_without_repeats() -> None:
    assert isinstance(wds_pad.__all__, list)
    assert wds_pad.__all__ == sorted(wds_pad.__all__)
    assert len(set(wds_pad.__all__)) == len(wds_pad.__all__)


def test_every_name_in_all_imports() -> None:
    for name in wds_pad.__all__:
        assert getattr(wds_pad, name) is not None, name
    namespace: dict[str, object] = {}
    exec("from wds_pad import *", namespace)  # noqa: S102 - what a reader's star import gets
    assert set(wds_pad.__all__) <= set(namespace)


def test_all_lists_every_lazy_name() -> None:
    assert set(wds_pad._LAZY) <= set(wds_pad.__all__)
