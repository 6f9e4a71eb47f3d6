"""``wds-pad index | inspect | verify`` and ``plan INDEX --json`` through the real parser."""

from __future__ import annotations

import json
import re
import os
import signal
import subprocess
import sys
import tarfile
import time

import numpy as np
import pytest

import wds_pad.index.build as indexer_mod
from wds_pad.cli.synth import make_image_shards
from wds_pad.cli.app import main
from wds_pad.index.codec import load_index, serialize
from wds_pad.tar.scan import parse_sample

pytest_plugins = ["conftest_servers"]


@pytest.fixture()
def shards(tmp_path) -> list[str]:
    return make_image_shards(tmp_path / "shards", samples=48, shards=3, seed=11)


def run(capsys, *argv: str) -> tuple[int, str, str]:
    code = main(list(argv))
    out, err = capsys.readouterr()
    return code, out, err


def one_error_line(err: str, cmd: str) -> str:
    lines = err.strip().splitlines()
    assert len(lines) == 1, err
    assert lines[0].startswith(f"wds-pad {cmd}: error: "), err
    return lines[0]


def offsets_of(url: str) -> dict[str, int]:
    with tarfile.open(url) as tf:
        return {m.name: m.offset for m in tf.getmembers()}


def pattern(shards: list[str]) -> str:
    return os.path.join(os.path.dirname(shards[0]), "shard-{000000..000002}.tar")


def _ratios(keys) -> list[float]:
    return [float(w) / float(h) for w, h in (str(k).split(":") for k in keys)]


# -- index ------------------------------------------------------------------------------------
def test_index_writes_and_reports(tmp_path, shards, capsys) -> None:
    out = str(tmp_path / "train.wdsidx")
    code, stdout, stderr = run(capsys, "index", pattern(shards), "-o", out, "--bucket-by", "aspect",
                               "--workers", "2")
    assert code == 0
    index = load_index(out)
    assert len(index) == 48 and index.name == "train"
    assert "indexed 3 shards" in stdout and "48 samples in" in stdout and f"-> {out}" in stdout
    counts = index.bucket_counts()
    listed = next(ln for ln in stdout.splitlines() if ln.startswith("buckets: "))[len("buckets: "):].split(", ")
    assert sorted(listed) == sorted(f"{k}={v}" for k, v in counts.items())
    assert _ratios([kv.split("=")[0] for kv in listed]) == sorted(_ratios(counts))  # 9:16 < 1:1 < 16:9
    for word in ("3/3 shards", "shards/s", "samples/s", "MB/s"):  # the progress bar
        assert word in stderr
    assert "skipped" not in stdout and "excluded" not in stdout


def test_index_options_reach_the_bucket_function(tmp_path, shards, capsys) -> None:
    out = str(tmp_path / "i.wdsidx")
    code, stdout, stderr = run(capsys, "index", *shards, "-o", out, "--bucket-by", "json:width",
                               "--boundaries", "32,48", "--name", "widths", "--no-progress")
    assert code == 0 and stderr == ""
    index = load_index(out)
    assert set(index.buckets) <= {"<32", "32-48", ">=48"} and index.name == "widths"
    assert dict(index.bucket_by)["boundaries"] == [32, 48]
    code, _, _ = run(capsys, "index", *shards, "-o", out, "--bucket-by", "aspect", "--step", "0.5",
                     "--no-progress")
    assert code == 0 and dict(load_index(out).bucket_by)["step"] == 0.5


@pytest.mark.parametrize("argv, fragment", [
    (["--bucket-by", "colour"], "--bucket-by 'colour' is not understood"),
    (["--bucket-by", "none", "--ratios", "1:1"], "--ratios/--step apply only"),
    (["--bucket-by", "json:len", "--boundaries", "3,x"], "--boundaries '3,x'"),
])
def test_index_bad_bucket_spec_is_one_line_exit_2(tmp_path, shards, capsys, argv, fragment) -> None:
    out = tmp_path / "i.wdsidx"
    code, stdout, stderr = run(capsys, "index", shards[0], "-o", str(out), "--no-progress", *argv)
    assert code == 2 and stdout == "" and fragment in one_error_line(stderr, "index")
    assert not out.exists()


def test_index_update_reports_rescanned_shards(tmp_path, shards, capsys, monkeypatch) -> None:
    out = str(tmp_path / "i.wdsidx")
    code, stdout, stderr = run(capsys, "index", *shards, "-o", out, "--update", "--no-progress")
    assert code == 0 and "no index at" in stderr and "indexing every shard" in stderr
    first = load_index(out)
    st = os.stat(shards[2])
    os.utime(shards[2], ns=(st.st_atime_ns, st.st_mtime_ns + 10**9))
    scanned: list[str] = []
    real = indexer_mod.scan_many
    monkeypatch.setattr(indexer_mod, "scan_many",
                        lambda sources, **kw: scanned.extend(u for _, u, *_ in sources) or real(sources, **kw))
    code, stdout, _ = run(capsys, "index", *shards, "-o", out, "--update", "--no-progress")
    assert code == 0 and scanned == [shards[2]]
    assert "update: 1 shard scanned, 2 unchanged" in stdout
    np.testing.assert_array_equal(load_index(out).offset, first.offset)
    code, _, stderr = run(capsys, "index", *shards, "-o", out, "--update", "--bucket-by", "aspect", "--no-progress")
    assert code == 2 and "rebuild without --update" in one_error_line(stderr, "index")


