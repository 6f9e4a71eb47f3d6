"""core/collective.py: the process group is reached one way, with or without a job."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

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


JOB = """
import os, sys
import torch.distributed as dist
import torch.multiprocessing as mp
from wds_pad.core.collective import all_gather, broadcast, group_size

def run(rank, port):
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=3)
    try:
        assert group_size() == 3
        assert all_gather({"rank": rank}) == [{"rank": r} for r in range(3)]
        assert broadcast(f"from {rank}") == "from 0"
        sub = dist.new_group([1, 2])
        if rank in (1, 2):
            assert group_size(sub) == 2
            assert all_gather(rank * 10, sub) == [10, 20]
            assert broadcast(rank, sub) == 1  # the group's first rank, as a global rank
    finally:
        dist.destroy_process_group()

if __name__ == "__main__":
    mp.spawn(run, args=(int(sys.argv[1]),), nprocs=3)
    print("ok")
"""


def test_in_a_gloo_job_every_rank_gathers_and_receives_rank_zeros_value(tmp_path: Path) -> None:
    from dist_helpers import free_port

    script = tmp_path / "job.py"
    script.write_text(JOB)
    done = subprocess.run([sys.executable, str(script), str(free_port())], capture_output=True, text=True,
                          cwd=ROOT, timeout=120, env={**os.environ, "PYTHONPATH": str(ROOT)})
    assert done.returncode == 0, done.stderr[-3000:]
    assert done.stdout.strip() == "ok"
