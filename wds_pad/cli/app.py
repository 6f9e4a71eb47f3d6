"""The ``wds-pad`` command line: index | inspect | plan | verify | demo.

Starts fast: nothing here imports torch; subcommands import what they need lazily.
Bad arguments print one line starting ``wds-pad <cmd>: error:`` and exit with 2.
Ctrl-C (SIGINT) and SIGTERM stop a command the same way: one line on stderr, exit 130
or 143 (128 + the signal number), and a file being written keeps its previous content.
"""

from __future__ import annotations

import argparse
import json
import signal
import sys
import threading
from typing import Any, Callable, Sequence

from ..errors import WdsPadError

__all__ = ["main"]

EXIT_USAGE = 2
EXIT_SIGINT = 128 + signal.SIGINT
EXIT_SIGTERM = 128 + signal.SIGTERM


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


def _on_sigterm(signum: int, frame: Any) -> None:
    signal.signal(signal.SIGTERM, signal.SIG_DFL)  # a second SIGTERM ends the process at once
    raise Terminated()


class _Parser(argparse.ArgumentParser):
    """argparse with one-line errors (exit code 2), as the CLI promises."""

    def error(self, message: str) -> Any:  # type: ignore[override]
        sys.stderr.write(f"{self.prog}: error: {message} (see --help)\n")
        raise SystemExit(EXIT_USAGE)


def _parse_buckets(text: str) -> dict[str, int]:
    out: dict[str, int] = {}
    for part in filter(None, (p.strip() for p in text.split(","))):
        name, sep, count = part.partition("=")
        if not sep or not name.strip():
            raise argparse.ArgumentTypeError(f"bucket {part!r} is not NAME=COUNT (e.g. 'a=4,b=0,c=7')")
        try:
            n = int(count)
        except ValueError:
            raise argparse.ArgumentTypeError(f"bucket {name!r}: count {count!r} is not an integer") from None
        if n < 0:
            raise argparse.ArgumentTypeError(f"bucket {name!r}: count must be >= 0, got {n}")
        if name.strip() in out:
            raise argparse.ArgumentTypeError(f"bucket {name.strip()!r} is listed twice")
        out[name.strip()] = n
    if not out:
        raise argparse.ArgumentTypeError("no buckets given; use e.g. --buckets 'a=4,b=0,c=7'")
    return out


def _int_at_least(minimum: int, what: str, text: str) -> int:
    try:
        value = int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected {what}, got {text!r}") from None
    if value < minimum:
        raise argparse.ArgumentTypeError(f"expected {what}, got {value}")
    return value


def _rank_arg(text: str) -> int | str:
    if text == "all":
        return text
    try:
        return _int_at_least(0, "an integer >= 0", text)
    except argparse.ArgumentTypeError as exc:
        raise argparse.ArgumentTypeError(f"--rank must be an integer or 'all' ({exc})") from None


def _positive(text: str) -> int:
    return _int_at_least(1, "a positive integer", text)


def _non_negative(text: str) -> int:
    return _int_at_least(0, "an integer >= 0", text)


def _library_int(check: Callable[[Any], int], what: str, text: str) -> int:
    """Parse ``text`` as an int and validate it with the library's own ``check``.

    The CLI and the API then accept exactly the same values: one rule, one message.
    """
    from ..errors import ConfigError

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
    from ..core.plan import check_epoch

    return _library_int(check_epoch, "epoch", text)


def synthetic_dataset(buckets: dict[str, int], name: str = "synthetic") -> Any:
    """A Dataset whose ids are numbered from 0 in the order the buckets are listed."""
    import numpy as np

    from ..core.plan import Dataset

    out, start = {}, 0
    for key, count in buckets.items():
        out[key] = np.arange(start, start + count, dtype=np.int64)
        start += count
    return Dataset(name=name, buckets=out)


def add_plan_parser(sub: Any) -> None:
    p = sub.add_parser("plan", help="print this rank's (or every rank's) planned batches",
                       description="Plan an epoch (or K steps) for one rank or all ranks.")
    p.add_argument("index", nargs="*", help="index file(s); each is one dataset (or use --buckets)")
    p.add_argument("--buckets", type=_parse_buckets, help="synthetic dataset: 'a=4,b=0,c=7'")
    p.add_argument("--world-size", type=_positive, required=True)
    p.add_argument("--rank", type=_rank_arg, required=True, help="a rank, or 'all'")
    p.add_argument("--cp-size", type=_positive, default=1)
    p.add_argument("--batch-size", type=_positive, required=True)
    p.add_argument("--seed", type=_seed_arg, required=True, help="an integer in [0, 2**64)")
    p.add_argument("--epoch", type=_epoch_arg, default=0, help="an integer in [0, 2**31 - 1]")
    p.add_argument("--pad", choices=["auto", "cyclic", "drop", "none"], default="auto")
    p.add_argument("--pad-to", choices=["batch", "rank"], default="batch")
    p.add_argument("--repeats", type=_non_negative, default=0, help="repeats of every dataset")
    p.add_argument("--weights", help="comma-separated weights, one per index")
    p.add_argument("--oversubscribe", action="store_true")
    p.add_argument("--mode", choices=["epochs", "steps"], default="epochs")
    p.add_argument("--steps", type=_positive, help="steps mode: how many global steps to print")
    out = p.add_mutually_exclusive_group(required=True)
    out.add_argument("--json", action="store_true", help="one JSON object per batch")
    out.add_argument("--summary", action="store_true", help="a table per bucket")
    p.set_defaults(func=_cmd_plan)


