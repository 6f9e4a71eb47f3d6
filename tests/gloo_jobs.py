"""Small gloo jobs for tests: N processes on 127.0.0.1 running one script, with a hard timeout.

Each rank prints one JSON line last; the job returns them in rank order. Every process
is killed if the job overruns, so a test can never hang on a collective.
"""

from __future__ import annotations

import json
import os
import socket
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parent.parent


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def run_gloo_job(tmp_path: Path, body: str, world: int, timeout: float = 120.0,
                 args: tuple[str, ...] = ()) -> list[dict[str, Any]]:
    """Run ``body`` (with ``args`` as sys.argv[1:]) in ``world`` gloo processes; kill them
    all if it takes over ``timeout``."""
    script = tmp_path / "worker.py"
    script.write_text(body)
    port = free_port()
    procs = []
    for r in range(world):
        env = dict(os.environ, RANK=str(r), WORLD_SIZE=str(world), LOCAL_RANK=str(r), MASTER_ADDR="127.0.0.1",
                   MASTER_PORT=str(port), GLOO_SOCKET_IFNAME="lo", PYTHONPATH=str(ROOT), OMP_NUM_THREADS="1")
        procs.append(subprocess.Popen([sys.executable, str(script), *args], env=env, stdout=subprocess.PIPE,
                                      stderr=subprocess.PIPE, text=True))
    deadline = time.monotonic() + timeout
    results = []
    try:
        for r, p in enumerate(procs):
            out, err = p.communicate(timeout=max(1.0, deadline - time.monotonic()))
            assert p.returncode == 0, f"rank {r} failed:\n{err[-3000:]}"
            results.append(json.loads(out.strip().splitlines()[-1]))
    finally:
        for p in procs:
            if p.poll() is None:
                p.kill()
                p.wait()
    return results
