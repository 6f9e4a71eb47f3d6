"""Which rank waits on data, and why: a cross-rank summary of every rank's StreamStats.

Invariants:
- one ``all_gather`` (core/collective.py) of each rank's :class:`~wds_pad.stream.stats.StreamStats`
  over the job's group per report (the collective the agreement check uses); without an
  initialised process group, or with one rank, a report of this rank alone;
- every rank gets the same :class:`StallReport`: the slowest rank (most ``wait_s``) against
  the median, and its cause: the stage where it exceeds the median rank the most, with the
  shard it waited on longest when the cause is GETs or the cache;
- :class:`StallReporter` reports every ``every`` batches (a collective: every rank must
  reach it, so only under the lockstep policies) and when an iteration ends, each time on
  the interval since the last report; it keeps each report's per-rank wait for
  :meth:`StallReporter.plot`;
- the adapters are duck-typed: any ``logging.Logger``-like ``log`` and any writer with
  TensorBoard's ``add_scalar(tag, value, step)``; matplotlib only for the picture.
"""

from __future__ import annotations

import logging
import os
import statistics
from dataclasses import dataclass, fields, replace
from typing import Any, Iterator

from ..core.collective import all_gather
from ..errors import ConfigError
from ..io.redact import redact
from .stats import STAGES, StreamStats

__all__ = ["StallReport", "StallReporter", "gather_stats", "log_report", "stall_report", "tensorboard_report"]

CAUSES = {"get_s": "GETs", "cache_wait_s": "the shard cache", "tar_s": "tar/member work",
          "collate_s": "collation", "transport_s": "worker transport"}


def gather_stats(stats: StreamStats, group: Any = None) -> tuple[StreamStats, ...]:
    """Every rank's stats, in rank order (a collective over ``group`` when one is running)."""
    gathered = all_gather(stats.as_dict(), group)
    if gathered is None:
        return (stats,)
    return tuple(sorted((StreamStats(**g) for g in gathered), key=lambda s: s.rank))


def _since(now: StreamStats, before: StreamStats | None) -> StreamStats:
    """The counts of ``now`` since ``before`` (the slowest shard stays the cumulative one)."""
    if before is None:
        return now
    moved = {f.name: getattr(now, f.name) - getattr(before, f.name) for f in fields(StreamStats)
             if f.name not in ("rank", "slowest_shard", "slowest_shard_s")}
    return replace(now, **moved)


@dataclass(frozen=True)
class StallReport:
    """The ranks' data time at one report, and who waits most.

    Attributes:
        step: batches this rank had received at the report.
        ranks: each rank's StreamStats over the interval reported, in rank order.
        slowest: the rank that waited longest.
        ratio: its wait over the median rank's (1.0 when nobody waited).
        cause: the stage it exceeds the median in most (``get_s``, ``cache_wait_s``, ...).
        shard: the shard it waited on longest, when the cause is GETs or the cache ("" else).
        text: one line for people: "rank 1 waits 10.2x the median (...), on GETs to ...".
    """

    step: int
    ranks: tuple[StreamStats, ...]
    slowest: int
    ratio: float
    cause: str
    shard: str
    text: str

    @classmethod
    def of(cls, ranks: tuple[StreamStats, ...], step: int) -> "StallReport":
        """The report of gathered stats (pure: no collective)."""
        waits = [s.wait_s for s in ranks]
        median = statistics.median(waits)
        worst = max(ranks, key=lambda s: s.wait_s)
        ratio = worst.wait_s / median if median > 0 else (float("inf") if worst.wait_s > 0 else 1.0)
        excess = {k: getattr(worst, k) - statistics.median(getattr(s, k) for s in ranks) for k in STAGES}
        inside = {k: v for k, v in excess.items() if k != "transport_s"}  # what the workers did, first
        cause = max(inside, key=inside.__getitem__)
        if inside[cause] <= 0:
            cause = max(excess, key=excess.__getitem__)
        shard = worst.slowest_shard if cause in ("get_s", "cache_wait_s") else ""
        what = CAUSES[cause] + (f" to {redact(shard)} ({worst.slowest_shard_s:.3g} s)" if shard else "")
        text = (f"rank {worst.rank} waits {ratio:.1f}x the median ({worst.wait_s:.3g} s vs {median:.3g} s "
                f"over {len(ranks)} ranks), on {what}")
        return cls(step, ranks, worst.rank, ratio, cause, shard, text)


def log_report(report: StallReport, log: Any, level: int = logging.INFO) -> None:
    """The report's line at ``level``, then one line per rank (wait, GETs, bytes, stages)."""
    log.log(level, "data stalls at step %d: %s", report.step, report.text)
    for s in report.ranks:
        stages = ", ".join(f"{k[:-2]} {v:.3g} s" for k, v in s.stages.items())
        log.log(level, "  rank %d: wait %.3g s, %d GETs, %d bytes, %d cache hits; %s",
                s.rank, s.wait_s, s.gets, s.bytes_read, s.cache_hits, stages)


