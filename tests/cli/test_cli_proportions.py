"""``wds-pad plan --proportions ... --mix-by ... --epoch-size ...``: the library's plan, as JSON."""

from __future__ import annotations

import contextlib
import io
import json

import numpy as np
import pytest

from wds_pad.cli.app import main
from wds_pad.core.dataset import Dataset
from wds_pad.core.planning.plan import plan_epoch
from wds_pad.core.topology import Topology


def _run(*args: str) -> tuple[int, str]:
    buf = io.StringIO()
    with contextlib.redirect_stdout(buf):
        code = main(["plan", *args])
    return code, buf.getvalue()


def test_plan_json_with_proportions_is_the_library_plan() -> None:
    code, out = _run("--buckets", "a=300,b=50", "--world-size", "2", "--rank", "1", "--batch-size", "4",
                     "--seed", "5", "--proportions", "2", "--epoch-size", "1000", "--json")
    assert code == 0
    ds = Dataset("synthetic", {"a": np.arange(300), "b": np.arange(300, 350)}, proportion=2.0)
    topo = Topology(2, 1)
    want = [b.to_json(topo) for b in plan_epoch(ds, topo, seed=5, batch_size=4, epoch_size=1000)]
    got = [json.loads(line) for line in out.splitlines()]
    assert got == want
    assert 2 * sum(len(r["samples"]) for r in got) >= 1000  # the epoch is its --epoch-size, by marked copies


def test_proportions_need_one_value_per_dataset(capsys: pytest.CaptureFixture[str]) -> None:
    code, _ = _run("--buckets", "a=30", "--world-size", "1", "--rank", "0", "--batch-size", "4", "--seed", "5",
                   "--proportions", "1,2", "--json")
    assert code != 0
    assert "--proportions has 2 values for 1 dataset(s)" in capsys.readouterr().err
