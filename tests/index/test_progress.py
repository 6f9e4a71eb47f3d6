"""The indexing progress bar (tqdm): what it shows, where, and when it stays quiet."""

from __future__ import annotations

import io
import os
import subprocess
import sys
from pathlib import Path

import pytest

from wds_pad.index.progress import Progress

ROOT = Path(__file__).resolve().parents[2]


class Terminal(io.StringIO):
    def isatty(self) -> bool:
        return True


def test_a_log_gets_whole_lines_with_counts_and_rates() -> None:
    log = io.StringIO()
    bar = Progress(total=3, enabled=True, label="index", stream=log)
    for _ in range(3):
        bar.advance(samples=16)
        bar.advance(shards=1, nbytes=4_000_000)
    bar.close()
    text = log.getvalue()
    assert "\r" not in text and text.endswith("\n")
    last = text.splitlines()[-1]
    assert last.startswith("index: 100%") and "3/3 shards" in last
    for word in ("shards/s", "samples/s", "MB/s"):
        assert word in last
    assert (bar.shards, bar.samples, bar.nbytes) == (3, 48, 12_000_000)


def test_a_terminal_sees_the_bar_move_within_a_large_shard() -> None:
    tty = Terminal()
    bar = Progress(total=1, label="index", stream=tty, interval=0)  # enabled: stderr is a terminal
    bar.advance(samples=1000)  # a batch of samples, no shard done yet
    last = tty.getvalue().split("\r")[-1]  # redrawn since the bar opened at 0 samples
    assert "0/1 shards" in last and ", 0 samples/s" not in last and "samples/s" in last
    bar.advance(shards=1)
    bar.close()
    assert tty.getvalue().endswith("\n") and "1/1 shards" in tty.getvalue().split("\r")[-1]


@pytest.mark.parametrize("enabled", [None, False])
def test_off_when_asked_or_when_not_a_terminal(enabled) -> None:
    log = io.StringIO()
    bar = Progress(total=2, enabled=enabled, stream=log)
    bar.advance(shards=2, samples=5)
    bar.close()
    assert log.getvalue() == "" and bar.shards == 2 and bar.samples == 5


def test_tqdm_disable_turns_a_forced_bar_off() -> None:
    # tqdm reads TQDM_* when it is imported: a fresh process, as a user's shell gives
    code = ("import sys; from wds_pad.index.progress import Progress\n"
            "bar = Progress(total=2, enabled=True, stream=sys.stderr); bar.advance(shards=2); bar.close()\n")
    on = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, cwd=ROOT, check=True)
    off = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, cwd=ROOT, check=True,
                         env={**os.environ, "TQDM_DISABLE": "1"})
    assert "2/2 shards" in on.stderr and off.stderr == ""


def test_a_failed_build_in_a_log_ends_without_another_bar_line() -> None:
    log = io.StringIO()
    bar = Progress(total=5, enabled=True, stream=log)
    before = log.getvalue()
    bar.advance(shards=1)
    bar.close(failed=True)
    bar.close()  # closing twice is harmless
    assert log.getvalue() == before


def test_an_update_with_nothing_to_rescan_says_so_and_shows_no_rate(tmp_path, capsys) -> None:
    from wds_pad.cli.synth import make_image_shards
    from wds_pad.index.build import build_index

    urls = make_image_shards(tmp_path / "shards", samples=24, shards=4, seed=1)
    out = str(tmp_path / "i.wdsidx")
    build_index(urls, "aspect:width,height", output=out, progress=False)
    build_index(urls, "aspect:width,height", output=out, update=out, progress=True)  # a log: stderr
    last = capsys.readouterr().err.strip().splitlines()[-1]
    assert "4/4 shards" in last and last.endswith("0 shards rescanned, 4 unchanged]")
    assert "/s" not in last
    os.utime(urls[1], ns=(os.stat(urls[1]).st_atime_ns, os.stat(urls[1]).st_mtime_ns + 10**9))
    build_index(urls, "aspect:width,height", output=out, update=out, progress=True)
    last = capsys.readouterr().err.strip().splitlines()[-1]
    assert "1 shard rescanned, 3 unchanged, " in last and "samples/s" in last


def test_rates_count_scanned_shards_only_and_never_over_near_zero_time() -> None:
    bar = Progress(total=5, enabled=False)
    bar.advance(unchanged=4)
    assert bar.shards == 4 and bar.rates(1e-9) == bar.rates(10.0) == "0 shards rescanned, 4 unchanged"
    bar.advance(shards=1, samples=100, nbytes=2_000_000)
    assert bar.rates(2.0) == "1 shard rescanned, 4 unchanged, 0.5 shards/s, 50 samples/s, 1.0 MB/s"
    fresh = Progress(total=2, enabled=False)
    fresh.advance(shards=2, samples=10, nbytes=1_000_000)
    assert fresh.rates(0.5) == "4.0 shards/s, 20 samples/s, 2.0 MB/s"
    assert fresh.rates(1e-7) == "2 shards, 10 samples, 1.0 MB"  # no "20000000.0 shards/s"
