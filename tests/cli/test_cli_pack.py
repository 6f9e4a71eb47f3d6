"""``wds-pad plan --pack L --packs-per-batch B [--max-segments S] [--oversize alone]``.

``--json`` rows carry ``"pack"``, parallel to ``"samples"``, the plan's packs; ``--summary``
counts each bucket's packs and their fill (real tokens over packs x L, copies left out);
flags that go with ``--pack`` are refused without it, and a sample longer than L is
refused with its count and the flag that lets it travel alone.
"""

from __future__ import annotations

import json
import re
from typing import Any

import numpy as np
import pytest

from wds_pad import Pack, Topology, plan_epoch
from wds_pad.cli.app import main
from wds_pad.cli.synth import make_token_shards
from wds_pad.index.build import build_index
from wds_pad.index.codec import load_index


@pytest.fixture(scope="module")
def tokens(tmp_path_factory: pytest.TempPathFactory) -> Any:
    folder = tmp_path_factory.mktemp("tokens")
    paths = make_token_shards(folder, samples=150, shards=3, seed=5, longest=300)
    return load_index(build_index(paths, "json:source", output=str(folder / "t.wdsidx"), cost="json:tokens").path)


def _plan(capsys: pytest.CaptureFixture[str], *args: str) -> tuple[int, str, str]:
    code = main(["plan", *args])
    got = capsys.readouterr()
    return code, got.out, got.err


def test_json_rows_carry_each_samples_pack(tokens: Any, capsys: pytest.CaptureFixture[str]) -> None:
    code, out, _ = _plan(capsys, tokens.path, "--world-size", "2", "--rank", "1", "--seed", "4", "--pack", "300",
                         "--packs-per-batch", "3", "--max-segments", "6", "--json")
    assert code == 0
    rows = [json.loads(line) for line in out.splitlines()]
    plan = plan_epoch(tokens.to_dataset(costs=True), Topology(2, 1), seed=4, batch_size=Pack(300, 3, 6), warn=False)
    assert [(r["samples"], r["pack"]) for r in rows] == [(b.samples.tolist(), b.pack.tolist()) for b in plan]
    for r in rows:
        assert len(r["pack"]) == len(r["samples"]) and sorted(set(r["pack"])) == [0, 1, 2]
        for p in range(3):
            members = [s for s, q in zip(r["samples"], r["pack"]) if q == p]
            assert int(np.asarray(tokens.cost)[members].sum()) <= 300 and len(members) <= 6


def test_summary_counts_packs_and_fill_without_copies(tokens: Any, capsys: pytest.CaptureFixture[str]) -> None:
    code, out, _ = _plan(capsys, tokens.path, "--world-size", "4", "--rank", "0", "--seed", "4", "--pack", "400",
                         "--packs-per-batch", "2", "--pad", "cyclic", "--summary")
    assert code == 0
    ds = tokens.to_dataset(costs=True)
    packs, real, copies = 0, 0.0, 0.0
    for d in range(4):
        for b in plan_epoch(ds, Topology(4, d), seed=4, batch_size=Pack(400, 2), policy="cyclic", warn=False):
            packs += 2
            real += float(tokens.cost[b.samples[~b.pad]].sum())
            copies += float(tokens.cost[b.samples[b.pad]].sum())
    assert copies > 0, "the case must have padded copies to leave out"
    line = re.search(r"pack 400 x 2 per batch: (\d+) packs over 4 DP ranks, fill ([\d.]+)%", out)
    assert line is not None, out
    assert int(line.group(1)) == packs
    assert float(line.group(2)) == pytest.approx(100 * real / (packs * 400), abs=0.051)
    assert re.search(r"segments/pack", out) and "code" in out and "web" in out


def test_pack_flags_are_checked_and_an_oversize_sample_names_the_fix(tokens: Any,
                                                                     capsys: pytest.CaptureFixture[str]) -> None:
    base = [tokens.path, "--world-size", "1", "--rank", "0", "--seed", "1", "--json"]
    code, _, err = _plan(capsys, *base, "--batch-size", "4", "--packs-per-batch", "2")
    assert code == 2 and "go with --pack L" in err
    code, _, err = _plan(capsys, "--buckets", "a=4", "--world-size", "1", "--rank", "0", "--seed", "1",
                         "--pack", "10", "--json")
    assert code == 2 and "--pack needs INDEX file(s) built with --cost" in err
    longest = int(np.asarray(tokens.cost).max())
    over = int((np.asarray(tokens.cost) > longest - 1).sum())
    code, _, err = _plan(capsys, *base, "--pack", str(longest - 1))
    assert code != 0 and f"{over} sample(s) cost more than seq_len {longest - 1}" in err and "--oversize alone" in err
    code, out, _ = _plan(capsys, *base, "--pack", str(longest - 1), "--oversize", "alone")
    assert code == 0 and out
