"""One line from the error hierarchy where a traceback or a misleading message would be:
the index output (a full disk, /sys and /proc, http), a plot format, missing shards,
a truncated shard's advice in the CLI's spelling, an index planned twice."""

from __future__ import annotations

import errno
import os
import re
import resource
import shutil
import subprocess
import sys

import pytest

import wds_pad.index.build as build_mod
import wds_pad.index.output as output_mod
from wds_pad import build_index, load_index
from wds_pad.cli.app import main
from wds_pad.cli.synth import make_image_shards
from wds_pad.errors import ConfigError, ShardError, TarFormatError, WriteError
from wds_pad.index.output import write_index

WDS_PAD = os.path.join(os.path.dirname(sys.executable), "wds-pad")


@pytest.fixture()
def shards(tmp_path) -> list[str]:
    return make_image_shards(tmp_path / "shards", samples=96, shards=12, seed=5)


def pattern(shards: list[str]) -> str:
    return os.path.join(os.path.dirname(shards[0]), "shard-{000000..000011}.tar")


def run(capsys, *argv: str) -> tuple[int, str, str]:
    code = main(list(argv))
    out, err = capsys.readouterr()
    return code, out, err


def one_error_line(err: str, cmd: str) -> str:
    lines = err.strip().splitlines()
    assert len(lines) == 1, err
    assert lines[0].startswith(f"wds-pad {cmd}: error: "), err
    return lines[0]


def leftovers(directory) -> list[str]:
    """What a failed write could leave: temp or probe files."""
    return sorted(n for n in os.listdir(directory) if n.endswith(".tmp"))


@pytest.fixture()
def no_scan(monkeypatch):
    """Any shard scanned fails the test: a refusal must come before the scan."""
    def scan(*args, **kwargs):
        raise AssertionError("a shard was scanned before the output was refused")

    monkeypatch.setattr(build_mod, "scan_shards", scan)


# -- the index output --------------------------------------------------------------------------
def _limit_file_size(limit: int):
    def preexec() -> None:
        resource.setrlimit(resource.RLIMIT_FSIZE, (limit, limit))  # Python ignores SIGXFSZ: EFBIG
    return preexec


def test_a_file_size_limit_hit_while_writing_is_one_line_and_keeps_the_old_index(tmp_path, shards) -> None:
    out = tmp_path / "train.wdsidx"
    build_index(pattern(shards), output=str(out))
    before = out.read_bytes()
    assert len(before) > 4096
    proc = subprocess.run([WDS_PAD, "index", pattern(shards), "-o", str(out), "--bucket-by", "aspect",
                           "--no-progress"], capture_output=True, text=True, timeout=120,
                          preexec_fn=_limit_file_size(4096))
    assert proc.returncode == 1, proc.stderr
    line = one_error_line(proc.stderr, "index")
    assert f"cannot write the index to '{out}': File too large (EFBIG)" in line
    assert "is as it was" in line and "ulimit -f" in line
    assert "Traceback" not in proc.stderr
    assert out.read_bytes() == before  # the previous index, whole
    assert leftovers(tmp_path) == []


def test_a_full_disk_while_writing_is_a_write_error_and_leaves_no_file(tmp_path, shards, monkeypatch) -> None:
    real = output_mod.atomic_write

    def full_after_the_first_part(path, parts, **kw):
        def parts_then_enospc():
            it = iter(parts)
            yield next(it)
            raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC))
        return real(path, parts_then_enospc(), **kw)

    monkeypatch.setattr(output_mod, "atomic_write", full_after_the_first_part)
    out = tmp_path / "out" / "train.wdsidx"
    index = build_index(pattern(shards))
    with pytest.raises(WriteError, match=r"No space left on device \(ENOSPC\); nothing was written") as info:
        write_index(index, str(out))
    assert isinstance(info.value, OSError)
    assert "free space there, or choose another output path" in str(info.value)
    assert not out.exists() and leftovers(out.parent) == []


@pytest.mark.skipif(not os.path.isdir("/proc/self") or not os.path.isdir("/sys/kernel"),
                    reason="Linux: /proc and /sys")
