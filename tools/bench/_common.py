"""What the benchmark scripts in tools/bench/ share: options, timers, CPU clocks, peak memory, tables.

The scripts are runnable files outside the package (``python tools/bench/NAME.py``); each
imports this module as ``_common`` before anything of ``wds_pad`` (the script's own
folder is on ``sys.path`` when it runs). Importing it puts the repository root and
``tools/`` on ``sys.path``, so a script runs from a fresh clone without an install and
can import ``servers`` and ``faultproxy``.

Invariants:
- a timer keeps the fastest of its runs, the one least disturbed by other processes;
  :func:`round_robin` runs its contenders in turn, so a load spike on a shared machine
  hits one repetition of every contender rather than every repetition of one;
- a timing's CPU seconds come from the one clock its caller names:
  ``time.process_time`` (this process, all its threads) or :func:`cpu_seconds` (that
  plus its children that have exited: DataLoader workers, curl); reading a clock is
  never inside the wall-clock window;
- the garbage collector is off only inside :func:`steady`'s window, and always on again
  after it;
- :class:`PeakRss` measures a block's extra peak RSS over the process's RSS at entry (the
  kernel's high-water mark, reset at entry), never tracemalloc's view of it;
- a :class:`Columns` table declares each column's width once; its header and rows
  print exactly as the format spec says (a cell wider than its column widens it).
"""

from __future__ import annotations

import argparse
import gc
import os
import re
import resource
import sys
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Callable, Mapping, Sequence

TOOLS = Path(__file__).resolve().parents[1]
for _path in (str(TOOLS), str(TOOLS.parent)):  # tools/ (servers, faultproxy), the repo root
    if _path not in sys.path:
        sys.path.insert(1, _path)  # after the script's own folder

Clock = Callable[[], float]

# -- options --------------------------------------------------------------------------


def parser(doc: str | None) -> argparse.ArgumentParser:
    """An argument parser described by the first line of a script's docstring."""
    return argparse.ArgumentParser(description=(doc or "").split("\n")[0])


def add_repeat(p: argparse.ArgumentParser, default: int, help: str | None = None) -> None:  # noqa: A002
    """``--repeat N``: how many timed runs each contender gets (the best is kept)."""
    p.add_argument("--repeat", type=int, default=default, help=help)


def add_dir(p: argparse.ArgumentParser, help: str | None = None) -> None:  # noqa: A002
    """``--dir DIR``: where the script writes its shards (None: the system's temp dir)."""
    p.add_argument("--dir", default=None, help=help)


def add_producer(p: argparse.ArgumentParser, default: str = "webdataset") -> None:
    """``--producer NAME``: what writes the synthetic shards' tar bytes (``wds_pad.cli.synth.PRODUCERS``).

    ``webdataset`` (the default) is what ``wds.TarWriter`` writes, a pax header before
    every member, as most real WebDataset shards are; ``tarfile-ustar`` gives plain
    ustar headers.
    """
    from wds_pad.cli.synth import PRODUCERS

    p.add_argument("--producer", default=default, choices=PRODUCERS,
                   help=f"what writes the shards' tar bytes (default: {default}, wds.TarWriter's "
                        "pax headers; tarfile-ustar: plain ustar headers)")


def add_sizes(p: argparse.ArgumentParser, producer: str = "webdataset") -> None:
    """``--dir``, ``--small``, ``--large``, ``--repeat``, ``--producer``: the two sample sizes
    (~10 KB, ~500 KB) of the benchmarks over local shards, and what writes the shards
    (``producer``: the default of ``--producer``)."""
    add_dir(p, help="where to write the shards (default: a temp dir, removed after)")
    p.add_argument("--small", type=int, default=20_000, help="samples of ~10 KB")
    p.add_argument("--large", type=int, default=1_000, help="samples of ~500 KB")
    add_repeat(p, 3)
    add_producer(p, producer)


def case_shards(root: str, label: str, samples: int, sample_bytes: int, shards: int,
                producer: str = "webdataset") -> list[str]:
    """``make_blob_shards`` output for one case (``"10 KB"``) written by ``producer``, in
    ``root/10KB-<producer>``; their paths."""
    from wds_pad.cli.synth import make_blob_shards

    return make_blob_shards(os.path.join(root, f"{label.replace(' ', '')}-{producer}"), samples=samples,
                            sample_bytes=sample_bytes, shards=shards, producer=producer)


