"""What the ``wds-pad`` commands share: usage errors, argument parsers, interrupts,
tables and the bucket plot.

Every command module imports from here; this module imports no command and not
:mod:`wds_pad.cli.app`. It starts fast: nothing here imports numpy, torch or
matplotlib at import time (the plot imports matplotlib when it draws).

Invariants:
- a usage error is raised as :class:`_UsageError` with its whole line
  (``wds-pad <cmd>: error: ...``) and exits with :data:`EXIT_USAGE` (2);
- advice the library words for Python (``on_error='skip'``) is printed in the CLI's
  spelling (``--on-error skip``) by :func:`cli_wording`;
- an integer option the library also checks (seed, epoch) accepts exactly the values
  the API accepts, with the API's message;
- an interrupt exits 130 (Ctrl-C) or 143 (SIGTERM, raised as :class:`Terminated`);
- tables and reports go to the stream they are given, never to stderr on their own;
- tables and plots list aspect buckets by ratio (:func:`bucket_order`), never as strings.
"""

from __future__ import annotations

import argparse
import re
import signal
from typing import Any, Callable, Hashable, Iterable, Sequence

from ..errors import ConfigError

EXIT_USAGE = 2
EXIT_SIGINT = 128 + signal.SIGINT
EXIT_SIGTERM = 128 + signal.SIGTERM

_SHOW = 5  # excluded samples / skipped shards listed in reports


# -- usage errors and interrupts -------------------------------------------------------
class _UsageError(Exception):
    pass


def _usage(cmd: str, message: str) -> _UsageError:
    return _UsageError(f"wds-pad {cmd}: error: {message}")


class Terminated(KeyboardInterrupt):
    """SIGTERM, raised in the main thread the way Ctrl-C raises KeyboardInterrupt.

    A KeyboardInterrupt, so everything that cleans up after Ctrl-C (temp files, the
    progress bar) does the same after SIGTERM.
    """


def interrupt_exit(exc: KeyboardInterrupt) -> tuple[int, str]:
    """(exit status, what happened) for an interrupt: 143 for SIGTERM, 130 for Ctrl-C."""
    if isinstance(exc, Terminated):
        return EXIT_SIGTERM, "terminated (SIGTERM)"
    return EXIT_SIGINT, "interrupted"


#: the library's advice names Python arguments; a CLI user is told the option instead
#: (the longer spelling first: some messages name both)
_CLI_SPELLINGS = (("on_error='skip' (--on-error skip)", "--on-error skip"),
                  ("on_error='skip'", "--on-error skip"))


def cli_wording(message: str) -> str:
    """An error message as the CLI prints it: advice in the CLI's own spelling
    (``--on-error skip``, not ``on_error='skip'``)."""
    for python, option in _CLI_SPELLINGS:
        message = message.replace(python, option)
    return message


# -- argument parsers ------------------------------------------------------------------
def _int_at_least(minimum: int, what: str, text: str) -> int:
    try:
        value = int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected {what}, got {text!r}") from None
    if value < minimum:
        raise argparse.ArgumentTypeError(f"expected {what}, got {value}")
    return value


def _positive(text: str) -> int:
    return _int_at_least(1, "a positive integer", text)


def _non_negative(text: str) -> int:
    return _int_at_least(0, "an integer >= 0", text)


def _positive_number(text: str) -> float:
    """A finite number > 0 (a budget: ``8192``, ``1.5e6``)."""
    import math

    try:
        value = float(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected a number > 0, got {text!r}") from None
    if not math.isfinite(value) or value <= 0:
        raise argparse.ArgumentTypeError(f"expected a finite number > 0, got {text!r}")
    return value


def _library_int(check: Callable[[Any], int], what: str, text: str) -> int:
    """Parse ``text`` as an int and validate it with the library's own ``check``.

    The CLI and the API then accept exactly the same values: one rule, one message.
    """
    try:
        value = int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"{what} must be an integer, got {text!r}") from None
    try:
        return check(value)
    except ConfigError as exc:
        raise argparse.ArgumentTypeError(str(exc)) from None


def _seed_arg(text: str) -> int:
    from ..core.seed import check_seed

    return _library_int(check_seed, "seed", text)


def _epoch_arg(text: str) -> int:
    from ..core.policy import check_epoch

    return _library_int(check_epoch, "epoch", text)


def _relocation_arg(text: str) -> tuple[str, str]:
    old, sep, new = text.partition("=")
    if not sep or not old.strip("/") or not new.strip("/"):
        raise argparse.ArgumentTypeError(f"expected OLD=NEW (two URL or path prefixes), got {text!r}")
    return old, new


