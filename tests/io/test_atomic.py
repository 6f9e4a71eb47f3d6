"""Atomic writes: temp names that identify their target, and temps of killed writers removed."""

from __future__ import annotations

import fnmatch
import json
import os
import signal
import subprocess
import sys

import pytest

import wds_pad
from wds_pad.io import atomic as _atomic
from wds_pad.io.atomic import atomic_write, stale_temps

# A child that writes PATH through CALL and is SIGKILLed after the temp file is complete
# and fsynced, just before the rename: what a power cut or the OOM killer leaves behind.
KILLED_WRITER = """
import os, signal, sys
def die(src, dst):
    os.kill(os.getpid(), signal.SIGKILL)
os.replace = die
import wds_pad, numpy
from wds_pad.io.atomic import atomic_write
from wds_pad.index.record import ShardInfo
from wds_pad.index.rows import make_index
from wds_pad.index.output import write_index
call, path = sys.argv[1], sys.argv[2]
if call == "atomic_write":
    atomic_write(path, [b"new content"])
elif call == "write_index":
    rows = {k: numpy.zeros(1, numpy.int64) for k in ("shard", "offset", "length", "bucket", "exts")}
    index = make_index([ShardInfo("/data/a.tar", 1024, "mtime=1", 1)], rows, ["all"], ["k"],
                       bucket_by={"kind": "none"}, exts=[])
    write_index(index, path)
else:
    wds_pad.save_state_file({"step": 2}, os.path.dirname(path), rank=3)
"""


def killed_write(call: str, path: str) -> None:
    proc = subprocess.run([sys.executable, "-c", KILLED_WRITER, call, path], capture_output=True, text=True,
                          timeout=120)
    assert proc.returncode == -signal.SIGKILL, proc.stderr


def temps(directory) -> list[str]:
    return sorted(n for n in os.listdir(directory) if n.endswith(".tmp"))


def test_temp_name_names_its_target_and_ends_in_tmp(tmp_path, monkeypatch) -> None:
    path = tmp_path / "train.wdsidx"
    seen: list[str] = []
    real = os.replace

    def spy(src, dst):
        seen.extend(os.listdir(tmp_path))
        real(src, dst)

    monkeypatch.setattr(os, "replace", spy)
    atomic_write(str(path), [b"x"])
    (tmp,) = seen
    assert tmp.startswith(".train.wdsidx.") and tmp.endswith(".tmp") and f"-{os.getpid()}." in tmp
    assert not fnmatch.fnmatch(tmp, "*.wdsidx") and not fnmatch.fnmatch(tmp, "*.json")
    assert path.read_bytes() == b"x" and os.listdir(tmp_path) == ["train.wdsidx"]


def test_long_target_names_give_legal_temp_names(tmp_path) -> None:
    path = tmp_path / ("x" * 250)
    atomic_write(str(path), [b"long"])
    assert path.read_bytes() == b"long" and os.listdir(tmp_path) == [path.name]


def test_next_write_removes_the_temp_of_a_killed_writer(tmp_path) -> None:
    path = tmp_path / "t.bin"
    atomic_write(str(path), [b"old content"])
    killed_write("atomic_write", str(path))
    (left,) = temps(tmp_path)  # complete and fsynced, but never renamed
    assert left.startswith(".t.bin.") and (tmp_path / left).read_bytes() == b"new content"
    assert path.read_bytes() == b"old content" and stale_temps(str(path)) == [str(tmp_path / left)]
    atomic_write(str(path), [b"next"])
    assert temps(tmp_path) == [] and path.read_bytes() == b"next"


def test_killed_index_write_leaves_no_index_lookalike_and_is_cleaned(tmp_path) -> None:
    from wds_pad.index.codec import load_index
    from wds_pad.index.output import write_index

    path = tmp_path / "train.wdsidx"
    killed_write("write_index", str(path))
    (left,) = temps(tmp_path)
    assert len(load_index(str(tmp_path / left))) == 1  # a complete, loadable index ...
    assert fnmatch.filter(os.listdir(tmp_path), "*.wdsidx") == []  # ... that no *.wdsidx glob picks up
    index = load_index(str(tmp_path / left))
    write_index(index, str(path))
    assert os.listdir(tmp_path) == ["train.wdsidx"] and load_index(str(path)).digest == index.digest


def test_cleanup_spares_live_writers_other_targets_other_hosts_and_strangers(tmp_path) -> None:
    path = tmp_path / "t.wdsidx"
    killed_write("atomic_write", str(path))
    (dead,) = temps(tmp_path)
    host = _atomic._host_tag()
    dead_pid = int(dead.split("-")[-1].split(".")[0])
    live = subprocess.Popen([sys.executable, "-c", "import sys; sys.stdin.read()"], stdin=subprocess.PIPE)
    try:
        keep = [
            f".t.wdsidx.{host}-{live.pid}.0123abcd.tmp",       # a writer still running
            f".t.wdsidx.{host}-{os.getpid()}.0123abcd.tmp",    # this process (another thread)
            f".t.wdsidx.0000beef-{dead_pid}.0123abcd.tmp",     # written from another machine
            f".other.wdsidx.{host}-{dead_pid}.0123abcd.tmp",   # another target
            f".t.wdsidx.{host}-{dead_pid}.0123abcd.tmp.bak",   # not one of our names
            ".tmp-wdsidx-k2j3h4g5.tmp",                        # an old-style temp: writer unknown
            "t.wdsidx.notes.tmp",
        ]
        for name in keep:
            (tmp_path / name).write_bytes(b"keep")
        atomic_write(str(path), [b"new"])
        assert sorted(os.listdir(tmp_path)) == sorted(keep + ["t.wdsidx"])
        assert all((tmp_path / name).read_bytes() == b"keep" for name in keep)
    finally:
        live.communicate(b"")


def test_state_file_write_removes_the_temp_of_a_killed_save(tmp_path) -> None:
    first = wds_pad.save_state_file({"step": 1}, str(tmp_path), rank=3)
    other = wds_pad.save_state_file({"step": 1}, str(tmp_path), rank=4)
    killed_write("save_state_file", first)
    (left,) = temps(tmp_path)
    assert left.startswith(".loader-rank00003.") and not fnmatch.fnmatch(left, "*.json")
    wds_pad.save_state_file({"step": 3}, str(tmp_path), rank=4)  # another rank's file: its temps only
    assert temps(tmp_path) == [left]
    assert wds_pad.save_state_file({"step": 3}, str(tmp_path), rank=3) == first
    assert temps(tmp_path) == [] and sorted(os.listdir(tmp_path)) == sorted(
        [os.path.basename(first), os.path.basename(other)])
    assert json.loads(open(first).read())["state"] == {"step": 3}