# -- clocks and timers ----------------------------------------------------------------


def cpu_seconds() -> float:
    """CPU time of this process (all threads) and of its children that have exited."""
    own, kids = resource.getrusage(resource.RUSAGE_SELF), resource.getrusage(resource.RUSAGE_CHILDREN)
    return own.ru_utime + own.ru_stime + kids.ru_utime + kids.ru_stime


@dataclass(frozen=True)
class Timing:
    """Wall and CPU seconds of one measurement, and what the timed call returned."""

    wall: float
    cpu: float
    result: Any = None


def once(fn: Callable[[], Any], cpu: Clock = time.process_time) -> Timing:
    """One call of ``fn``: its wall seconds, its CPU seconds by ``cpu``, its result."""
    c = cpu()
    t = time.perf_counter()
    result = fn()
    wall = time.perf_counter() - t
    return Timing(wall, cpu() - c, result)


def steady(fn: Callable[[], Any], at_least: float = 0.05, cpu: Clock = time.process_time) -> Timing:
    """One call's seconds in its steady state: ``fn`` repeated back to back, averaged.

    As ``timeit`` does, the call repeats until ``at_least`` seconds have passed and the
    garbage collector is off meanwhile: a contender that takes 5 ms is then measured in
    its steady state, as when it runs many times over, rather than by the CPU cache
    misses of its first microseconds, and nobody pays for collecting another
    contender's garbage. CPU time measures the work even when other processes compete
    for the cores (wall time then mostly measures the competition); reads from the page
    cache are system CPU time and count too.
    """
    gc.disable()
    try:
        calls = 0
        c, w = cpu(), time.perf_counter()
        while True:
            result = fn()
            calls += 1
            if time.perf_counter() - w >= at_least:
                break
        return Timing((time.perf_counter() - w) / calls, (cpu() - c) / calls, result)
    finally:
        gc.enable()


def best_of(repeat: int, fn: Callable[[], Any], cpu: Clock = time.process_time) -> Timing:
    """The fastest by wall time of ``repeat`` runs of ``fn`` one after another (see :func:`once`)."""
    return min((once(fn, cpu) for _ in range(repeat)), key=lambda t: (t.wall, t.cpu))


def round_robin(contenders: Mapping[str, Callable[[], Any]], repeat: int,
                timer: Callable[[Callable[[], Any]], Timing] = once,
                check: Callable[[str, Any], None] | None = None) -> dict[str, Timing]:
    """Every contender timed by ``timer``, in turn, ``repeat`` times over.

    Returns, per contender, its least wall and its least CPU seconds (each the minimum
    over the repetitions, taken separately). Results are not kept: ``check(name, result)``
    sees each as it comes (to stop a run that counted wrong), and the next contender
    runs without it alive.
    """
    best = {name: Timing(float("inf"), float("inf")) for name in contenders}
    for _ in range(repeat):
        for name, fn in contenders.items():
            t = timer(fn)
            if check is not None:
                check(name, t.result)
            best[name] = Timing(min(best[name].wall, t.wall), min(best[name].cpu, t.cpu))
            del t
    return best


# -- tables ---------------------------------------------------------------------------


def table(headers: Sequence[str], rows: Sequence[Sequence[Any]], align: str = "") -> str:
    """Columns as wide as their widest cell: the table the ``wds-pad`` commands print."""
    from wds_pad.cli.common import format_table

    return format_table(headers, rows, align=align)


class Columns:
    """A fixed-width table: one ``str.format`` field per column, e.g. ``"{:>10}  {:<6}"``.

    Cells are formatted before they are given (``f"{x:.3f}"``); a row may stop before the
    last column.
    """

    def __init__(self, spec: str) -> None:
        self._fields = re.findall(r"([^{]*)(\{[^}]*\})", spec)

    def line(self, *cells: Any) -> str:
        """One row (or the header: the column names as cells)."""
        return "".join(lead + field.format(cell) for (lead, field), cell in zip(self._fields, cells))

    def header(self, *names: str) -> str:
        """The header line and under it a rule of dashes as long."""
        head = self.line(*names)
        return head + "\n" + "-" * len(head)