def _plan_sources(args: argparse.Namespace) -> tuple[list[Any], list[Any]]:
    """The datasets to plan, and per dataset a ``ids -> (urls, keys)`` lookup or None."""
    from ..core.plan import Dataset

    if bool(args.index) == bool(args.buckets):
        raise _usage("plan", "give either INDEX file(s) or --buckets, not both and not neither")
    if args.buckets:
        ds = synthetic_dataset(args.buckets)
        return [Dataset(ds.name, ds.buckets, repeats=args.repeats)], [None]
    from ..index.format import load_index  # lazily: only when an index file is planned

    weights = [1.0] * len(args.index)
    if args.weights:
        try:
            weights = [float(w) for w in args.weights.split(",")]
        except ValueError:
            raise _usage("plan", f"--weights {args.weights!r} is not a list of numbers") from None
        if len(weights) != len(args.index):
            raise _usage("plan", f"--weights has {len(weights)} values for {len(args.index)} index files")
    datasets, lookups, names = [], [], set()
    for i, (path, weight) in enumerate(zip(args.index, weights)):
        idx = load_index(path)
        ds = idx.to_dataset(repeats=args.repeats, weight=weight)
        if ds.name in names:
            ds = Dataset(f"{ds.name}#{i}", ds.buckets, repeats=ds.repeats, weight=ds.weight)
        names.add(ds.name)
        datasets.append(ds)
        lookups.append(idx.describe_samples)
    return datasets, lookups


class _UsageError(Exception):
    pass


def _usage(cmd: str, message: str) -> _UsageError:
    return _UsageError(f"wds-pad {cmd}: error: {message}")


def _cmd_plan(args: argparse.Namespace) -> int:
    from ..core.plan import Mode, iter_steps, plan_epoch
    from ..core.topology import Topology

    if args.mode == "steps" and args.steps is None and args.json:
        raise _usage("plan", "--mode steps needs --steps K (how many global steps to print)")
    sources, lookups = _plan_sources(args)
    ranks = range(args.world_size) if args.rank == "all" else [args.rank]
    if args.rank != "all" and args.rank >= args.world_size:
        raise _usage("plan", f"--rank {args.rank} is out of range for --world-size {args.world_size}")
    common = dict(seed=args.seed, batch_size=args.batch_size, policy=args.pad,
                  oversubscribe=args.oversubscribe, pad_to=args.pad_to)
    out = sys.stdout
    for i, rank in enumerate(ranks):
        topo = Topology(world_size=args.world_size, rank=rank, cp_size=args.cp_size)
        warn = i == 0
        if args.summary:
            plan = plan_epoch(sources, topo, epoch=args.epoch, mode=args.mode, warn=True, **common)
            _print_summary(plan, out)
            return 0
        if args.mode == Mode.EPOCHS.value:
            plans: Any = [plan_epoch(sources, topo, epoch=args.epoch, mode=args.mode, warn=warn, **common)]
        else:
            plans = iter_steps(sources, topo, start_epoch=args.epoch, **common)
        _print_json(plans, topo, args.steps, lookups, out)
    return 0


def _print_json(plans: Any, topo: Any, max_steps: int | None, lookups: list[Any], out: Any) -> None:
    done = 0
    for plan in plans:
        for batch in plan:
            if max_steps is not None and done + batch.step >= max_steps:
                return
            record = batch.to_json(topo)
            lookup = lookups[plan.datasets.index(batch.dataset)]
            if lookup is not None:
                record["urls"], record["keys"] = lookup(batch.samples)
            out.write(json.dumps(record) + "\n")
        done += plan.steps
        if max_steps is None:
            return


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