@pytest.mark.parametrize("output, why", [
    ("/sys/x.wdsidx", "no permission to write in directory '/sys'"),
    ("/sys/kernel/new/x.wdsidx", "no permission to write in directory '/sys/kernel'"),
    ("/proc/x.wdsidx", "directory '/proc' does not take new files"),
    ("/proc/self/x.wdsidx", "directory '/proc/self' does not take new files"),
])
def test_an_output_in_sys_or_proc_is_refused_before_any_scan(shards, capsys, no_scan, output, why) -> None:
    code, out, err = run(capsys, "index", pattern(shards), "-o", output, "--no-progress")
    assert code == 2 and out == ""
    line = one_error_line(err, "index")
    assert f"index output '{output}' cannot be created: {why}" in line
    assert line.endswith("choose another output path (-o)")


def test_a_read_only_filesystem_is_refused_before_any_scan_also_for_root(tmp_path, shards, capsys, monkeypatch,
                                                                         no_scan) -> None:
    # no read-only mount is at hand without root: the probe file meets EROFS instead, as
    # it would there (os.access says yes to root on a read-only mount; the probe does not)
    real_open = os.open
    probes = []

    def read_only(path, flags, *args, **kw):
        if os.path.basename(str(path)).startswith(".wds-pad-probe."):
            probes.append(path)
            raise OSError(errno.EROFS, os.strerror(errno.EROFS), path)
        return real_open(path, flags, *args, **kw)

    monkeypatch.setattr(os, "open", read_only)
    code, out, err = run(capsys, "index", pattern(shards), "-o", str(tmp_path / "new" / "x.wdsidx"))
    monkeypatch.setattr(os, "open", real_open)
    assert code == 2 and len(probes) == 1 and os.path.dirname(probes[0]) == str(tmp_path)
    line = one_error_line(err, "index")
    assert f"cannot be created: directory '{tmp_path}' is on a read-only filesystem" in line


def test_a_full_filesystem_is_refused_before_any_scan(tmp_path, shards, monkeypatch, capsys, no_scan) -> None:
    real_write = os.write

    def full(fd, data):
        raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC))

    monkeypatch.setattr(output_mod.os, "write", full)
    code, out, err = run(capsys, "index", pattern(shards), "-o", str(tmp_path / "x.wdsidx"))
    monkeypatch.setattr(output_mod.os, "write", real_write)
    assert code == 2
    line = one_error_line(err, "index")
    assert f"cannot be written: the filesystem of directory '{tmp_path}' is full" in line
    assert line.endswith("free space there, or choose another output path (-o)")
    assert leftovers(tmp_path) == []  # the probe is gone


@pytest.mark.parametrize("output", ["http://127.0.0.1:9/train.wdsidx", "https://example.invalid/train.wdsidx",
                                    "simplecache::https://example.invalid/train.wdsidx"])
def test_an_http_output_is_refused_before_any_scan_and_any_request(shards, capsys, no_scan, output) -> None:
    code, out, err = run(capsys, "index", pattern(shards), "-o", output)
    assert code == 2
    line = one_error_line(err, "index")
    assert f"index output '{output}' is on http" in line and "which wds_pad only reads from" in line
    assert "write the index to a local path or an object store" in line
    assert "cannot reach" not in line  # refused by its protocol: no request was made


def test_a_refused_upload_says_write_not_read(tmp_path, shards, monkeypatch) -> None:
    import fsspec

    index = build_index(pattern(shards))
    fs = fsspec.filesystem("memory")

    def forbidden(self, path, data, **kw):
        raise PermissionError(errno.EACCES, "Access Denied")

    monkeypatch.setattr(type(fs), "pipe_file", forbidden)
    with pytest.raises(WriteError, match=r"index output 'memory://out/train\.wdsidx' is not writable"):
        write_index(index, "memory://out/train.wdsidx")


# -- inspect --plot -------------------------------------------------------------------------------
def test_a_plot_format_matplotlib_cannot_write_is_one_line_before_loading(tmp_path, capsys, monkeypatch) -> None:
    pytest.importorskip("matplotlib")
    monkeypatch.chdir(tmp_path)
    code, out, err = run(capsys, "inspect", "does-not-exist.wdsidx", "--plot", "x.txt")
    assert code == 2 and out == ""  # refused before the (missing) index is looked at
    line = one_error_line(err, "inspect")
    assert "--plot 'x.txt': matplotlib cannot write .txt files" in line
    assert ".png" in line and ".pdf" in line and line.endswith("e.g. --plot x.png")
    assert not (tmp_path / "x.txt").exists()


