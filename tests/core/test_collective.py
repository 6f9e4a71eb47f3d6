"""core/collective.py: the process group is reached one way, with or without a job."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path
from typing import Any

from wds_pad.core.collective import all_gather, broadcast, dist_for, group_size

ROOT = Path(__file__).resolve().parents[2]


def test_without_a_process_group_a_rank_is_the_whole_job() -> None:
    assert dist_for() is None
    assert group_size() == 1
    assert all_gather({"rank": 0}) is None
    value = object()
    assert broadcast(value) is value


def test_without_torch_imported_nothing_imports_it() -> None:
    code = ("import sys\nfrom wds_pad.core.collective import dist_for, group_size\n"
            "assert dist_for() is None and group_size() == 1\nprint('torch' in sys.modules)")
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, cwd=ROOT)
    assert done.returncode == 0, done.stderr
    assert done.stdout.strip() == "False"


def test_in_a_gloo_job_every_rank_gathers_and_receives_rank_zeros_value(gloo_job: list[dict[str, Any]]) -> None:
    # the session's 4-process job (conftest.py): the default group, then the subgroup [1, 2]
    assert [r["group_size"] for r in gloo_job] == [4, 4, 4, 4]
    assert all(r["gathered"] == [{"rank": rank} for rank in range(4)] for r in gloo_job)
    assert [r["broadcast"] for r in gloo_job] == ["from 0"] * 4
    assert [r.get("sub_size") for r in gloo_job] == [None, 2, 2, None]
    assert [r.get("sub_gathered") for r in gloo_job] == [None, [10, 20], [10, 20], None]
    assert [r.get("sub_broadcast") for r in gloo_job] == [None, 1, 1, None]  # the group's first rank, as a global rank