def _print_summary(plan: Any, out: Any) -> None:
    topo = plan.topology
    rows = []
    for s in plan.stats:
        status = "empty" if s.samples == 0 else ("dropped" if s.dropped else
                                                  ("oversubscribed" if s.oversubscribed else "kept"))
        pct = f"{100 * s.padded_fraction:.1f}%"
        rows.append([s.dataset, str(s.bucket), s.samples, s.repeats, s.padded_length,
                     s.padded_copies, pct, s.truncated, status, s.steps])
    headers = ["dataset", "bucket", "samples", "repeats", "padded len", "pad copies", "pad %",
               "truncated", "status", "steps/epoch"]
    out.write(f"epoch {plan.epoch}: world_size {topo.world_size}, dp_size {topo.dp_size}, "
              f"cp_size {topo.cp_size}, batch {plan.batch_size}, policy {plan.policy.value}, "
              f"pad unit {plan.topology.dp_size * (plan.batch_size if plan.pad_to.value == 'batch' else 1)}\n")
    out.write(format_table(headers, rows, align="llrrrrrrlr") + "\n")
    total = sum(s.samples for s in plan.stats)
    padded = sum(s.padded_copies for s in plan.stats)
    dropped = sum(s.samples for s in plan.stats if s.dropped)
    out.write(f"total: {total} samples, {padded} padded copies, {dropped} samples in dropped buckets, "
              f"{plan.steps} steps per epoch, {len(plan)} batches on rank {topo.rank}\n")


def _cmd_demo(args: argparse.Namespace) -> int:
    from .demo import run_demo

    return run_demo(args)


def _add_demo_parser(sub: Any) -> None:
    p = sub.add_parser("demo", help="run the main job end to end on a generated dataset")
    p.add_argument("--out", default="demo-out", help="directory for the generated data and plot")
    p.add_argument("--world-size", type=_positive, default=8)
    p.add_argument("--cp-size", type=_positive, default=2)
    p.add_argument("--batch-size", type=_positive, default=4)
    p.add_argument("--seed", type=_seed_arg, default=1234)
    p.add_argument("--samples", type=_positive, default=400, help="images to generate")
    p.add_argument("--shards", type=_positive, default=8, help="shards to write them into")
    p.set_defaults(func=_cmd_demo)


def build_parser() -> argparse.ArgumentParser:
    parser = _Parser(prog="wds-pad", description="WebDataset shards for distributed training.")
    sub = parser.add_subparsers(dest="command", required=True, parser_class=_Parser)
    add_plan_parser(sub)
    _add_demo_parser(sub)
    for register in _extra_commands():
        register(sub)
    return parser


def _extra_commands() -> list[Callable[[Any], None]]:
    """Subcommands that live in their own modules (index, inspect, verify)."""
    try:
        from .index import add_parsers
    except ImportError as exc:
        if getattr(exc, "name", "") != f"{__package__}._cli_index":
            raise
        return []
    return [add_parsers]


def main(argv: Sequence[str] | None = None) -> int:
    """Entry point of the ``wds-pad`` console script."""
    import warnings

    parser = build_parser()
    args = parser.parse_args(argv)
    # warnings (a dropped bucket, ...) read as one line of advice, not a source listing;
    # restored afterwards, for callers that run main() in their own process
    saved_format = warnings.formatwarning
    warnings.formatwarning = lambda message, category, *_rest, **_kw: (  # type: ignore[assignment]
        f"wds-pad {args.command}: warning: {message}\n")
    # SIGTERM unwinds like Ctrl-C (temp files removed, one line, exit 143); only from the
    # main thread, and not when the caller chose to ignore or handle SIGTERM itself
    saved_sigterm = None
    if threading.current_thread() is threading.main_thread() and \
            signal.getsignal(signal.SIGTERM) is signal.SIG_DFL:
        saved_sigterm = signal.signal(signal.SIGTERM, _on_sigterm)
    try:
        return _run(args)
    finally:
        warnings.formatwarning = saved_format
        if saved_sigterm is not None:
            signal.signal(signal.SIGTERM, saved_sigterm)


def _run(args: argparse.Namespace) -> int:
    try:
        return int(args.func(args) or 0)
    except _UsageError as exc:
        sys.stderr.write(f"{exc}\n")
        return EXIT_USAGE
    except WdsPadError as exc:
        sys.stderr.write(f"wds-pad {args.command}: error: {exc}\n")
        return EXIT_USAGE if isinstance(exc, ValueError) and not isinstance(exc, OSError) else 1
    except BrokenPipeError:  # `wds-pad plan ... | head`
        return 0
    except KeyboardInterrupt as exc:  # Ctrl-C, or SIGTERM (Terminated)
        code, what = interrupt_exit(exc)
        sys.stderr.write(f"wds-pad {args.command}: {what}\n")
        return code


if __name__ == "__main__":  # pragma: no cover
    raise SystemExit(main())