def _bad_inputs(tmp_path, shards) -> dict[str, tuple[str, str]]:
    """name -> (bad shard path, fragment the error must contain)."""
    missing = str(tmp_path / "missing.tar")
    nottar = str(tmp_path / "nottar.tar")
    open(nottar, "wb").write(b"this is not a tar file\n" * 50)
    corrupt = str(tmp_path / "corrupt.tar")
    data = bytearray(open(shards[1], "rb").read())
    victim = list(offsets_of(shards[1]).items())[4][1]
    data[victim + 3] ^= 0x20
    open(corrupt, "wb").write(bytes(data))
    truncated = str(tmp_path / "truncated.tar")
    last = max(offsets_of(shards[2]).values())
    open(truncated, "wb").write(open(shards[2], "rb").read()[: last + 600])
    return {
        "missing": (missing, f"shard '{missing}' does not exist"),
        "not a tar": (nottar, f"{nottar}: not a tar archive"),
        "corrupt": (corrupt, f"{corrupt}: invalid tar header (bad header checksum) at byte offset {victim}"),
        "truncated": (truncated, f"{truncated}: truncated inside the payload"),
    }


@pytest.mark.parametrize("case", ["missing", "not a tar", "corrupt", "truncated"])
def test_index_bad_shard_fails_or_is_skipped(tmp_path, shards, capsys, caplog, case) -> None:
    bad, fragment = _bad_inputs(tmp_path, shards)[case]
    out = tmp_path / "i.wdsidx"
    code, stdout, stderr = run(capsys, "index", shards[0], bad, "-o", str(out), "--no-progress")
    assert code == 1  # an OSError-kind error (ShardError / TarFormatError)
    assert fragment in one_error_line(stderr, "index") and not out.exists()
    caplog.clear()
    code, stdout, stderr = run(capsys, "index", shards[0], bad, "-o", str(out), "--no-progress",
                               "--on-error", "skip")
    assert code == 0 and stderr == ""
    assert not [r for r in caplog.records if r.name == "wds_pad.tar.scan"]  # the report says it once
    assert "skipped 1 shard (on error: skip):" in stdout and f"  {bad}: " in stdout and fragment in stdout
    index = load_index(str(out))
    assert index.excluded["shards"][0]["url"] == bad and index.shards[1].error is not None
    assert len(index) >= index.shards[0].samples > 0


def bad_json_shard(tmp_path, shards) -> tuple[str, str, int]:
    """A copy of shard 0 whose second sample's .json does not parse (same size)."""
    src = shards[0]
    with tarfile.open(src) as tf:
        members = [m for m in tf.getmembers() if m.name.endswith(".json")]
    victim = members[1]
    data = bytearray(open(src, "rb").read())
    start = victim.offset_data
    data[start : start + 5] = b"{oops"
    bad = str(tmp_path / "badjson.tar")
    open(bad, "wb").write(bytes(data))
    first = min(o for n, o in offsets_of(src).items() if n.split(".")[0] == victim.name.split(".")[0])
    return bad, victim.name.split(".")[0], first


def test_index_bad_json_and_raising_bucket_function(tmp_path, shards, capsys) -> None:
    bad, key, offset = bad_json_shard(tmp_path, shards)
    out = tmp_path / "i.wdsidx"
    code, stdout, stderr = run(capsys, "index", bad, "-o", str(out), "--bucket-by", "aspect", "--no-progress")
    line = one_error_line(stderr, "index")
    assert code == 2 and f"sample '{key}'" in line and bad in line and f"byte offset {offset}" in line
    assert "not valid JSON" in line and not out.exists()
    code, stdout, stderr = run(capsys, "index", bad, "-o", str(out), "--bucket-by", "aspect", "--no-progress",
                               "--on-error", "skip")
    assert code == 0 and "excluded 1 sample:" in stdout
    assert f"  '{key}' in {bad} at byte offset {offset}: " in stdout
    assert load_index(str(out)).excluded["count"] == 1
    # a field missing from the JSON is the same kind of error, raised by the bucket function
    code, _, stderr = run(capsys, "index", shards[0], "-o", str(out), "--bucket-by", "aspect:w,h", "--no-progress")
    assert code == 2 and "field 'w' is missing" in one_error_line(stderr, "index")


def test_index_interrupted_keeps_previous_file(tmp_path, shards, capsys, monkeypatch) -> None:
    out = tmp_path / "i.wdsidx"
    assert run(capsys, "index", *shards, "-o", str(out), "--no-progress")[0] == 0
    before = out.read_bytes()
    real = indexer_mod.scan_many

    def interrupt(sources, **kw):
        if any(url == shards[1] for _, url, *_ in sources):
            raise KeyboardInterrupt
        return real(sources, **kw)

    monkeypatch.setattr(indexer_mod, "scan_many", interrupt)
    code, _, stderr = run(capsys, "index", *shards, "-o", str(out), "--no-progress", "--bucket-by", "aspect")
    assert code == 130 and "interrupted" in stderr and out.read_bytes() == before


@pytest.fixture()
def no_scan(monkeypatch):
    """Fail if any shard is scanned: refusals must come before the scan."""
    def refuse(*args, **kw):
        raise AssertionError("a shard was scanned before the output was checked")

    monkeypatch.setattr(indexer_mod, "_scan_group", refuse)


def test_index_refuses_an_input_shard_as_output(tmp_path, shards, capsys, monkeypatch, no_scan) -> None:
    monkeypatch.chdir(tmp_path)
    before = open(shards[2], "rb").read()
    for extra in ([], ["--force"]):
        code, stdout, stderr = run(capsys, "index", "shards/shard-{000000..000002}.tar", "-o",
                                   "shards/shard-000002.tar", "--no-progress", *extra)
        line = one_error_line(stderr, "index")
        assert code == 2 and stdout == ""
        assert "'shards/shard-000002.tar' is one of the input shards" in line and "choose another output" in line
    assert open(shards[2], "rb").read() == before