def test_a_plot_without_extension_is_png_and_says_its_name(tmp_path, shards, capsys, monkeypatch) -> None:
    pytest.importorskip("matplotlib")
    monkeypatch.chdir(tmp_path)
    build_index(pattern(shards), output="t.wdsidx")
    code, out, err = run(capsys, "inspect", "t.wdsidx", "--plot", "buckets")
    assert code == 0, err
    assert out.splitlines()[-1] == "plot written to buckets.png"
    assert (tmp_path / "buckets.png").read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    code, out, err = run(capsys, "inspect", "t.wdsidx", "--plot", "b.SVG")
    assert code == 0 and (tmp_path / "b.SVG").read_bytes().lstrip().startswith(b"<?xml")


# -- missing shards ---------------------------------------------------------------------------------
def test_missing_shards_are_counted_and_the_first_in_url_order_named_every_run(tmp_path, shards, capsys) -> None:
    gone = [shards[i] for i in (9, 3, 7, 10, 5, 11)]  # removed in no particular order
    for path in gone:
        os.remove(path)
    first = shards[3]
    lines = set()
    for workers in ("1", "2", "8", "8", "8"):
        code, out, err = run(capsys, "index", pattern(shards), "-o", str(tmp_path / "i.wdsidx"),
                             "--workers", workers, "--no-progress")
        assert code == 1 and out == ""
        lines.add(one_error_line(err, "index"))
    assert len(lines) == 1, lines  # the same message whatever the workers and the timing
    line = lines.pop()
    assert f"6 of 12 shards are missing, e.g. the first in URL order: shard '{first}' does not exist" in line
    also = re.search(r"\(also: (.*?) and (\d+) more\)", line)
    assert also and also.group(1) == ", ".join(repr(shards[i]) for i in (5, 7, 9, 10)) and also.group(2) == "1"
    assert line.endswith("or index with --on-error skip to leave them out")
    assert not (tmp_path / "i.wdsidx").exists()


def test_missing_shards_in_python_say_on_error_and_are_found_before_any_scan(shards, monkeypatch) -> None:
    os.remove(shards[4])
    scanned = []
    real = build_mod._scan_group
    monkeypatch.setattr(build_mod, "_scan_group", lambda urls, *a, **k: scanned.append(urls) or real(urls, *a, **k))
    with pytest.raises(ShardError, match=r"^1 of 12 shards is missing: shard '.*shard-000004\.tar' does not exist; "
                                         r"check the URL or pattern; or index with on_error='skip' to leave it out$"):
        build_index(pattern(shards), workers=3)
    assert scanned == []
    index = build_index(pattern(shards), on_error="skip")  # skip: left out and listed, as before
    assert [s["url"] for s in index.excluded["shards"]] == [shards[4]]


def test_all_shards_missing_gives_no_advice_to_skip(tmp_path, shards) -> None:
    for path in shards:
        os.remove(path)
    with pytest.raises(ShardError, match=r"^all 12 shards are missing, e.g. the first in URL order: shard "
                                         r"'.*shard-000000\.tar' does not exist; check the URL or pattern \(also: "
                                         r".* and 7 more\)$"):
        build_index(pattern(shards))


