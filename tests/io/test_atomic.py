"""Atomic writes: temp names that identify their target, and temps of killed writers removed."""

from __future__ import annotations

import fnmatch
import json
import os
import signal
import stat
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


# Every file the product writes through atomic_write, under the umask given: an index
# built, one written, one updated (after an older version left it 0600), a state file,
# and a distributed build's parts and merged index (a one-process gloo job). Each write is
# recorded as it happens: the parts are gone once merged.
UMASK_WRITES = """
import json, os, stat, sys
import torch.distributed as dist
umask, root, shards = int(sys.argv[1], 8), sys.argv[2], sys.argv[3:]
os.umask(umask)
import wds_pad.index.distributed, wds_pad.index.output, wds_pad.state.files
from wds_pad import BucketedWebDataset, Loader, Topology, build_index, load_index, save_state_file
from wds_pad.cli.app import main
from wds_pad.index.distributed import build_index_distributed
from wds_pad.index.output import write_index
from wds_pad.io.atomic import atomic_write

modes = []
def recording(path, parts, **kw):
    out = atomic_write(path, parts, **kw)
    modes.append((os.path.relpath(path, root), stat.S_IMODE(os.stat(path).st_mode)))
    return out
for module in (wds_pad.index.distributed, wds_pad.index.output, wds_pad.state.files):
    module.atomic_write = recording

built = build_index(shards, output=f"{root}/built.wdsidx")
write_index(built, f"{root}/written.wdsidx")
os.chmod(f"{root}/built.wdsidx", 0o600)  # as an earlier version wrote it
assert main(["index", *shards, "-o", f"{root}/built.wdsidx", "--update", "--no-progress"]) == 0
loader = Loader(BucketedWebDataset(f"{root}/built.wdsidx", batch_size=2, topology=Topology(world_size=1, rank=0),
                                   seed=1, oversubscribe=True))
save_state_file(loader.state_dict(), f"{root}/ckpt", rank=0)
dist.init_process_group("gloo", init_method=f"file://{root}/pg", rank=0, world_size=1)
build_index_distributed(shards, output=f"{root}/dist.wdsidx", part_shards=1)
dist.destroy_process_group()
print(json.dumps(modes))
"""


@pytest.mark.parametrize(("umask", "mode"), [(0o022, 0o644), (0o027, 0o640), (0o077, 0o600)],
                         ids=["umask-022", "umask-027", "umask-077"])
def test_written_files_take_the_umask_as_any_new_file(tmp_path, umask: int, mode: int) -> None:
    from wds_pad.cli.synth import make_image_shards

    shards = make_image_shards(tmp_path / "shards", samples=12, shards=3, seed=2)
    out = tmp_path / "out"
    out.mkdir()
    proc = subprocess.run([sys.executable, "-c", UMASK_WRITES, oct(umask), str(out), *shards], capture_output=True,
                          text=True, timeout=300, env={**os.environ, "OMP_NUM_THREADS": "1"})
    assert proc.returncode == 0, proc.stderr
    written = json.loads(proc.stdout.splitlines()[-1])  # after what `wds-pad index` printed
    names = [name for name, _ in written]
    assert names[:3] == ["built.wdsidx", "written.wdsidx", "built.wdsidx"]  # build, write, --update
    assert "ckpt/loader-rank00000.json" in names and names[-1] == "dist.wdsidx"
    assert sum(name.startswith("dist.wdsidx.parts/") for name in names) == 3  # one part per shard
    assert {name: oct(m) for name, m in written if m != mode} == {}
    for name in ("built.wdsidx", "written.wdsidx", "ckpt/loader-rank00000.json", "dist.wdsidx"):
        assert stat.S_IMODE(os.stat(out / name).st_mode) == mode, name