def add_relocate(p: argparse.ArgumentParser) -> None:
    """``--relocate OLD=NEW`` (repeatable): shards moved since the index was written."""
    p.add_argument("--relocate", action="append", type=_relocation_arg, default=[], metavar="OLD=NEW",
                   help="shards moved since indexing: read URLs that start with OLD under NEW instead "
                        "(repeatable; shards beside or below the index move with it without this)")


def relocation(args: argparse.Namespace) -> dict[str, str] | None:
    """The ``--relocate`` pairs as the mapping ``load_index(relocate=...)`` takes, or None."""
    pairs = getattr(args, "relocate", None) or []
    return dict(pairs) if pairs else None


# -- tables and reports ----------------------------------------------------------------
_RATIO = re.compile(r"\s*(\d+(?:\.\d+)?)\s*:\s*(\d+(?:\.\d+)?)\s*")


def _ratio(key: Any) -> float | None:
    """``"16:9"`` -> 16/9; None for a key that is not ``W:H`` with positive numbers."""
    m = _RATIO.fullmatch(key) if isinstance(key, str) else None
    if m is None or float(m[2]) == 0:
        return None
    return float(m[1]) / float(m[2])


def bucket_order(keys: Iterable[Hashable]) -> list[Hashable]:
    """Bucket keys in the order tables and plots show them.

    Aspect keys are strings (``"16:9"``): where every key parses as ``W:H`` they are
    sorted by their ratio (1:2 < 9:16 < 1:1 < 16:9, equal ratios as given), not as
    strings; otherwise the keys keep the order given (the index's canonical order).
    """
    keys = list(keys)
    ratios = [_ratio(k) for k in keys]
    if not keys or any(r is None for r in ratios):
        return keys
    return [k for _, _, k in sorted(zip(ratios, range(len(keys)), keys))]  # type: ignore[type-var]


def format_table(headers: Sequence[str], rows: Sequence[Sequence[Any]], align: str = "") -> str:
    """A plain-text table: left-aligned text, right-aligned numbers."""
    cells = [[str(c) for c in row] for row in rows]
    widths = [max([len(h)] + [len(r[i]) for r in cells]) for i, h in enumerate(headers)]
    align = align or "".join("l" if not rows or isinstance(rows[0][i], str) else "r"
                             for i in range(len(headers)))

    def line(values: Sequence[str]) -> str:
        return "  ".join(v.ljust(w) if a == "l" else v.rjust(w)
                         for v, w, a in zip(values, widths, align)).rstrip()

    rule = "  ".join("-" * w for w in widths)
    return "\n".join([line(headers), rule] + [line(r) for r in cells])


def _print_summary(plan: Any, out: Any, *, all_ranks: bool = False) -> None:
    """A plan's per-bucket table (``plan --summary``, the demo); ``all_ranks``: the
    table stands for every rank (``--rank all``), and its last line says so."""
    topo = plan.topology
    rows = []
    for s in _stats_in_order(plan.stats):
        status = "empty" if s.samples == 0 else ("dropped" if s.dropped else
                                                  ("oversubscribed" if s.oversubscribed else "kept"))
        pct = f"{100 * s.padded_fraction:.1f}%"
        rows.append([s.dataset, str(s.bucket), s.samples, s.repeats, s.padded_length,
                     s.padded_copies, pct, s.truncated, status, s.steps])
    headers = ["dataset", "bucket", "samples", "repeats", "padded len", "pad copies", "pad %",
               "truncated", "status", "steps/epoch"]
    if plan.budget is not None:  # batches by cost: a stratum (one sample per DP rank) is the pad unit
        size = f"budget {plan.budget.limit:g} ({plan.budget.model.value})"
        unit = topo.dp_size
    else:
        size = f"batch {plan.batch_size}"
        unit = plan.pad_to.unit(topo.dp_size, plan.batch_size) * plan.accumulation
    accumulation = f", accumulation {plan.accumulation}" if plan.accumulation > 1 else ""
    out.write(f"epoch {plan.epoch}: world_size {topo.world_size}, dp_size {topo.dp_size}, "
              f"cp_size {topo.cp_size}, {size}, policy {plan.policy.value}, pad unit {unit}{accumulation}\n")
    out.write(format_table(headers, rows, align="llrrrrrrlr") + "\n")
    total = sum(s.samples for s in plan.stats)
    padded = sum(s.padded_copies for s in plan.stats)
    dropped = sum(s.samples for s in plan.stats if s.dropped)
    out.write(f"total: {total} samples, {padded} padded copies, {dropped} samples in dropped buckets, "
              f"{plan.steps} steps per epoch, {_batches_per_rank(plan, all_ranks)}\n")