# -- advice in the CLI's spelling -------------------------------------------------------------
def test_a_truncated_shard_advises_the_option_of_the_interface_in_use(tmp_path, shards, capsys) -> None:
    bad = shards[1]
    with open(bad, "r+b") as f:
        f.truncate(os.path.getsize(bad) // 2 + 100)
    with pytest.raises(TarFormatError) as info:
        build_index(pattern(shards))
    assert "on_error='skip'" in str(info.value) and "--on-error" not in str(info.value)
    code, out, err = run(capsys, "index", pattern(shards), "-o", str(tmp_path / "i.wdsidx"), "--no-progress")
    assert code == 1
    line = one_error_line(err, "index")
    assert bad in line and "truncated" in line
    assert "or index with --on-error skip to keep the samples before the fault" in line
    assert "on_error" not in line


def test_cli_wording_turns_every_python_spelling_of_skip_into_the_option() -> None:
    from wds_pad.cli.common import cli_wording

    assert cli_wording("x; or index with on_error='skip' (--on-error skip) to leave it out") == \
        "x; or index with --on-error skip to leave it out"
    assert cli_wording("re-create it, or index with on_error='skip' to keep") == \
        "re-create it, or index with --on-error skip to keep"
    assert cli_wording("nothing to say") == "nothing to say"


# -- plan: an index given twice -------------------------------------------------------------------
def test_plan_refuses_an_index_given_twice_or_a_copy_of_it(tmp_path, shards, capsys, monkeypatch) -> None:
    monkeypatch.chdir(tmp_path)
    build_index(pattern(shards), output="t.wdsidx")
    shutil.copy("t.wdsidx", "copy.wdsidx")
    job = ["--world-size", "2", "--rank", "0", "--batch-size", "2", "--seed", "1", "--json"]
    code, out, err = run(capsys, "plan", "t.wdsidx", "t.wdsidx", *job)
    assert code == 2 and out == ""
    line = one_error_line(err, "plan")
    assert "index 't.wdsidx' is given twice (INDEX 1 and 2): each of its samples would be planned twice" in line
    assert "--repeats N" in line
    code, out, err = run(capsys, "plan", "t.wdsidx", f"{tmp_path}/t.wdsidx", *job)
    assert code == 2 and "is given twice" in one_error_line(err, "plan")
    code, out, err = run(capsys, "plan", "t.wdsidx", "copy.wdsidx", *job)
    assert code == 2
    digest = load_index("t.wdsidx").digest[:16]
    assert f"index 'copy.wdsidx' holds the same samples as 't.wdsidx' (digest {digest}, the same shards)" \
        in one_error_line(err, "plan")


@pytest.mark.filterwarnings("ignore::wds_pad.DroppedBucketWarning")
def test_plan_takes_two_indexes_of_one_name_that_hold_other_samples(tmp_path, shards, capsys, monkeypatch) -> None:
    monkeypatch.chdir(tmp_path)
    os.makedirs("a"), os.makedirs("b")
    build_index(shards[:6], output="a/t.wdsidx")
    build_index(shards[6:], output="b/t.wdsidx")
    # every shard, bucketed by aspect: it holds a's samples too, which may be on purpose
    # (a subset planned again to see it more often), so only an identical index is refused
    build_index(shards, "aspect", output="aspect.wdsidx")
    job = ["--world-size", "2", "--rank", "0", "--batch-size", "2", "--seed", "1", "--summary"]
    code, out, err = run(capsys, "plan", "a/t.wdsidx", "b/t.wdsidx", *job)
    assert code == 0, err
    assert {row.split()[0] for row in out.splitlines() if row.startswith("t ") or row.startswith("t#")} == {"t", "t#1"}
    code, out, err = run(capsys, "plan", "a/t.wdsidx", "aspect.wdsidx", *job)
    assert code == 0, err


# -- the demo's output folder and layout: refused before anything is generated ---------------
@pytest.mark.parametrize("where", ["a file", "under a file", "/proc"])
def test_demo_refuses_an_output_folder_it_cannot_use_in_one_line(tmp_path, capsys, where) -> None:
    afile = tmp_path / "afile"
    afile.write_text("kept")
    out = {"a file": str(afile), "under a file": str(afile / "sub"), "/proc": "/proc/wds_pad_demo"}[where]
    code, stdout, err = run(capsys, "demo", "--out", out, "--samples", "8", "--shards", "2")
    line = one_error_line(err, "demo")
    assert code == 1 and stdout == ""
    assert repr(out) in line and "--out" in line
    assert afile.read_text() == "kept"  # nothing written over


def test_demo_refuses_a_layout_that_cannot_be_before_generating(tmp_path, capsys) -> None:
    code, stdout, err = run(capsys, "demo", "--out", str(tmp_path / "d"), "--world-size", "4", "--cp-size", "3")
    line = one_error_line(err, "demo")
    assert code == 2 and "cp_size" in line and "divid" in line
    assert stdout == "" and not (tmp_path / "d").exists()  # no shards generated first
