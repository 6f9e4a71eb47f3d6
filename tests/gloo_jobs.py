"""Small gloo jobs for tests: N processes on 127.0.0.1 running one script, with a hard timeout.

Each rank prints one JSON line last; the job returns them in rank order. The processes
are started by the one launcher of the test suite (:func:`dist_helpers.launch`), so every
process is killed if the job overruns and a test can never hang on a collective.
"""

from __future__ import annotations

import json
import sys
from pathlib import Path
from typing import Any

from dist_helpers import ROOT, launch


def run_gloo_job(tmp_path: Path, body: str, world: int, timeout: float = 120.0,
                 args: tuple[str, ...] = ()) -> list[dict[str, Any]]:
    """Run ``body`` (with ``args`` as sys.argv[1:]) in ``world`` gloo processes; kill them
    all if it takes over ``timeout``."""
    script = tmp_path / "worker.py"
    script.write_text(body)
    results = launch([sys.executable, str(script), *args], world, timeout=timeout, env={"PYTHONPATH": str(ROOT)})
    return [json.loads(r.stdout.strip().splitlines()[-1]) for r in results]
