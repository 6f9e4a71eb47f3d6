"""A small thread-safe progress bar on stderr: items done, rates (shards/s, samples/s, MB/s).

Shown when enabled (default: only when stderr is a terminal); on a terminal it redraws
one line, elsewhere it prints a line at most every few seconds. Never touches stdout.
"""

from __future__ import annotations

import sys
import threading
import time
from typing import TextIO


class Progress:
    """Counts shards, samples and bytes; draws ``label [####   ] 3/8 shards  ...``."""

    def __init__(self, total: int, *, enabled: bool | None = None, label: str = "",
                 stream: TextIO | None = None, interval: float = 0.2) -> None:
        self.stream = stream or sys.stderr
        self.tty = bool(getattr(self.stream, "isatty", lambda: False)())
        self.enabled = self.tty if enabled is None else bool(enabled)
        self.total, self.label = total, label
        self.shards = self.samples = self.nbytes = 0
        self.interval = interval if self.tty else max(interval, 5.0)
        self._start = self._last = time.monotonic()
        self._drawn_final = False
        self._lock = threading.Lock()

    def advance(self, *, shards: int = 0, samples: int = 0, nbytes: int = 0) -> None:
        with self._lock:
            self.shards += shards
            self.samples += samples
            self.nbytes += nbytes
            now = time.monotonic()
            if self.enabled and (now - self._last >= self.interval or (shards and self.shards == self.total)):
                self._last = now
                self._draw(now)
                self._drawn_final = self.shards == self.total

    def line(self, now: float | None = None) -> str:
        elapsed = max((now or time.monotonic()) - self._start, 1e-9)
        width = 24
        filled = int(width * self.shards / self.total) if self.total else width
        return (f"{self.label} [{'#' * filled}{' ' * (width - filled)}] {self.shards}/{self.total} shards"
                f"  {self.shards / elapsed:.1f} shards/s  {self.samples / elapsed:,.0f} samples/s"
                f"  {self.nbytes / elapsed / 1e6:.1f} MB/s")

    def _draw(self, now: float) -> None:
        end = "\r" if self.tty else "\n"
        self.stream.write(self.line(now) + end)
        self.stream.flush()

    def close(self) -> None:
        if self.enabled:
            with self._lock:
                if not self._drawn_final:
                    self._draw(time.monotonic())
                if self.tty:
                    self.stream.write("\n")
                self.stream.flush()
