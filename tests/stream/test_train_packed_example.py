"""examples/train_packed.py: a tiny causal model trains on packed rows on CPU, its loss falling."""

from __future__ import annotations

import re
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]


def test_the_packed_training_example_learns_on_full_rows(tmp_path: Path) -> None:
    run = subprocess.run([sys.executable, str(ROOT / "examples" / "train_packed.py"), "--data", str(tmp_path / "d"),
                          "--steps", "25"], capture_output=True, text=True, timeout=600, cwd=tmp_path)
    assert run.returncode == 0, run.stderr
    losses = [float(x) for x in re.findall(r"^step \d+: loss ([\d.]+)", run.stdout, re.M)]
    assert len(losses) == 25
    assert sum(losses[-5:]) < sum(losses[:5]) * 0.8, losses  # it learns the token runs
    fill = re.search(r"mean fill ([\d.]+) over 25 steps", run.stdout)
    assert fill is not None and float(fill.group(1)) > 0.9, run.stdout
