"""``--plot``: the bar chart of an index's buckets (``inspect --plot``, the demo).

Invariants:
- matplotlib is imported only when a plot is checked or drawn, with the Agg backend;
  without it, ``--plot`` is one ConfigError with the install command;
- ``--plot PATH`` is checked (:func:`plot_path`) before anything is loaded;
- buckets are drawn in :func:`~wds_pad.cli.common.bucket_order`.
"""

from __future__ import annotations

import argparse
from typing import Any, Hashable

from ..errors import ConfigError
from .common import bucket_order

__all__ = ["draw_buckets", "plot_path"]


def _plot_reading(ax: Any, reading: dict[str, Any], args: argparse.Namespace) -> None:
    """GETs per epoch of rank 0 for each locality (log scale), split into whole-shard
    blocks and single reads, labelled with the distinct shards per batch."""
    names = list(reading)
    singles = [reading[n].single for n in names]
    blocks = [reading[n].gets - reading[n].single for n in names]
    ax.bar(names, blocks, color="#4c72b0", label="whole-shard GETs")
    ax.bar(names, singles, bottom=blocks, color="#dd8452", label="single-sample GETs")
    for i, n in enumerate(names):
        f = reading[n]
        ax.annotate(f"{f.gets:,} GETs\n{f.distinct_per_batch:.1f} shards/batch",
                    (i, f.gets), ha="center", va="bottom", fontsize=8, xytext=(0, 2), textcoords="offset points")
    ax.set_yscale("log")
    ax.set_ylim(1, max(f.gets for f in reading.values()) * 8)
    ax.set_ylabel("GETs per epoch, rank 0")
    ax.set_title(f"reading cost per locality (window {args.window})", fontsize=10)
    ax.legend(fontsize=8, loc="upper right")


def _matplotlib() -> Any:
    """matplotlib with the Agg backend, or the install advice as a ConfigError."""
    try:
        import matplotlib

        matplotlib.use("Agg")
        return matplotlib
    except ImportError as exc:
        raise ConfigError("--plot needs matplotlib: pip install 'wds-pad[plot]' (or pip install matplotlib)") from exc


def plot_path(path: str) -> str:
    """The file ``--plot PATH`` writes, checked before anything is loaded: its extension
    must be a format matplotlib writes; without one it is PNG, and the name says so.

    Raises:
        ConfigError: matplotlib is missing, or cannot write that format.
    """
    import os

    _matplotlib()
    from matplotlib.backend_bases import FigureCanvasBase

    formats = FigureCanvasBase.get_supported_filetypes()
    stem, ext = os.path.splitext(path)
    if not ext[1:]:
        return f"{path}.png" if not ext else f"{path}png"
    if ext[1:].lower() not in formats:
        listed = ", ".join(f".{f}" for f in sorted(formats))
        raise ConfigError(f"--plot {path!r}: matplotlib cannot write {ext} files; give a file name ending in "
                          f"one of {listed}, e.g. --plot {stem}.png")
    return path


def draw_buckets(index: Any, pad: dict[Hashable, Any] | None, args: argparse.Namespace,
          reading: dict[str, Any] | None = None) -> None:
    """Bar chart of an index's buckets (with ``pad``: kept, padded and dropped) to ``args.plot``;
    with ``reading`` (locality -> LocalityFigures of rank 0) a second panel: what each
    locality costs to read."""
    _matplotlib()
    import matplotlib.pyplot as plt

    unordered = index.bucket_counts()
    counts = {k: unordered[k] for k in bucket_order(unordered)}
    labels = [str(k) for k in counts]
    samples = [counts[k] for k in counts]
    width = max(6.0, 0.6 * len(labels) + 2)
    if reading:
        fig, (ax, rx) = plt.subplots(1, 2, figsize=(width + 5, 4.2), gridspec_kw={"width_ratios": [width, 5]})
        _plot_reading(rx, reading, args)
    else:
        fig, ax = plt.subplots(figsize=(width, 4.2))
    x = range(len(labels))
    if pad is None:
        bars = ax.bar(x, samples, color="#4c72b0", label="samples")
        ax.bar_label(bars, labels=[f"{n:,}" for n in samples], fontsize=8, padding=2)
        tops = samples
        title = f"{index.name}: {len(index):,} samples in {len(labels)} buckets"
    else:
        kept = [0 if pad[k].dropped else counts[k] * (1 + args.repeats) - pad[k].truncated for k in counts]
        lost = [counts[k] * (1 + args.repeats) - kept[i] for i, k in enumerate(counts)]
        copies = [pad[k].padded_copies for k in counts]
        ax.bar(x, kept, color="#4c72b0", label="samples")
        ax.bar(x, copies, bottom=kept, color="#dd8452", label="padded copies")
        ax.bar(x, lost, bottom=[a + b for a, b in zip(kept, copies)], color="#bbbbbb", hatch="//",
               label="dropped / truncated")
        tops = [a + b + c for a, b, c in zip(kept, copies, lost)]
        for i, k in enumerate(counts):
            note = "dropped" if pad[k].dropped else (f"+{copies[i]:,} pad" if copies[i] else "")
            note = note or (f"-{pad[k].truncated:,}" if pad[k].truncated else "")
            ax.annotate(note, (i, tops[i]), ha="center", va="bottom", fontsize=8,
                        xytext=(0, 2), textcoords="offset points")
        title = (f"{index.name}: {len(index):,} samples, padding for world {args.world_size}, "
                 f"cp {args.cp_size}, batch {args.batch_size} ({args.pad})")
        ax.legend(fontsize=8, loc="best")
    ax.set_xticks(list(x), labels, rotation=45 if len(labels) > 8 else 0, ha="right" if len(labels) > 8 else "center")
    ax.set_xlabel(f"bucket ({index.bucket_by.get('kind', '?')})")
    ax.set_ylabel("samples per epoch" if pad is not None else "samples")
    ax.set_title(title, fontsize=10)
    ax.set_ylim(0, max(max(tops, default=0) * 1.15, 1))  # room for the labels above the bars
    fig.tight_layout()
    try:
        fig.savefig(args.plot, dpi=110)
    except (OSError, RuntimeError, ValueError) as exc:  # a folder missing; pgf without LaTeX, ...
        raise ConfigError(f"--plot {args.plot!r}: cannot write the image: {exc}") from exc
    finally:
        plt.close(fig)