def _locality_arg(text: str) -> str:
    """``--locality``: any value of the library's ``Locality``, with its message otherwise."""
    from ..core.locality import Locality
    from ..core.policy import _enum

    try:
        return str(_enum(Locality, text, "locality").value)
    except ConfigError as exc:
        raise argparse.ArgumentTypeError(str(exc)) from None


def check_node_layout(cmd: str, args: argparse.Namespace) -> None:
    """A usage error, in flags, when ``--local-world-size`` (with ``--world-size``,
    ``--cp-size`` and ``--locality node``) is no node layout: the rule is the topology's
    (``Topology.dp_ranks_per_node``), the words are the command line's."""
    import re

    from ..core.topology import Topology
    from ..errors import TopologyError

    if args.local_world_size is None:
        if args.locality == "node":
            raise _usage(cmd, "--locality node needs --local-world-size L, the processes each node runs "
                              "(torchrun's --nproc-per-node): the shards are dealt to nodes")
        return
    try:
        topology = Topology(world_size=args.world_size, rank=0, cp_size=args.cp_size,
                            local_world_size=args.local_world_size)
        if args.locality == "node":
            topology.dp_ranks_per_node  # noqa: B018 - raises when the node layout and CP do not line up
    except TopologyError as exc:
        flags = re.sub(r"\b(local_world_size|world_size|cp_size)\b",
                       lambda m: "--" + m.group(1).replace("_", "-"), str(exc))
        raise _usage(cmd, flags) from None


def _batches_per_rank(plan: Any, all_ranks: bool) -> str:
    """How many batches this plan gives, said of the ranks it stands for.

    Every rank of a plan gets exactly as many batches (invariant 1), so one plan
    speaks for all ranks when the table is about all of them.
    """
    if all_ranks:
        world = plan.topology.world_size
        return f"{len(plan)} batches on every one of the {world} ranks"
    return f"{len(plan)} batches on rank {plan.topology.rank}"


def _stats_in_order(stats: Sequence[Any]) -> list[Any]:
    """A plan's bucket stats, datasets as planned, buckets of each by :func:`bucket_order`."""
    order = {k: i for i, k in enumerate(bucket_order(dict.fromkeys(s.bucket for s in stats)))}
    datasets = list(dict.fromkeys(s.dataset for s in stats))
    return sorted(stats, key=lambda s: (datasets.index(s.dataset), order[s.bucket]))


def _nbytes(n: float) -> str:
    for unit in ("B", "KB", "MB", "GB", "TB"):
        if abs(n) < 1000 or unit == "TB":
            return f"{n:.0f} {unit}" if unit == "B" else f"{n:.1f} {unit}"
        n /= 1000
    return f"{n:.1f} TB"  # pragma: no cover


def _plural(n: int, word: str) -> str:
    return f"{n} {word}" if n == 1 else f"{n} {word}s"


def _short_reason(url: str, reason: str) -> str:
    """A skip reason without the URL it is listed under, nor the advice to use skip."""
    reason = reason[len(url) + 2 :] if reason.startswith(f"{url}: ") else reason
    head, sep, hint = reason.rpartition("; ")
    return head if sep and "on_error='skip'" in hint else reason


def _report_excluded(index: Any, out: Any) -> None:
    """The skipped shards and excluded samples, with reasons (the first few)."""
    shards = list(index.excluded.get("shards", []))
    samples = list(index.excluded.get("samples", []))
    count = int(index.excluded.get("count", len(samples)))
    if shards:
        out.write(f"skipped {_plural(len(shards), 'shard')} (on error: skip):\n")
        for s in shards[:_SHOW]:
            kept = s.get("samples_kept", 0)
            note = f" [{_plural(kept, 'sample')} before the fault kept]" if kept else ""
            out.write(f"  {s['url']}: {_short_reason(s['url'], s['reason'])}{note}\n")
        if len(shards) > _SHOW:
            out.write(f"  ... and {len(shards) - _SHOW} more (wds-pad inspect --json INDEX)\n")
    if count:
        out.write(f"excluded {_plural(count, 'sample')}:\n")
        for s in samples[:_SHOW]:
            out.write(f"  {s['key']!r} in {s['url']} at byte offset {s['offset']}: {s['reason']}\n")
        if count > _SHOW:
            out.write(f"  ... and {count - _SHOW} more (wds-pad inspect --json INDEX)\n")


# -- the bucket plot -------------------------------------------------------------------
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


def _plot(index: Any, pad: dict[Hashable, Any] | None, args: argparse.Namespace,
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