# -- memory and subprocesses ---------------------------------------------------------


def _status_kb(field: str, pid: int | str = "self") -> int:
    """A ``/proc/PID/status`` field in kB (``VmRSS``, ``VmHWM``), or -1 off Linux."""
    try:
        with open(f"/proc/{pid}/status") as f:
            for line in f:
                if line.startswith(field + ":"):
                    return int(line.split()[1])
    except OSError:
        pass
    return -1


class PeakRss:
    """Extra peak RSS of this process inside a ``with`` block, over its RSS at entry, in MB.

    On Linux the peak (``VmHWM``) is reset to the current RSS at entry by writing ``5``
    to ``/proc/self/clear_refs``, so ``extra_mb`` is the block's own high-water mark above
    what the process held before it (the interpreter, the imports). Elsewhere, or when
    the reset is refused, it falls back to ``ru_maxrss`` after minus before, which
    undercounts when an earlier peak was higher; ``method`` says which was used.
    Resident pages of memory-mapped files the block touches count, as they do in RSS.
    """

    def __enter__(self) -> "PeakRss":
        gc.collect()
        try:
            with open("/proc/self/clear_refs", "w") as f:
                f.write("5")
            self.method = "VmHWM"
            self._base = _status_kb("VmRSS")
        except OSError:
            self.method = "ru_maxrss"
            self._base = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
        self.extra_mb = 0.0
        return self

    def __exit__(self, *exc: Any) -> None:
        peak = _status_kb("VmHWM") if self.method == "VmHWM" else resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
        self.extra_mb = max(0, peak - self._base) / 1024


def smaps_rollup_mb(pid: int) -> dict[str, float]:
    """``/proc/PID/smaps_rollup`` in MB: ``Rss``, ``Pss``, ``Pss_Anon``, ``Pss_File``, ... (empty off Linux)."""
    out: dict[str, float] = {}
    try:
        with open(f"/proc/{pid}/smaps_rollup") as f:
            for line in f:
                parts = line.split()
                if len(parts) == 3 and parts[2] == "kB":
                    out[parts[0].rstrip(":")] = int(parts[1]) / 1024
    except OSError:
        pass
    return out


def mapping_mb(pid: int, path: str) -> dict[str, float]:
    """``Rss`` and ``Pss`` in MB of the mappings of file ``path`` in process ``pid`` (summed)."""
    real = os.path.realpath(path)
    out = {"Rss": 0.0, "Pss": 0.0}
    inside = False
    try:
        with open(f"/proc/{pid}/smaps") as f:
            for line in f:
                head = line.split()
                if head and "-" in head[0] and len(head) >= 5 and not head[0].endswith(":"):
                    inside = len(head) >= 6 and head[5] == real
                elif inside and head and head[0] in ("Rss:", "Pss:"):
                    out[head[0][:-1]] += int(head[1]) / 1024
    except OSError:
        pass
    return out


def run_json(cmd: Sequence[str], *, env: Mapping[str, str] | None = None, timeout: float = 600,
             cwd: str | None = None) -> dict[str, Any]:
    """Run ``cmd`` and return the JSON object on the last line of its stdout.

    A failure (non-zero exit, timeout, no JSON) returns ``{"error": "..."}`` with the
    last line of its stderr, so a table can say where a peer stopped instead of dying.
    """
    import json
    import subprocess

    try:
        out = subprocess.run(list(cmd), capture_output=True, text=True, timeout=timeout, env=env, cwd=cwd)
    except subprocess.TimeoutExpired:
        return {"error": f"timed out after {timeout:.0f} s"}
    lines = out.stdout.strip().splitlines()
    if out.returncode != 0 or not lines:
        tail = (out.stderr.strip().splitlines() or [f"exit {out.returncode}"])[-1]
        return {"error": f"exit {out.returncode}: {tail[:200]}"}
    return json.loads(lines[-1])  # type: ignore[no-any-return]
