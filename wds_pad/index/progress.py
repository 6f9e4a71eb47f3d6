"""The indexing progress bar on stderr, drawn by tqdm: shards done/total and the rates
(shards/s, samples/s, MB/s) since the start.

Invariants:
- never touches stdout: the bar goes to ``stream`` (default stderr);
- shown when enabled (default: only when the stream is a terminal); ``TQDM_DISABLE=1``
  turns an enabled bar off, and in a Jupyter notebook it is tqdm's widget;
- on a terminal it redraws one line (at most every ``interval`` s); elsewhere (a log,
  a pipe) each redraw is one line of its own, at most one every 5 s, plus the last;
- counts are exact and thread-safe: shards are counted as they finish, samples as each
  batch of a large shard is scanned, so the bar moves during a large shard too;
- rates are of work done: shards an update reuses unchanged move the bar but count in
  no rate (with nothing rescanned the bar says so and shows no rate), and no rate is
  shown over a near-zero time (under a microsecond: the counts instead);
- a disabled bar costs a lock and three additions per call, and never imports tqdm.
"""

from __future__ import annotations

import os
import sys
import threading
from typing import Any, TextIO

_MIN_ELAPSED = 1e-6  # seconds: less is no measurement (a rate of "12512512.4 shards/s")
_FORMAT = "{desc}: {percentage:3.0f}%|{bar}| {n_fmt}/{total_fmt} shards [{elapsed}<{remaining}{postfix}]"


class Progress:
    """Counts shards, samples and bytes and shows them, with their rates, on a tqdm bar."""

    def __init__(self, total: int, *, enabled: bool | None = None, label: str = "",
                 stream: TextIO | None = None, interval: float = 0.2) -> None:
        self.stream = stream or sys.stderr
        self.tty = bool(getattr(self.stream, "isatty", lambda: False)())
        self.enabled = self.tty if enabled is None else bool(enabled)
        self.total, self.label = total, label
        self.shards = self.samples = self.nbytes = 0
        self.unchanged = 0  # of ``shards``: reused by an update, not scanned
        self.interval = interval if self.tty else max(interval, 5.0)
        self._lock = threading.Lock()
        self._bar = _open_bar(self) if self.enabled else None

    def advance(self, *, shards: int = 0, samples: int = 0, nbytes: int = 0, unchanged: int = 0) -> None:
        """Count ``shards`` scanned (with their ``samples`` and ``nbytes``) and
        ``unchanged`` shards an update reuses without scanning them."""
        with self._lock:
            self.shards += shards + unchanged
            self.unchanged += unchanged
            self.samples += samples
            self.nbytes += nbytes
            if self._bar is not None:
                self._bar.update(shards + unchanged)  # redraws once ``interval`` has passed, also for 0

    def rates(self, elapsed: float) -> str:
        """``'1.2 shards/s, 3,400 samples/s, 5.6 MB/s'`` over ``elapsed`` seconds.

        Only scanned shards count: an update says how many it rescanned and reused
        (``'0 shards rescanned, 4 unchanged'``, no rate when it scanned nothing), and
        over a near-zero time the counts stand in for rates.
        """
        scanned = self.shards - self.unchanged
        head = f"{_plural(scanned, 'shard')} rescanned, {self.unchanged} unchanged" if self.unchanged else ""
        if self.unchanged and not (scanned or self.samples or self.nbytes):
            return head
        if elapsed < _MIN_ELAPSED:
            body = f"{_plural(scanned, 'shard')}, {self.samples:,} samples, {self.nbytes / 1e6:.1f} MB"
        else:
            body = (f"{scanned / elapsed:.1f} shards/s, {self.samples / elapsed:,.0f} samples/s, "
                    f"{self.nbytes / elapsed / 1e6:.1f} MB/s")
        return f"{head}, {body}" if head else body

    def close(self, *, failed: bool = False) -> None:
        """Draw the final counts and end the line. ``failed``: in a log, draw nothing
        more, so that a failed build ends with its error line."""
        with self._lock:
            bar, self._bar = self._bar, None
            if bar is None:
                return
            if bar.log and failed:
                bar.leave = False  # clears nothing in a log: no further line
            elif bar.log and bar.last_print_t < bar.start_t + bar.delay:
                bar.refresh()  # done within the first interval: its one line is the last
            bar.close()


def _plural(n: int, word: str) -> str:
    return f"{n} {word}" if n == 1 else f"{n} {word}s"


def _open_bar(progress: Progress) -> Any:
    from tqdm.std import tqdm as text

    base = text
    if progress.stream is sys.stderr and "IPython" in sys.modules:  # perhaps a notebook (never
        from tqdm.auto import tqdm as base  # without IPython): its widget shows only stderr
    notebook = "tqdm.notebook" in sys.modules and issubclass(base, sys.modules["tqdm.notebook"].tqdm)
    log = not progress.tty and not notebook  # a file or a pipe

    class Bar(base):  # type: ignore[misc, valid-type]
        monitor_interval = 0  # miniters is fixed: tqdm's monitor thread has nothing to do

        @property
        def format_dict(self) -> dict[str, Any]:
            d = super().format_dict
            d["postfix"] = progress.rates(d["elapsed"])  # computed when drawn, not when counted
            return d  # type: ignore[no-any-return]

    bar = Bar(total=progress.total, desc=progress.label, bar_format=_FORMAT,
              file=_Lines(progress.stream) if log else progress.stream,
              mininterval=progress.interval, miniters=0, smoothing=0,
              delay=progress.interval if log else 0,  # a log's first line comes after one interval
              **_width(progress))
    if bar.disable:  # TQDM_DISABLE
        return None
    bar.log = log
    return bar


def _width(progress: Progress) -> dict[str, Any]:
    """On a terminal, follow its width; one that reports none (a pty nobody sized, where
    tqdm would draw an empty line) gets a line of 120 columns."""
    if not progress.tty:
        return {}
    return {"dynamic_ncols": True} if _columns(progress.stream) > 0 else {"ncols": 120, "nrows": 20}


def _columns(stream: TextIO) -> int:
    """The terminal's width, 0 if it reports none."""
    try:
        return os.get_terminal_size(stream.fileno()).columns
    except (AttributeError, OSError, ValueError):
        return 0


class _Lines:
    """A log's view of tqdm's redraws: each ``"\\r" + line`` becomes ``line + "\\n"``."""

    def __init__(self, stream: TextIO) -> None:
        self.stream = stream

    def write(self, text: str) -> None:
        for line in text.replace("\n", "\r").split("\r"):
            if line.strip():
                self.stream.write(line.rstrip() + "\n")

    def flush(self) -> None:
        self.stream.flush()