def tensorboard_report(report: StallReport, writer: Any, step: int | None = None) -> None:
    """Scalars to a TensorBoard-like ``writer`` (``add_scalar(tag, value, step)``):
    ``data/wait_s/rankR`` and ``data/STAGE/rankR`` per rank, ``data/wait_over_median``
    and ``data/slowest_rank``."""
    at = report.step if step is None else step
    for s in report.ranks:
        writer.add_scalar(f"data/wait_s/rank{s.rank}", s.wait_s, at)
        for k, v in s.stages.items():
            writer.add_scalar(f"data/{k}/rank{s.rank}", v, at)
    if report.ratio != float("inf"):
        writer.add_scalar("data/wait_over_median", report.ratio, at)
    writer.add_scalar("data/slowest_rank", report.slowest, at)


class StallReporter:
    """Iterates ``source`` (a Loader or BucketedWebDataset) and reports data stalls across
    ranks every ``every`` batches and at the end of each iteration.

    Args:
        source: what the training loop iterates; its ``stats()`` are reported.
        every: batches between reports (None: only when an iteration ends). Each report
            is a collective: with ``every``, every rank must receive the same number of
            batches (the ``cyclic`` and ``drop`` policies).
        log: a logger the reports go to (:func:`log_report`), or None.
        writer: a TensorBoard ``SummaryWriter`` (anything with ``add_scalar``), or None.
        group: the torch.distributed group (default: the dataset's).
    """

    def __init__(self, source: Any, every: int | None = None, *, log: Any = None, writer: Any = None,
                 group: Any = None) -> None:
        if every is not None and (isinstance(every, bool) or not isinstance(every, int) or every < 1):
            raise ConfigError(f"stall_report(every=...) must be a positive number of batches or None, got {every!r}")
        if not callable(getattr(source, "stats", None)):
            raise ConfigError(f"stall_report needs a wds_pad Loader or BucketedWebDataset, got {type(source).__name__}")
        dataset = getattr(source, "dataset", source)
        self.source, self.every, self.log, self.writer = source, every, log, writer
        self.group = group if group is not None else getattr(dataset, "group", None)
        self.reports: list[StallReport] = []
        self._step = 0
        self._last: StreamStats | None = None

    def __iter__(self) -> Iterator[Any]:
        since = 0
        for batch in self.source:
            yield batch
            self._step, since = self._step + 1, since + 1
            if self.every is not None and since == self.every:
                self.report()
                since = 0
        if since or self.every is None:
            self.report()

    def __len__(self) -> int:
        return len(self.source)

    def report(self) -> StallReport:
        """Gather every rank's stats since the last report (a collective), then log,
        write and keep the report."""
        now = self.source.stats()
        ranks = gather_stats(_since(now, self._last), self.group)
        self._last = now
        report = StallReport.of(ranks, self._step)
        self.reports.append(report)
        if self.log is not None:
            log_report(report, self.log)
        if self.writer is not None:
            tensorboard_report(report, self.writer)
        return report

    def plot(self, path: str) -> str:
        """A picture of each rank's wait per report interval over steps (PNG unless the
        name says another format matplotlib writes); the file written."""
        try:
            import matplotlib

            matplotlib.use("Agg")
            import matplotlib.pyplot as plt
        except ImportError as exc:
            raise ConfigError("StallReporter.plot needs matplotlib: pip install 'wds-pad[plot]' "
                              "(or pip install matplotlib)") from exc
        path = path if os.path.splitext(path)[1] else f"{path}.png"
        fig, ax = plt.subplots(figsize=(7, 3.8))
        steps = [r.step for r in self.reports]
        for rank in sorted({s.rank for r in self.reports for s in r.ranks}):
            ax.plot(steps, [next((s.wait_s for s in r.ranks if s.rank == rank), float("nan")) for r in self.reports],
                    marker="o", label=f"rank {rank}")
        ax.set_xlabel("step (batches received)")
        ax.set_ylabel("seconds waiting on data, per interval")
        last = self.reports[-1].text if self.reports else "no report yet"
        ax.set_title(last, fontsize=8)
        ax.legend(fontsize=8, loc="best")
        fig.tight_layout()
        tmp = f"{path}.tmp-{os.getpid()}"
        try:  # written whole or not at all
            fig.savefig(tmp, dpi=110, format=os.path.splitext(path)[1][1:].lower())
            os.replace(tmp, path)
        except (OSError, RuntimeError, ValueError) as exc:
            raise ConfigError(f"StallReporter.plot({path!r}): cannot write the image: {exc}") from exc
        finally:
            plt.close(fig)
            if os.path.exists(tmp):
                os.unlink(tmp)
        return path


def stall_report(source: Any, every: int | None = None, *, log: Any = None, writer: Any = None,
                 group: Any = None) -> StallReporter:
    """``source`` wrapped to report data stalls across ranks (:class:`StallReporter`)."""
    return StallReporter(source, every, log=log, writer=writer, group=group)
