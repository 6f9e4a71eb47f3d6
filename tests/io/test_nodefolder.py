"""The node's shard folder (io/nodefolder.py): where it is, who removes it, and when.

A job's default folder lives in the temporary directory under a name from the job; every
process using it holds a shared lock of its ``.users``; the last main process to leave
removes it; a folder nobody holds a lock of (its job was killed) is removed by the next
job that opens its own. Real processes, each with its own temporary directory.
"""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import tempfile
from pathlib import Path

import pytest

from wds_pad.errors import ConfigError
from wds_pad.io import nodefolder

pytestmark = pytest.mark.timeout(120)

ROOT = Path(__file__).resolve().parents[2]


def test_the_job_is_named_by_torchrun_then_by_its_rendezvous_then_by_its_main_process() -> None:
    assert nodefolder.job_name({"TORCHELASTIC_RUN_ID": "abc", "MASTER_ADDR": "h", "MASTER_PORT": "1"}) == "run abc"
    assert nodefolder.job_name({"TORCHELASTIC_RUN_ID": "none", "MASTER_ADDR": "h", "MASTER_PORT": "1"}) == "master h:1"
    assert nodefolder.job_name({}, in_worker=False) == f"pid {os.getpid()}"
    assert nodefolder.job_name({}, in_worker=True) == f"pid {os.getppid()}"  # a DataLoader worker: its parent's


def test_the_default_folder_is_in_the_temporary_directory_one_per_user_and_job(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(tempfile, "tempdir", str(tmp_path))
    a, b = nodefolder.default_folder("run a"), nodefolder.default_folder("run b")
    assert a != b and a == nodefolder.default_folder("run a")
    assert os.path.dirname(a) == str(tmp_path) and os.path.basename(a).startswith("wds_pad-node-")


def test_a_cache_dir_is_made_and_used_one_process_without_one_keeps_shards_in_memory(tmp_path: Path) -> None:
    given = tmp_path / "a" / "cache"
    assert nodefolder.node_folder(str(given), workers=2, local_world_size=8) == str(given) and given.is_dir()
    assert nodefolder.node_folder(None, workers=0, local_world_size=None) is None
    assert nodefolder.node_folder(None, workers=1, local_world_size=1) is None
    (tmp_path / "file").write_text("")
    with pytest.raises(ConfigError, match="cache_dir .* cannot be made"):
        nodefolder.node_folder(str(tmp_path / "file" / "cache"), workers=0, local_world_size=None)


def _python(code: str, tmp: Path, **env: str) -> subprocess.Popen[str]:
    return subprocess.Popen([sys.executable, "-c", code], text=True, stdout=subprocess.PIPE,
                            stderr=subprocess.PIPE, env={**os.environ, "TMPDIR": str(tmp),
                                                         "PYTHONPATH": str(ROOT), **env})


JOIN = """
import sys, time
from wds_pad.io import nodefolder
path = nodefolder.node_folder(None, workers=0, local_world_size=4)
print(path, flush=True)
time.sleep(float(sys.argv[1]) if len(sys.argv) > 1 else 0)
"""


def test_the_last_process_of_a_job_to_leave_removes_its_folder(tmp_path: Path) -> None:
    env = {"TORCHELASTIC_RUN_ID": "job-1"}
    first = _python(JOIN.replace("sys.argv[1]) if len(sys.argv) > 1 else 0", "3)"), tmp_path, **env)
    path = Path(first.stdout.readline().strip())  # type: ignore[union-attr]
    assert path.is_dir() and (path / ".users").exists()
    (path / "kept-while-in-use").write_text("x")
    second = _python(JOIN, tmp_path, **env)
    out, err = second.communicate(timeout=60)
    assert second.returncode == 0, err
    assert out.strip() == str(path) and path.is_dir()  # the first is still there: not the last
    first.communicate(timeout=60)
    assert first.returncode == 0 and not path.exists()  # the last to leave removed it
    assert sorted(os.listdir(tmp_path)) == []


WORKERS = """
import sys
import torch
from wds_pad.io import nodefolder


class Joins(torch.utils.data.IterableDataset):
    def __iter__(self):
        yield nodefolder.node_folder(None, workers=2, local_world_size=None)  # a worker joins the folder too


main = nodefolder.node_folder(None, workers=2, local_world_size=None)
loader = torch.utils.data.DataLoader(Joins(), batch_size=None, num_workers=2, persistent_workers=PERSISTENT)
for epoch in range(2):
    assert set(loader) == {main}, main
print(main, flush=True)
"""


@pytest.mark.parametrize("persistent", [True, False])
@pytest.mark.parametrize("ranks", [1, 2])
def test_the_default_folder_is_gone_after_every_clean_exit_of_its_processes_and_their_workers(
        tmp_path: Path, persistent: bool, ranks: int) -> None:
    """Ranks whose DataLoader workers also use the folder (persistent ones still alive
    when the rank's exit handlers start) end cleanly: no folder, not even an empty one."""
    procs = [_python(WORKERS.replace("PERSISTENT", str(persistent)), tmp_path, TORCHELASTIC_RUN_ID="clean")
             for _ in range(ranks)]
    paths = set()
    for proc in procs:
        out, err = proc.communicate(timeout=90)
        assert proc.returncode == 0, err
        assert "Traceback" not in err, err
        paths.add(out.strip())
    assert len(paths) == 1 and paths.pop().startswith(str(tmp_path))
    assert sorted(os.listdir(tmp_path)) == []


def test_a_folder_whose_job_was_killed_is_removed_by_the_next_job_and_a_live_one_is_not(tmp_path: Path) -> None:
    killed = _python(JOIN.replace("sys.argv[1]) if len(sys.argv) > 1 else 0", "60)"), tmp_path,
                     TORCHELASTIC_RUN_ID="killed")
    dead = Path(killed.stdout.readline().strip())  # type: ignore[union-attr]
    live = _python(JOIN.replace("sys.argv[1]) if len(sys.argv) > 1 else 0", "60)"), tmp_path,
                   TORCHELASTIC_RUN_ID="live")
    alive = Path(live.stdout.readline().strip())  # type: ignore[union-attr]
    try:
        os.kill(killed.pid, signal.SIGKILL)  # no exit handler runs: its folder stays, its lock goes
        killed.wait(30)
        assert dead.is_dir()
        nxt = _python(JOIN, tmp_path, TORCHELASTIC_RUN_ID="next")
        out, err = nxt.communicate(timeout=60)
        assert nxt.returncode == 0, err
        assert not dead.exists() and alive.is_dir()
        assert not Path(out.strip()).exists()  # and the next job removed its own at exit
    finally:
        live.kill()
        live.wait(30)
        killed.stdout.close()  # type: ignore[union-attr]
        live.stdout.close()  # type: ignore[union-attr]


def test_a_default_folder_path_that_is_not_this_users_folder_is_refused(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(tempfile, "tempdir", str(tmp_path))
    path = nodefolder.default_folder("run someone-else")
    (tmp_path / "elsewhere").mkdir()
    os.symlink(tmp_path / "elsewhere", path)
    with pytest.raises(ConfigError, match="not a folder of this user.*cache_dir"):
        nodefolder.join(path)