def test_index_refuses_a_file_that_is_not_an_index_unless_forced(tmp_path, shards, capsys, monkeypatch) -> None:
    notes = tmp_path / "notes.txt"
    notes.write_text("my notes\n")
    real = indexer_mod._scan_group
    monkeypatch.setattr(indexer_mod, "_scan_group", lambda *a, **kw: pytest.fail("scanned"))
    code, stdout, stderr = run(capsys, "index", *shards, "-o", str(notes), "--no-progress")
    line = one_error_line(stderr, "index")
    assert code == 2 and stdout == "" and notes.read_text() == "my notes\n"
    assert f"'{notes}' exists and is not a wds_pad index (9 bytes" in line and "pass --force" in line
    monkeypatch.setattr(indexer_mod, "_scan_group", real)
    assert run(capsys, "index", *shards, "-o", str(notes), "--no-progress", "--force")[0] == 0
    assert len(load_index(str(notes))) == 48
    assert run(capsys, "index", *shards, "-o", str(notes), "--no-progress")[0] == 0  # now it is an index


@pytest.mark.parametrize("bad, fragment", [
    ("{tmp}", "is a directory; give a file path, e.g. -o '{tmp}/train.wdsidx'"),
    ("{shard}/i.wdsidx", "cannot be created: '{shard}' is a file, not a directory"),
    ("", "index output path is empty"),
])
@pytest.mark.parametrize("update", [[], ["--update"]])
def test_index_bad_output_is_refused_before_scanning(tmp_path, shards, capsys, no_scan, bad, fragment,
                                                     update) -> None:
    fill = dict(tmp=str(tmp_path), shard=shards[0])
    code, stdout, stderr = run(capsys, "index", *shards, "-o", bad.format(**fill), *update)
    assert code == 2 and stdout == "" and fragment.format(**fill) in one_error_line(stderr, "index")


def test_other_commands_stop_on_an_interrupt_with_one_line(capsys, monkeypatch) -> None:
    import wds_pad.cli.app as cli

    for exc, code, what in [(KeyboardInterrupt(), 130, "interrupted"), (cli.Terminated(), 143, "terminated")]:
        def stop(*args, _exc=exc, **kw):
            raise _exc

        monkeypatch.setattr("wds_pad.core.planning.plan.plan_epoch", stop)
        got, stdout, stderr = run(capsys, "plan", "--buckets", "a=4", "--world-size", "2", "--rank", "0",
                                  "--batch-size", "1", "--seed", "0", "--summary")
        assert got == code and stdout == ""
        assert stderr.splitlines() == [f"wds-pad plan: {what}" + (" (SIGTERM)" if code == 143 else "")]


# A `wds-pad index` that blocks at a chosen point until the test has sent SIGTERM (no
# timing guesses): at "scan" in the middle of scanning, at "write" with the complete temp
# file fsynced, just before the rename. It records how many shard groups it started.
SIGNALLED_INDEX = """
import concurrent.futures, os, sys, threading, time
import wds_pad.io.atomic as atomic
import wds_pad.cli.app as cli
import wds_pad.index.build as indexer
where, ready, calls = sys.argv[1], sys.argv[2], sys.argv[3]
got_sigterm = threading.Event()
real_handler = cli._on_sigterm
def on_sigterm(signum, frame):
    got_sigterm.set()
    real_handler(signum, frame)
cli._on_sigterm = on_sigterm
futures = []
real_submit = concurrent.futures.ThreadPoolExecutor.submit
def submit(self, *args, **kw):
    futures.append(real_submit(self, *args, **kw))
    return futures[-1]
concurrent.futures.ThreadPoolExecutor.submit = submit
def block():
    open(ready, "w").close()
    while not got_sigterm.wait(0.01):
        pass
    for _ in range(3000):  # a worker thread: let the main thread stop the pool first (30 s cap)
        if threading.current_thread() is threading.main_thread() or any(f.cancelled() for f in futures):
            break
        time.sleep(0.01)
real_scan = indexer.scan_many
def scan(sources, **kw):
    with open(calls, "a") as f:
        f.write("scan\\n")
    if where == "scan":
        block()
    return real_scan(sources, **kw)
indexer.scan_many = scan
real_replace = os.replace
def replace(src, dst):
    if where == "write":
        block()
    return real_replace(src, dst)
atomic.os.replace = replace
sys.exit(cli.main(sys.argv[4:]))
"""


