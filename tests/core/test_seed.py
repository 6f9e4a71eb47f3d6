"""Tests of the shared seed and the stable RNG derivation: canonical key encoding, golden
values (the same numbers on every machine and under any PYTHONHASHSEED), seed validation,
and a real broadcast over gloo in a 4-process job (default group and a subgroup)."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path
from typing import Any

import numpy as np
import pytest

from wds_pad import ConfigError, SeedError, derive_rng, shared_seed
from wds_pad.core.seed import SEED_BITS, derive_seed, encode_key, stable_digest

ROOT = Path(__file__).resolve().parents[2]


# -- stable derivation -------------------------------------------------------------------

def test_encode_key_is_type_tagged_and_unambiguous() -> None:
    parts = [None, True, False, 1, 0, "1", "", 1.0, b"1", ("1",), (1,), ("a", "b"), ("ab",), (("a",), "b"),
             ("a", ("b",)), np.int64(2) + 0.5, "a:b", ("a", ":b")]
    encoded = [encode_key(p) for p in parts]
    assert len(set(encoded)) == len(parts)
    assert encode_key(np.int64(7)) == encode_key(7)
    assert encode_key(np.float32(0.5)) == encode_key(0.5)
    for bad in ([1], {"a": 1}, object(), frozenset()):
        with pytest.raises(ConfigError, match="cannot derive a stable key"):
            encode_key(bad)  # type: ignore[arg-type]


def test_golden_values_are_machine_independent() -> None:
    # Fixed numbers: a change here changes every plan ever made (invariant 4).
    assert derive_seed(1234, 0, "ds", "1:1") == 199718124218343925
    assert derive_rng(1234, 0, "ds", "1:1", "shuffle").permutation(10).tolist() == [6, 9, 0, 7, 5, 4, 8, 2, 1, 3]
    assert stable_digest("a", 1, ("x", 2.5)).hex() == "a30d6f1623043384c16a31f5fb6bfeb4"
    assert derive_rng(2**63 + 11, 3, "text", ("len", 3)).integers(0, 2**32, 3).tolist() == [
        777677971, 1735055746, 2861691449]


def test_derived_streams_differ_by_every_part() -> None:
    base = derive_rng(7, 0, "ds", "a").integers(0, 2**62, 4).tolist()
    assert derive_rng(7, 0, "ds", "a").integers(0, 2**62, 4).tolist() == base
    for other in [(8, 0, "ds", "a"), (7, 1, "ds", "a"), (7, 0, "ds2", "a"), (7, 0, "ds", "b"),
                  (7, 0, "ds", "a", "schedule"), (7, 0, "ds", ("a",))]:
        assert derive_rng(*other).integers(0, 2**62, 4).tolist() != base


def test_derivation_ignores_pythonhashseed(tmp_path: Path) -> None:
    code = ("from wds_pad.core.seed import derive_seed, derive_rng;"
            "print(derive_seed(5, 'x', ('y', 1)), derive_rng(5, 'bucket', 2.5).permutation(6).tolist())")
    procs = [subprocess.Popen([sys.executable, "-c", code], stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                              env=dict(os.environ, PYTHONHASHSEED=h, PYTHONPATH=str(ROOT)))
             for h in ("0", "77", "random")]  # side by side: each is a fresh interpreter
    outs = set()
    for proc in procs:
        stdout, stderr = proc.communicate(timeout=60)
        assert proc.returncode == 0, stderr
        outs.add(stdout)
    assert len(outs) == 1
    assert outs.pop().strip() == f"{derive_seed(5, 'x', ('y', 1))} {derive_rng(5, 'bucket', 2.5).permutation(6).tolist()}"


# -- shared_seed in one process ------------------------------------------------------------

def test_configured_seed_is_returned_as_is(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("WORLD_SIZE", "8")  # a configured seed needs no agreement
    assert shared_seed(0) == 0
    assert shared_seed(2**64 - 1) == 2**64 - 1
    assert shared_seed(np.uint64(12)) == 12 and type(shared_seed(np.uint64(12))) is int


@pytest.mark.parametrize("bad", [-1, 2**64, "5", 1.5, True])
def test_invalid_seed_raises(bad: Any) -> None:
    with pytest.raises(ConfigError, match="seed must be"):
        shared_seed(bad)


def test_single_process_draws_a_fresh_63_bit_seed(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv("WORLD_SIZE", raising=False)
    draws = {shared_seed() for _ in range(20)}
    assert len(draws) == 20  # fresh entropy, not the clock or a constant
    assert all(isinstance(s, int) and 0 <= s < 2**SEED_BITS for s in draws)
    monkeypatch.setenv("WORLD_SIZE", "1")
    assert 0 <= shared_seed() < 2**63


def test_several_processes_without_a_group_cannot_draw(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("WORLD_SIZE", "2")
    with pytest.raises(SeedError, match="WORLD_SIZE=2 but torch.distributed is not initialised.*seed=<int>"):
        shared_seed()


# -- a real broadcast: 4 gloo processes on localhost (the session's job, conftest.py) ----------

@pytest.mark.slow
def test_drawn_seed_is_broadcast_from_rank_zero(gloo_job: list[dict[str, Any]]) -> None:
    res = gloo_job
    drawn = res[0]["drawn"]
    assert all(r["drawn"] == drawn for r in res)
    assert drawn[0] != drawn[1] and all(0 <= s < 2**63 for s in drawn)
    assert all(r["configured"] == 42 for r in res)
    assert [r["tagged_default"] for r in res] == [1000, 1000, 1000, 1000]
    # over the subgroup [1, 2] the root is the group's rank 0, i.e. global rank 1
    assert [res[1]["tagged_sub"], res[2]["tagged_sub"]] == [1001, 1001]
    assert res[1]["drawn_sub"] == res[2]["drawn_sub"] and "drawn_sub" not in res[0] and "drawn_sub" not in res[3]


def test_check_seed_is_the_one_rule_of_the_api_and_the_cli() -> None:
    import argparse

    from wds_pad.cli.common import seed_arg
    from wds_pad.core.seed import MAX_SEED, check_seed

    assert MAX_SEED == 2**64 - 1
    for good in (0, 2**64 - 1):
        assert check_seed(good) == shared_seed(good) == seed_arg(str(good)) == good
    for bad in (-1, 2**64):
        with pytest.raises(ConfigError, match=r"seed must be in \[0, 2\*\*64\)"):
            check_seed(bad)
        with pytest.raises(argparse.ArgumentTypeError, match=r"seed must be in \[0, 2\*\*64\)"):
            seed_arg(str(bad))


def test_json_digest_is_blake2b_of_the_json_text_with_the_callers_options() -> None:
    import hashlib
    import json

    from wds_pad.core.seed import json_digest

    doc = {"b": [1, 2.5, "x"], "a": {"z": None, "y": True}}
    for kw, dumps in (({}, dict(sort_keys=True)), ({"sort_keys": False}, {}),
                      ({"compact": True, "allow_nan": False}, dict(sort_keys=True, separators=(",", ":")))):
        want = hashlib.blake2b(json.dumps(doc, **dumps).encode(), digest_size=16).hexdigest()  # type: ignore[arg-type]
        assert json_digest(doc, **kw) == want  # type: ignore[arg-type]
    assert len(json_digest(doc, size=12)) == 24
    assert json_digest({"a": 1, "b": 2}) == json_digest({"b": 2, "a": 1}) != json_digest({"b": 2, "a": 1}, sort_keys=False)
    with pytest.raises(ValueError):
        json_digest({"x": float("nan")}, allow_nan=False)
