"""What the ``wds-pad`` commands share: usage errors, argument parsers, interrupts
and tables (the bucket plot is :mod:`wds_pad.cli.plot`).

Every command module imports from here; this module imports no command and not
:mod:`wds_pad.cli.app`. It starts fast: nothing here imports numpy, torch or
matplotlib at import time.

Invariants:
- a usage error is raised as :class:`UsageError` with its whole line
  (``wds-pad <cmd>: error: ...``) and exits with :data:`EXIT_USAGE` (2);
- advice the library words for Python (``on_error='skip'``) is printed in the CLI's
  spelling (``--on-error skip``) by :func:`cli_wording`;
- an integer option the library also checks (seed, epoch) accepts exactly the values
  the API accepts, with the API's message;
- an interrupt exits 130 (Ctrl-C) or 143 (SIGTERM, raised as :class:`Terminated`);
- tables and reports go to the stream they are given, never to stderr on their own;
- tables (and the plot) list aspect buckets by ratio (:func:`bucket_order`), never as strings.
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
class UsageError(Exception):
    pass


def usage_error(cmd: str, message: str) -> UsageError:
    return UsageError(f"wds-pad {cmd}: error: {message}")


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
def int_at_least(minimum: int, what: str, text: str) -> int:
    try:
        value = int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected {what}, got {text!r}") from None
    if value < minimum:
        raise argparse.ArgumentTypeError(f"expected {what}, got {value}")
    return value


def positive_int(text: str) -> int:
    return int_at_least(1, "a positive integer", text)


def non_negative(text: str) -> int:
    return int_at_least(0, "an integer >= 0", text)


def positive_number(text: str) -> float:
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


def seed_arg(text: str) -> int:
    from ..core.seed import check_seed

    return _library_int(check_seed, "seed", text)


def epoch_arg(text: str) -> int:
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


def print_summary(plan: Any, out: Any, *, all_ranks: bool = False) -> None:
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
    size = plan.sizing.summary()
    unit = plan.pad_unit
    accumulation = f", accumulation {plan.accumulation_steps}" if plan.accumulation_steps > 1 else ""
    out.write(f"epoch {plan.epoch}: world_size {topo.world_size}, dp_size {topo.dp_size}, "
              f"cp_size {topo.cp_size}, {size}, policy {plan.policy.value}, pad unit {unit}{accumulation}\n")
    out.write(format_table(headers, rows, align="llrrrrrrlr") + "\n")
    total = sum(s.samples for s in plan.stats)
    padded = sum(s.padded_copies for s in plan.stats)
    dropped = sum(s.samples for s in plan.stats if s.dropped)
    out.write(f"total: {total} samples, {padded} padded copies, {dropped} samples in dropped buckets, "
              f"{plan.steps} steps per epoch, {_batches_per_rank(plan, all_ranks)}\n")


def locality_arg(text: str) -> str:
    """``--locality``: any value of the library's ``Locality``, with its message otherwise."""
    from ..core.local.locality import Locality
    from ..core.policy import parse_enum

    try:
        return str(parse_enum(Locality, text, "locality").value)
    except ConfigError as exc:
        raise argparse.ArgumentTypeError(str(exc)) from None


def check_node_layout(cmd: str, args: argparse.Namespace) -> None:
    """A usage error, in flags, when ``--local-world-size`` (with ``--world-size``,
    ``--cp-size`` and ``--locality node``) is no node layout: the rule is the topology's
    (``Topology.node_ranks``), the words are the command line's."""
    import re

    from ..core.topology import Topology
    from ..errors import TopologyError

    if args.local_world_size is None:
        if args.locality == "node":
            raise usage_error(cmd, "--locality node needs --local-world-size L, the processes each node runs "
                              "(torchrun's --nproc-per-node): the shards are dealt to nodes")
        return
    try:
        topology = Topology(world_size=args.world_size, rank=0, cp_size=args.cp_size,
                            local_world_size=args.local_world_size)
        if args.locality == "node":
            topology.node_ranks  # noqa: B018 - raises when the node layout and CP do not line up
    except TopologyError as exc:
        flags = re.sub(r"\b(local_world_size|world_size|cp_size)\b",
                       lambda m: "--" + m.group(1).replace("_", "-"), str(exc))
        raise usage_error(cmd, flags) from None


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


def format_bytes(n: float) -> str:
    for unit in ("B", "KB", "MB", "GB", "TB"):
        if abs(n) < 1000 or unit == "TB":
            return f"{n:.0f} {unit}" if unit == "B" else f"{n:.1f} {unit}"
        n /= 1000
    return f"{n:.1f} TB"  # pragma: no cover


def plural(n: int, word: str) -> str:
    return f"{n} {word}" if n == 1 else f"{n} {word}s"


def _short_reason(url: str, reason: str) -> str:
    """A skip reason without the URL it is listed under, nor the advice to use skip."""
    reason = reason[len(url) + 2 :] if reason.startswith(f"{url}: ") else reason
    head, sep, hint = reason.rpartition("; ")
    return head if sep and "on_error='skip'" in hint else reason


def report_excluded(index: Any, out: Any) -> None:
    """The skipped shards and excluded samples, with reasons (the first few)."""
    shards = list(index.excluded.get("shards", []))
    samples = list(index.excluded.get("samples", []))
    count = int(index.excluded.get("count", len(samples)))
    if shards:
        out.write(f"skipped {plural(len(shards), 'shard')} (on error: skip):\n")
        for s in shards[:_SHOW]:
            kept = s.get("samples_kept", 0)
            note = f" [{plural(kept, 'sample')} before the fault kept]" if kept else ""
            out.write(f"  {s['url']}: {_short_reason(s['url'], s['reason'])}{note}\n")
        if len(shards) > _SHOW:
            out.write(f"  ... and {len(shards) - _SHOW} more (wds-pad inspect --json INDEX)\n")
    if count:
        out.write(f"excluded {plural(count, 'sample')}:\n")
        for s in samples[:_SHOW]:
            out.write(f"  {s['key']!r} in {s['url']} at byte offset {s['offset']}: {s['reason']}\n")
        if count > _SHOW:
            out.write(f"  ... and {count - _SHOW} more (wds-pad inspect --json INDEX)\n")