@pytest.mark.parametrize("where, workers", [("scan", 1), ("scan", 2), ("write", 1)])
def test_sigterm_exits_143_and_leaves_the_index_as_it_was(tmp_path, capsys, where, workers) -> None:
    shards = make_image_shards(tmp_path / "shards", samples=40, shards=40, seed=3)
    out = tmp_path / "train.wdsidx"
    assert run(capsys, "index", *shards[:2], "-o", str(out), "--no-progress")[0] == 0
    before, listing = out.read_bytes(), sorted(os.listdir(tmp_path))
    ready, calls = tmp_path.parent / f"{tmp_path.name}.ready", tmp_path.parent / f"{tmp_path.name}.calls"
    proc = subprocess.Popen([sys.executable, "-c", SIGNALLED_INDEX, where, str(ready), str(calls), "index",
                             *shards, "-o", str(out), "--workers", str(workers), "--no-progress"],
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    try:
        while not ready.exists():  # the child is mid-scan / mid-write
            assert proc.poll() is None, proc.communicate()
            time.sleep(0.01)
        if where == "write":
            assert any(n.endswith(".tmp") for n in os.listdir(tmp_path))  # the complete temp file
        proc.send_signal(signal.SIGTERM)
        stdout, stderr = proc.communicate(timeout=120)
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.communicate()
    assert proc.returncode == 143, stderr
    assert stdout == "" and stderr.splitlines() == [f"wds-pad index: terminated (SIGTERM); {out} was not changed"]
    assert out.read_bytes() == before and sorted(os.listdir(tmp_path)) == listing  # and no temp left
    groups = calls.read_text().count("scan")
    assert where == "write" or groups <= workers  # nothing more started after SIGTERM (of 2 groups with 1 worker, 8 with 2)


def test_console_script_one_line_error(tmp_path) -> None:
    script = os.path.join(os.path.dirname(sys.executable), "wds-pad")
    proc = subprocess.run([script, "index", str(tmp_path / "nope.tar"), "-o", str(tmp_path / "i.wdsidx")],
                          capture_output=True, text=True, timeout=60)
    assert proc.returncode == 1 and proc.stdout == ""
    assert proc.stderr.strip().splitlines() == [
        f"wds-pad index: error: shard '{tmp_path / 'nope.tar'}' does not exist; check the URL or pattern"]


# -- inspect ------------------------------------------------------------------------------------
@pytest.fixture()
def built(tmp_path, shards, capsys) -> str:
    out = str(tmp_path / "train.wdsidx")
    assert run(capsys, "index", *shards, "-o", out, "--bucket-by", "aspect", "--no-progress")[0] == 0
    return out


def test_inspect_table(built, capsys) -> None:
    index = load_index(built)
    code, out, _ = run(capsys, "inspect", built)
    assert code == 0
    lines = out.splitlines()
    assert lines[0].startswith(f"index {built} (format v2, digest {index.digest[:16]})")
    head = next(i for i, ln in enumerate(lines) if ln.split()[:2] == ["bucket", "samples"])
    assert lines[head].split() == ["bucket", "samples", "%", "bytes", "mean", "sample"]
    rows = {ln.split()[0]: ln.split() for ln in lines[head + 2 :] if ln and not ln.startswith(("shards", "total"))}
    sizes = index.bucket_bytes()
    for key, n in index.bucket_counts().items():
        assert int(rows[key][1]) == n and rows[key][2] == f"{100 * n / len(index):.1f}%"
        assert rows[key][3] == f"{sizes[key] / 1000:.1f}"
    per_shard = [s.samples for s in index.shards]
    assert "shards: 3, " in out and f"min {min(per_shard)} / max {max(per_shard)}, 0 with errors" in out


@pytest.mark.parametrize("padding", [False, True])
def test_inspect_table_and_plot_list_buckets_by_ratio(built, tmp_path, capsys, monkeypatch, padding) -> None:
    import matplotlib.axes

    ticks: list[list[str]] = []
    real = matplotlib.axes.Axes.set_xticks
    monkeypatch.setattr(matplotlib.axes.Axes, "set_xticks",
                        lambda self, x, labels=None, **kw: ticks.append(list(labels)) or real(self, x, labels, **kw))
    extra = ["--world-size", "4", "--batch-size", "2"] if padding else []
    code, out, _ = run(capsys, "inspect", built, "--plot", str(tmp_path / "b.png"), *extra)
    assert code == 0
    lines = out.splitlines()
    head = next(i for i, ln in enumerate(lines) if ln.split()[:2] == ["bucket", "samples"])
    rows = [ln.split()[0] for ln in lines[head + 2:] if ln and ln.split()[0] != "total"][:len(load_index(built).buckets)]
    assert len(rows) >= 4 and set(rows) == {str(k) for k in load_index(built).bucket_counts()}
    assert _ratios(rows) == sorted(_ratios(rows)) and rows != sorted(rows)
    assert ticks == [rows]


def test_inspect_json_is_one_object(built, capsys) -> None:
    index = load_index(built)
    code, out, _ = run(capsys, "inspect", built, "--json")
    assert code == 0 and len(out.strip().splitlines()) == 1
    got = json.loads(out)
    assert got["shards"] == 3 and got["samples"] == 48 and got["excluded"] == 0
    assert got["buckets"] == {str(k): v for k, v in index.bucket_counts().items()}
    assert got["bucket_bytes"] == {str(k): v for k, v in index.bucket_bytes().items()}
    assert got["digest"] == index.digest and got["version"] == 2 and got["bucket_by"]["kind"] == "aspect"
    assert "padding" not in got


def test_inspect_padding_matches_the_planner(built, capsys) -> None:
    from wds_pad.core.planning.plan import plan_epoch
    from wds_pad.core.topology import Topology

    code, out, _ = run(capsys, "inspect", built, "--json", "--world-size", "4", "--cp-size", "2",
                       "--batch-size", "4", "--seed", "7")
    assert code == 0
    got = json.loads(out)["padding"]
    plan = plan_epoch(load_index(built), Topology(world_size=4, rank=0, cp_size=2), seed=7, batch_size=4,
                      warn=False)
    for s in plan.stats:
        assert got[str(s.bucket)] == {"padded_length": s.padded_length, "padded_copies": s.padded_copies,
                                      "truncated": s.truncated, "dropped": s.dropped, "steps": s.steps}
    code, out, _ = run(capsys, "inspect", built, "--world-size", "4", "--batch-size", "4")
    assert code == 0 and "pad copies" in out and "(padding for world size 4, cp size 1" in out
    code, _, err = run(capsys, "inspect", built, "--world-size", "4")
    assert code == 2 and "needs both --world-size and --batch-size" in one_error_line(err, "inspect")


@pytest.mark.parametrize("padding", [False, True])
def test_inspect_plot_writes_a_png(built, tmp_path, capsys, padding) -> None:
    png = tmp_path / "buckets.png"
    extra = ["--world-size", "8", "--batch-size", "2", "--cp-size", "2"] if padding else []
    code, out, _ = run(capsys, "inspect", built, "--plot", str(png), *extra)
    assert code == 0 and f"plot written to {png}" in out
    data = png.read_bytes()
    assert data.startswith(b"\x89PNG\r\n\x1a\n") and len(data) > 5000


def test_inspect_plot_without_matplotlib_is_a_clear_error(built, tmp_path, capsys, monkeypatch) -> None:
    monkeypatch.setitem(sys.modules, "matplotlib", None)  # import matplotlib -> ImportError
    code, _, err = run(capsys, "inspect", built, "--plot", str(tmp_path / "x.png"))
    assert code == 2 and "--plot needs matplotlib: pip install 'wds-pad[plot]'" in one_error_line(err, "inspect")
    assert not (tmp_path / "x.png").exists()


def test_inspect_reports_skipped_and_excluded(tmp_path, shards, capsys) -> None:
    bad, key, offset = bad_json_shard(tmp_path, shards)
    missing = str(tmp_path / "gone.tar")
    out = str(tmp_path / "i.wdsidx")
    run(capsys, "index", bad, missing, "-o", out, "--bucket-by", "aspect", "--on-error", "skip", "--no-progress")
    code, text, _ = run(capsys, "inspect", out)
    assert code == 0 and "1 with errors" in text and "skipped 1 shard" in text and missing in text
    assert f"excluded 1 sample:\n  '{key}' in {bad} at byte offset {offset}" in text
    got = json.loads(run(capsys, "inspect", out, "--json")[1])
    assert got["excluded"] == 1 and got["excluded_samples"][0]["key"] == key
    assert [s["url"] for s in got["skipped_shards"]] == [missing]


def test_inspect_damaged_index_is_one_line(tmp_path, capsys, built) -> None:
    data = bytearray(open(built, "rb").read())
    data[30] ^= 0xFF
    bad = tmp_path / "bad.wdsidx"
    bad.write_bytes(bytes(data))
    code, _, err = run(capsys, "inspect", str(bad))
    assert code == 2 and "is damaged (header checksum mismatch)" in one_error_line(err, "inspect")


def _non_utf8_shards(root) -> list[str]:
    """Shards whose member names are not UTF-8: raw bytes in ustar headers, a pax path
    with hdrcharset=BINARY, a pax path of raw bytes without it."""
    from wds_pad.cli.producers import write_samples
    from data_helpers import write_pax_raw_path

    samples = [{"__key__": k, "bin": b"x" * (10 + i), "json": b'{"width": 4, "height": 3}'}
               for i, k in enumerate(["k0", "k\udcff1", "k2"])]
    urls = [write_samples(root / form, [samples], form)[0] for form in ("tarfile-ustar", "tarfile-pax")]
    return urls + [write_pax_raw_path(root / "raw.tar", samples)]


@pytest.mark.parametrize("where", ["local", "http"])
def test_index_keeps_names_that_are_not_utf8(tmp_path, capsys, nginx_server, where) -> None:
    import webdataset as wds

    from data_helpers import serve_dir

    urls = _non_utf8_shards(tmp_path / "shards")
    if where == "http":
        base = serve_dir(nginx_server, tmp_path / "shards", f"utf8-{tmp_path.name}")
        urls = [base + u[len(str(tmp_path / "shards")):] for u in urls]
    out = str(tmp_path / "k.wdsidx")
    code, stdout, stderr = run(capsys, "index", *urls, "-o", out, "--bucket-by", "aspect", "--on-error", "skip",
                               "--no-progress")
    assert (code, stderr) == (0, "") and "indexed 3 shards" in stdout and "9 samples" in stdout
    assert "skipped" not in stdout and "excluded" not in stdout
    index = load_index(out)
    order = np.lexsort((index.offset, index.shard))
    want = [s["__key__"] for s in wds.WebDataset(urls, shardshuffle=False)]
    assert [index.key(int(i)) for i in order] == want == ["k0", "k\udcff1", "k2"] * 3
    code, stdout, _ = run(capsys, "plan", out, "--world-size", "1", "--rank", "0", "--batch-size", "9", "--seed", "0",
                          "--json")
    assert code == 0 and sorted(json.loads(stdout)["keys"]) == sorted(want)
    assert run(capsys, "verify", out, "--deep")[:2] == (0, "3 shards OK (deep)\n")


# -- verify ---------------------------------------------------------------------------------------
def test_verify_ok_stale_missing(built, shards, capsys) -> None:
    code, out, _ = run(capsys, "verify", built)
    assert (code, out) == (0, "3 shards OK\n")
    code, out, _ = run(capsys, "verify", built, "--deep")
    assert (code, out) == (0, "3 shards OK (deep)\n")
    with open(shards[0], "ab") as f:
        f.write(b"\0" * 1024)
    os.remove(shards[2])
    code, out, _ = run(capsys, "verify", built)
    lines = out.splitlines()
    assert code == 1
    assert lines[0].startswith(f"STALE {shards[0]}: size ")
    assert lines[1].startswith(f"MISSING {shards[2]}: missing: ")
    assert lines[2].startswith("2 of 3 shards stale or missing;") and "--update" in lines[2]


# -- plan INDEX --json --------------------------------------------------------------------------
def test_plan_json_carries_urls_and_keys(built, capsys) -> None:
    index = load_index(built)
    code, out, _ = run(capsys, "plan", built, "--world-size", "2", "--rank", "all", "--batch-size", "3",
                       "--seed", "1", "--json", "--pad", "cyclic", "--oversubscribe")
    assert code == 0
    records = [json.loads(line) for line in out.splitlines()]
    assert records and {r["rank"] for r in records} == {0, 1}
    seen = set()
    for r in records:
        assert len(r["urls"]) == len(r["keys"]) == len(r["samples"]) == len(r["pad"])
        for sid, url, key in zip(r["samples"], r["urls"], r["keys"]):
            assert url == index.url(sid) and key == index.key(sid)
            assert index.buckets[int(index.bucket[sid])] == r["bucket"]
            seen.add(sid)
            off, n = int(index.offset[sid]), int(index.length[sid])
            with open(url, "rb") as f:
                f.seek(off)
                sample = parse_sample(f.read(n), url, off, key=key)
            assert json.loads(sample["json"])["index"] == int(key)
    assert seen == set(range(len(index)))  # cyclic + oversubscribe: every sample at least once


def test_index_empty_shard_has_zero_samples(tmp_path, shards, capsys) -> None:
    empty = str(tmp_path / "empty.tar")
    tarfile.open(empty, "w").close()  # a valid archive: just the end-of-archive blocks
    out = str(tmp_path / "i.wdsidx")
    code, stdout, _ = run(capsys, "index", empty, shards[0], "-o", out, "--no-progress")
    assert code == 0 and "indexed 2 shards" in stdout and "skipped" not in stdout
    index = load_index(out)
    assert index.shards[0].samples == 0 and index.shards[0].error is None and len(index) == index.shards[1].samples
    assert run(capsys, "verify", out)[1] == "2 shards OK\n"


# -- globs and messages -----------------------------------------------------------------------
def test_index_glob_and_pattern_errors(tmp_path, shards, capsys, monkeypatch) -> None:
    monkeypatch.chdir(tmp_path)
    out = str(tmp_path / "g.wdsidx")
    code, stdout, _ = run(capsys, "index", "shards/*.tar", "-o", out, "--no-progress")
    assert code == 0 and "indexed 3 shards" in stdout and list(load_index(out).urls) == sorted(shards)
    code, _, err = run(capsys, "index", "shards/nope-*.tar", "-o", out, "--no-progress")
    assert code == 1 and "matches no files" in one_error_line(err, "index")
    code, _, err = run(capsys, "index", "shards/{a", "-o", out, "--no-progress")
    assert code == 2 and "unbalanced braces" in one_error_line(err, "index")
    code, stdout, _ = run(capsys, "index", "shards", "shards/*.tar", "-o", out, "--on-error", "skip", "--no-progress")
    assert code == 0 and "skipped 1 shard" in stdout and "is a directory, not a tar file" in stdout


def test_verify_deep_prints_plain_ints_and_says_renamed(tmp_path, capsys) -> None:
    url = str(tmp_path / "s.tar")

    def write(names: list[str]) -> None:
        import io

        with tarfile.open(url, "w", format=tarfile.GNU_FORMAT) as tf:
            for name in names:
                info = tarfile.TarInfo(name)
                info.size, info.mtime = 700, 1_700_000_000
                tf.addfile(info, io.BytesIO(b"x" * 700))

    write(["a.txt", "b.txt"])
    out = str(tmp_path / "v.wdsidx")
    assert run(capsys, "index", url, "-o", out, "--no-progress")[0] == 0
    st = os.stat(url)
    write(["c.txt", "b.txt"])
    os.utime(url, ns=(st.st_atime_ns, st.st_mtime_ns))
    code, stdout, _ = run(capsys, "verify", out, "--deep")
    assert code == 1 and "np." not in stdout
    assert f"STALE {url}: sample 'a' was renamed: the sample at byte offset 0 is now key 'c'" in stdout


# -- files of an earlier format, --update without URLs, --distributed -----------------------------
def test_an_index_of_format_version_1_is_refused_in_one_line_with_the_command_that_rebuilds_it(
        tmp_path, shards, capsys) -> None:
    import json as _json
    import struct
    import zlib

    from wds_pad.errors import IndexFormatError

    out = str(tmp_path / "train.wdsidx")
    raw = _json.dumps({"format": "wds_pad.index", "version": 1, "arrays": {}}).encode()
    with open(out, "wb") as f:
        f.write(struct.pack("<8sIIQ", b"WDSPADIX", 1, zlib.crc32(raw), len(raw)) + raw)
    with pytest.raises(IndexFormatError) as info:
        load_index(out)
    message = str(info.value)
    assert "\n" not in message
    assert f"index {out!r} has format version 1, written by an earlier wds_pad 0.1" in message
    assert f"rebuild it with `wds-pad index SHARDS... -o {out}`" in message
    # an update reads the previous index first: the same line, nothing written
    code, _, stderr = run(capsys, "index", *shards, "--update", "-o", out, "--no-progress")
    assert code != 0 and "has format version 1" in stderr
    with open(out, "rb") as f:
        assert f.read(12)[8:] == struct.pack("<I", 1)


def test_update_without_urls_rescans_only_changed_shards_bucketed_as_before(tmp_path, shards, capsys,
                                                                            monkeypatch) -> None:
    out = str(tmp_path / "train.wdsidx")
    assert run(capsys, "index", *shards, "-o", out, "--bucket-by", "aspect", "--no-progress")[0] == 0
    before = load_index(out)
    os.utime(shards[1], (1_600_000_000, 1_600_000_000))
    scanned: list[str] = []
    real = indexer_mod.scan_many
    monkeypatch.setattr(indexer_mod, "scan_many",
                        lambda sources, **kw: scanned.extend(u for _, u, *_ in sources) or real(sources, **kw))
    code, stdout, _ = run(capsys, "index", "--update", "-o", out, "--no-progress")
    assert code == 0 and scanned == [shards[1]] and "update: 1 shard scanned, 2 unchanged" in stdout
    after = load_index(out)
    assert after.bucket_by == before.bucket_by and after.buckets == before.buckets
    assert after.shards[1].stamp != before.shards[1].stamp


def test_verify_deep_prints_the_command_that_fixes_a_shard_rewritten_in_place(tmp_path, shards, capsys,
                                                                            monkeypatch) -> None:
    """A shard regenerated with its size and mtime pinned: --update alone keeps its rows
    (it decides on size and stamp); verify --deep says so and prints the command with
    --rescan, which, run as printed, makes verify --deep pass."""
    import shlex

    from data_helpers import rewrite_member_header
    from wds_pad.tar.scan import scan_tar

    out = str(tmp_path / "train.wdsidx")
    assert run(capsys, "index", pattern(shards), "-o", out, "--bucket-by", "aspect", "--no-progress")[0] == 0
    with open(shards[1], "rb") as f:
        sample = next(iter(scan_tar(f, shards[1])))
    st = os.stat(shards[1])
    blob = bytearray(open(shards[1], "rb").read())
    rewrite_member_header(blob, sample.members[0], "size", size=sample.members[0].size - 1)
    open(shards[1], "r+b").write(blob)
    os.utime(shards[1], ns=(st.st_atime_ns, st.st_mtime_ns))
    assert run(capsys, "index", "--update", "-o", out, "--no-progress")[1].splitlines()[1] == \
        "update: 0 shards scanned, 3 unchanged"
    code, stdout, _ = run(capsys, "verify", out, "--deep")
    lines = stdout.splitlines()
    assert code == 1 and lines[0].startswith(f"STALE {shards[1]}: sample {sample.key!r}: member ")
    assert lines[0].endswith(f"now holds {sample.members[0].size - 1} bytes, {sample.members[0].size} indexed")
    command = re.search(r"`([^`]*)`", lines[1]).group(1)  # type: ignore[union-attr]
    assert command == f"wds-pad index --update -o {out} --rescan {shards[1]}"
    scanned: list[str] = []
    real = indexer_mod.scan_many
    monkeypatch.setattr(indexer_mod, "scan_many",
                        lambda sources, **kw: scanned.extend(u for _, u, *_ in sources) or real(sources, **kw))
    code, stdout, _ = run(capsys, *shlex.split(command)[1:], "--no-progress")
    assert code == 0 and scanned == [shards[1]] and "update: 1 shard scanned, 2 unchanged" in stdout
    assert run(capsys, "verify", out, "--deep")[:2] == (0, "3 shards OK (deep)\n")


def test_rescan_needs_update_and_a_shard_being_indexed(tmp_path, shards, capsys, monkeypatch) -> None:
    out = str(tmp_path / "train.wdsidx")
    code, _, err = run(capsys, "index", *shards, "-o", out, "--rescan", shards[0], "--no-progress")
    assert code == 2 and "--rescan scans shards again in an update: add --update" in one_error_line(err, "index")
    assert run(capsys, "index", *shards, "-o", out, "--no-progress")[0] == 0
    code, _, err = run(capsys, "index", "--update", "-o", out, "--rescan", str(tmp_path / "other.tar"),
                       "--no-progress")
    assert code == 2 and "to rescan (--rescan) is not one of the 3 shards" in one_error_line(err, "index")


def test_update_of_a_callable_index_reuses_rows_but_cannot_rescan(tmp_path, shards, capsys) -> None:
    from wds_pad.index.build import build_index

    out = str(tmp_path / "train.wdsidx")
    build_index(shards, lambda key, data: len(key) % 2, members=("json",), output=out)
    assert run(capsys, "index", "--update", "-o", out, "--no-progress")[0] == 0
    os.utime(shards[0], (1_600_000_000, 1_600_000_000))
    code, _, stderr = run(capsys, "index", "--update", "-o", out, "--no-progress")
    line = one_error_line(stderr, "index")
    assert code == 2 and "1 shard(s) changed or are new" in line and "bucket_by=fn, update=PATH" in line


def test_index_without_urls_needs_update_and_an_existing_index(tmp_path, capsys) -> None:
    code, _, stderr = run(capsys, "index", "-o", str(tmp_path / "x.wdsidx"))
    assert code == 2 and "give the shard URLs or patterns" in one_error_line(stderr, "index")
    code, _, stderr = run(capsys, "index", "--update", "-o", str(tmp_path / "x.wdsidx"))
    assert code == 2 and "which does not exist; give the shard URLs" in one_error_line(stderr, "index")


def test_distributed_without_torchrun_is_refused(tmp_path, shards, capsys, monkeypatch) -> None:
    for k in ("RANK", "WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT", "TORCHELASTIC_RUN_ID"):
        monkeypatch.delenv(k, raising=False)
    code, _, stderr = run(capsys, "index", "--distributed", *shards, "-o", str(tmp_path / "x.wdsidx"))
    line = one_error_line(stderr, "index")
    assert code == 2 and "--distributed runs under torchrun, but RANK, WORLD_SIZE" in line
    assert "torchrun --nproc-per-node N -m wds_pad index --distributed" in line


@pytest.mark.slow
def test_torchrun_module_form_indexes_as_one_job(tmp_path, shards) -> None:
    """`torchrun --nproc-per-node 2 -m wds_pad index ...` (no --distributed: implied) gives
    the bytes of a one-process build."""
    from dist_helpers import free_port
    from wds_pad.index.build import build_index

    out = str(tmp_path / "train.wdsidx")
    proc = subprocess.run(
        [sys.executable, "-m", "torch.distributed.run", "--nproc-per-node", "2", "--master-addr", "127.0.0.1",
         "--master-port", str(free_port()), "-m", "wds_pad", "index", *shards, "-o", out, "--bucket-by", "aspect",
         "--part-shards", "1", "--no-progress"],
        capture_output=True, text=True, timeout=180, env={**os.environ, "OMP_NUM_THREADS": "1"})
    assert proc.returncode == 0, proc.stderr
    assert "indexed 3 shards" in proc.stdout and "merged 3 parts" in proc.stderr
    with open(out, "rb") as f:
        assert f.read() == b"".join(bytes(p) for p in serialize(build_index(shards, "aspect", name="train",
                                                                            output=str(tmp_path / "one.wdsidx"))))


def test_python_m_wds_pad_runs_the_cli() -> None:
    proc = subprocess.run([sys.executable, "-m", "wds_pad", "index", "--help"], capture_output=True, text=True,
                          timeout=60)
    assert proc.returncode == 0 and "--distributed" in proc.stdout and "--part-shards" in proc.stdout


def test_inspect_says_how_many_samples_lack_a_member_table_and_why(built, tmp_path, capsys) -> None:
    from wds_pad.index.codec import serialize
    from wds_pad.index.layout import MEMBER_ARRAYS

    code, out, _ = run(capsys, "inspect", built)
    assert code == 0 and "member table: every sample" in out
    assert json.loads(run(capsys, "inspect", built, "--json")[1])["without_member_table"] == {"samples": 0, "why": ""}
    bare = load_index(built)
    for k in MEMBER_ARRAYS:
        bare.arrays.pop(k)
    bare.digest = bare.compute_digest()
    path = tmp_path / "bare.wdsidx"
    path.write_bytes(b"".join(bytes(p) for p in serialize(bare)))
    code, out, _ = run(capsys, "inspect", str(path))
    assert code == 0
    assert "member table: 48 of 48 samples have none and stream through the exact path" in out
    assert "rebuild it with `wds-pad index`" in out
    got = json.loads(run(capsys, "inspect", str(path), "--json")[1])["without_member_table"]
    assert got["samples"] == 48 and "wds-pad index" in got["why"]


# -- costs: index --cost, inspect's cost table and --budget -----------------------------------
def test_index_cost_records_reports_and_update_keeps_it(tmp_path, shards, capsys) -> None:
    out = str(tmp_path / "c.wdsidx")
    code, stdout, stderr = run(capsys, "index", *shards, "-o", out, "--bucket-by", "aspect", "--cost", "json:width",
                               "--no-progress")
    assert code == 0 and stderr == ""
    index = load_index(out)
    assert index.cost_kind == "json:width" and len(index.cost) == 48
    line = next(ln for ln in stdout.splitlines() if ln.startswith("cost json:width: "))
    assert line == (f"cost json:width: min {int(index.cost.min())}, mean {float(index.cost.mean()):.4g}, "
                    f"max {int(index.cost.max())} (wds-pad inspect: per bucket)")
    # --update without --cost keeps the costs INDEX records; another --cost is refused
    code, stdout, _ = run(capsys, "index", "--update", "-o", out, "--no-progress")
    assert code == 0 and "0 shards scanned, 3 unchanged" in stdout and load_index(out).digest == index.digest
    code, _, stderr = run(capsys, "index", "--update", "-o", out, "--cost", "bytes", "--no-progress")
    assert code == 2 and "recorded costs 'json:width', this update asks for --cost bytes" in one_error_line(
        stderr, "index")
    code, _, stderr = run(capsys, "index", *shards, "-o", out, "--cost", "json", "--no-progress")
    assert code == 2 and "--cost 'json' is not understood; accepted forms: json:FIELD | image:pixels | bytes" in \
        one_error_line(stderr, "index")


def test_inspect_shows_cost_per_bucket_and_samples_over_a_budget(tmp_path, shards, capsys) -> None:
    out = str(tmp_path / "c.wdsidx")
    assert run(capsys, "index", *shards, "-o", out, "--bucket-by", "aspect", "--cost", "json:width",
               "--no-progress")[0] == 0
    index = load_index(out)
    per_bucket = {k: [int(index.cost[i]) for i in range(lo, hi)]
                  for k, lo, hi in zip(index.buckets, index.bucket_offsets[:-1], index.bucket_offsets[1:])}
    budget = int(np.median(index.cost))
    code, stdout, _ = run(capsys, "inspect", out, "--budget", str(budget))
    assert code == 0
    table = stdout.split("cost json:width per sample:\n", 1)[1].splitlines()
    assert table[0].split() == ["bucket", "min", "median", "mean", "max", "over", str(budget)]
    for row in table[2 : 2 + len(per_bucket)]:
        key, low, mid, mean, high, over = row.split()
        values = per_bucket[key]
        assert (int(low), float(mid), int(high), int(over)) == (min(values), float(np.median(values)), max(values),
                                                                sum(v > budget for v in values))
        assert float(mean.replace(",", "")) == pytest.approx(np.mean(values), rel=1e-3)
    dear = sum(int(v > budget) for v in index.cost)
    assert f"{dear} samples cost more than the budget {budget}: each travels alone in a batch" in stdout
    code, stdout, _ = run(capsys, "inspect", out, "--budget", str(budget), "--json")
    record = json.loads(stdout)["cost"]
    assert record["kind"] == "json:width" and record["budget"] == budget
    for key, values in per_bucket.items():
        got = record["buckets"][key]
        assert (got["samples"], got["min"], got["max"]) == (len(values), min(values), max(values))
        assert got["median"] == np.median(values) and got["mean"] == pytest.approx(np.mean(values))
        keys = [index.key(i) for i in range(len(index)) if index.buckets[index.bucket_of(i)] == key
                and int(index.cost[i]) > budget]
        assert got["over_budget"]["count"] == len(keys) and sorted(got["over_budget"]["keys"]) == sorted(keys)
        row_of = {index.key(i): i for i in range(len(index))}
        costs = [int(index.cost[row_of[k]]) for k in got["over_budget"]["keys"]]
        assert costs == sorted(costs, reverse=True)  # the dearest first


def test_inspect_budget_needs_costs_and_a_positive_number(built, capsys) -> None:
    code, _, stderr = run(capsys, "inspect", built, "--budget", "100")
    assert code == 2 and "--budget needs an index with costs" in one_error_line(stderr, "inspect")
    with pytest.raises(SystemExit):
        main(["inspect", built, "--budget", "-3"])
    assert "expected a positive number" in capsys.readouterr().err
    code, stdout, _ = run(capsys, "inspect", built, "--json")
    assert code == 0 and "cost" not in json.loads(stdout)
