"""``wds-pad index | inspect | verify``: build, look at and check an index file.

Registered into the ``wds-pad`` parser by :func:`wds_pad.cli.app.build_parser` through
:func:`add_parsers`. Errors reach ``cli.main`` as :class:`WdsPadError` and print one
line ``wds-pad <cmd>: error: ...``.

Invariants:
- nothing is written to stdout but the command's result (reports, tables, JSON); the
  progress bar and notes go to stderr;
- ``index`` writes its output atomically: interrupted (Ctrl-C: exit 130, SIGTERM: exit
  143) or failed, the path holds either nothing or the previous valid index;
- ``index`` refuses, before scanning anything, an output that is one of its shards, a
  directory, an unwritable place, or an existing file that is not an index (unless
  ``--force``);
- ``inspect --json`` prints exactly one JSON object; ``verify`` exits 1 if and only if
  it prints a stale, missing or unreachable shard.
"""

from __future__ import annotations

import argparse
import json
import logging
import sys
import time
from typing import Any, Hashable

from .app import _non_negative, _positive, _usage, format_table, interrupt_exit
from ..errors import ConfigError

__all__ = ["add_parsers"]

_SHOW = 5  # excluded samples / skipped shards listed in reports


def add_parsers(sub: Any) -> None:
    """Register the ``index``, ``inspect`` and ``verify`` subcommands."""
    _add_index(sub)
    _add_inspect(sub)
    _add_verify(sub)


# -- helpers --------------------------------------------------------------------------
def _nbytes(n: float) -> str:
    for unit in ("B", "KB", "MB", "GB", "TB"):
        if abs(n) < 1000 or unit == "TB":
            return f"{n:.0f} {unit}" if unit == "B" else f"{n:.1f} {unit}"
        n /= 1000
    return f"{n:.1f} TB"  # pragma: no cover


def _plural(n: int, word: str) -> str:
    return f"{n} {word}" if n == 1 else f"{n} {word}s"


def _json_key(key: Hashable) -> str:
    """A bucket key as a JSON object key (JSON keys are strings)."""
    return key if isinstance(key, str) else json.dumps(key if not isinstance(key, tuple) else list(key))


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


# -- index ----------------------------------------------------------------------------
def _add_index(sub: Any) -> None:
    p = sub.add_parser(
        "index", help="index tar shards into buckets (one pass over tar headers)",
        description="Index WebDataset tar shards: per sample its shard, byte range, key and bucket.",
    )
    p.add_argument("urls", nargs="+", metavar="URL_OR_PATTERN",
                   help="shard paths or fsspec URLs, brace patterns allowed: 's3://b/train-{000..099}.tar'")
    p.add_argument("-o", "--output", required=True, metavar="INDEX", help="index file to write (path or URL)")
    p.add_argument("--bucket-by", default="none", metavar="SPEC",
                   help="none | aspect[:WIDTH_FIELD,HEIGHT_FIELD] | json:FIELD | image | map:FILE (default: none)")
    p.add_argument("--ratios", help="aspect/image: candidate ratios, e.g. '1:1,4:3,3:4,16:9'")
    p.add_argument("--boundaries", help="json:FIELD: band boundaries, e.g. '128,256,512'")
    p.add_argument("--step", type=float, help="aspect/image: round the ratio to a multiple of STEP instead")
    p.add_argument("--update", action="store_true",
                   help="reuse the rows of shards unchanged since INDEX was written; scan only new or changed ones")
    p.add_argument("--workers", type=_positive, default=8, help="shards scanned concurrently (default 8)")
    p.add_argument("--on-error", choices=["raise", "skip"], default="raise",
                   help="bad shard or sample: stop with an error (default), or leave it out and report it")
    p.add_argument("--name", help="dataset name the index plans under (default: the INDEX file stem)")
    p.add_argument("--no-progress", action="store_true", help="no progress bar on stderr")
    p.add_argument("--force", action="store_true",
                   help="let -o replace an existing file that is not a wds_pad index (never a shard being indexed)")
    p.set_defaults(func=_cmd_index)


def _exists(path: str) -> bool:
    from ..io.read import get_filesystem

    fs, fpath = get_filesystem(path)
    return bool(fs.exists(fpath))


def _stamp(path: str) -> Any:
    """What changes when a local ``path`` is replaced (None if missing or remote)."""
    import os

    if path.startswith("file://"):
        path = path[len("file://"):]
    elif "://" in path:
        return None
    try:
        st = os.stat(path)
    except (OSError, ValueError):
        return None
    return (st.st_dev, st.st_ino, st.st_size, st.st_mtime_ns)


def _cmd_index(args: argparse.Namespace) -> int:
    from ..index.bucket_spec import parse_bucket_by
    from ..index.format import check_output, load_index
    from ..index.build import build_index, expand_urls

    fn = parse_bucket_by(args.bucket_by, ratios=args.ratios, boundaries=args.boundaries, step=args.step)
    before = _stamp(args.output)
    previous = None
    if args.update:
        # refuse a bad -o before reading it as the previous index (build_index checks it
        # again, before scanning, in every case)
        check_output(args.output, expand_urls(args.urls), force=args.force)
        if _exists(args.output):
            previous = load_index(args.output)
        else:
            sys.stderr.write(f"wds-pad index: no index at {args.output} yet: indexing every shard\n")
    scan_log = logging.getLogger("wds_pad.index.tarscan")
    level = scan_log.level
    if args.on_error == "skip":  # the report below lists every skipped shard once
        scan_log.setLevel(logging.ERROR)
    start = time.monotonic()
    try:
        index = build_index(args.urls, fn, output=args.output, workers=args.workers, on_error=args.on_error,
                            update=previous, name=args.name, progress=not args.no_progress, force=args.force)
    except KeyboardInterrupt as exc:  # Ctrl-C or SIGTERM: the temp file is gone, the target untouched
        code, what = interrupt_exit(exc)
        if _stamp(args.output) == before:
            sys.stderr.write(f"wds-pad index: {what}; {args.output} was not changed\n")
        else:  # the signal came after the rename: the new index is complete
            sys.stderr.write(f"wds-pad index: {what} after {args.output} was written\n")
        return code
    finally:
        scan_log.setLevel(level)
    elapsed = time.monotonic() - start
    out = sys.stdout
    nbytes = sum(max(s.size, 0) for s in index.shards)
    out.write(f"indexed {_plural(len(index.shards), 'shard')} ({_nbytes(nbytes)}), "
              f"{_plural(len(index), 'sample')} in {_plural(len(index.buckets), 'bucket')} "
              f"in {elapsed:.2f} s -> {args.output}\n")
    if previous is not None:
        old = {(s.url, s.size, s.stamp) for s in previous.shards if s.error is None}
        kept = sum((s.url, s.size, s.stamp) in old for s in index.shards if s.error is None)
        out.write(f"update: {_plural(len(index.shards) - kept, 'shard')} scanned, {kept} unchanged\n")
    counts = index.bucket_counts()
    if counts:
        top = ", ".join(f"{k}={v}" for k, v in list(counts.items())[:12])
        more = f", ... ({len(counts) - 12} more)" if len(counts) > 12 else ""
        out.write(f"buckets: {top}{more}\n")
    _report_excluded(index, out)
    return 0


# -- inspect --------------------------------------------------------------------------
def _add_inspect(sub: Any) -> None:
    p = sub.add_parser("inspect", help="show an index: buckets, shards, excluded samples",
                       description="Show an index's buckets and shards; optionally plot them with padding.")
    p.add_argument("index", metavar="INDEX", help="index file (path or URL)")
    p.add_argument("--json", action="store_true", help="print one JSON object instead of tables")
    p.add_argument("--plot", metavar="FILE.png", help="bar chart of bucket sizes (needs matplotlib)")
    p.add_argument("--world-size", type=_positive, help="with --batch-size: also show padding for this job")
    p.add_argument("--batch-size", type=_positive, help="samples per batch per DP rank")
    p.add_argument("--cp-size", type=_positive, default=1, help="context-parallel size (default 1)")
    p.add_argument("--seed", type=_non_negative, default=0, help="plan seed (padding amounts do not depend on it)")
    p.add_argument("--pad", choices=["auto", "cyclic", "drop", "none"], default="auto", help="padding policy")
    p.add_argument("--repeats", type=_non_negative, default=0)
    p.add_argument("--oversubscribe", action="store_true")
    p.set_defaults(func=_cmd_inspect)


def _padding_stats(args: argparse.Namespace, index: Any) -> dict[Hashable, Any] | None:
    """Per bucket, what ``plan_epoch`` does with it for the given job, or None."""
    if args.world_size is None and args.batch_size is None:
        return None
    if args.world_size is None or args.batch_size is None:
        raise _usage("inspect", "padding needs both --world-size and --batch-size")
    from ..core.plan import plan_epoch
    from ..core.topology import Topology

    topo = Topology(world_size=args.world_size, rank=0, cp_size=args.cp_size)
    plan = plan_epoch(index.to_dataset(repeats=args.repeats), topo, seed=args.seed, batch_size=args.batch_size,
                      policy=args.pad, oversubscribe=args.oversubscribe, warn=False)
    return {s.bucket: s for s in plan.stats}


def _summary(index: Any, pad: dict[Hashable, Any] | None) -> dict[str, Any]:
    from ..index.format import FORMAT_VERSION

    counts, sizes = index.bucket_counts(), index.bucket_bytes()
    per_shard = [s.samples for s in index.shards if s.size >= 0]
    record: dict[str, Any] = {
        "path": index.path, "name": index.name, "version": FORMAT_VERSION, "digest": index.digest,
        "bucket_by": dict(index.bucket_by), "exts": list(index.exts),
        "shards": len(index.shards), "samples": len(index),
        "bytes": int(sum(sizes.values())), "shard_bytes": int(sum(max(s.size, 0) for s in index.shards)),
        "min_samples_per_shard": min(per_shard, default=0), "max_samples_per_shard": max(per_shard, default=0),
        "buckets": {_json_key(k): v for k, v in counts.items()},
        "bucket_bytes": {_json_key(k): v for k, v in sizes.items()},
        "excluded": int(index.excluded.get("count", 0)),
        "skipped_shards": list(index.excluded.get("shards", [])),
        "excluded_samples": list(index.excluded.get("samples", [])),
    }
    if pad is not None:
        record["padding"] = {_json_key(k): {"padded_length": s.padded_length, "padded_copies": s.padded_copies,
                                            "truncated": s.truncated, "dropped": s.dropped, "steps": s.steps}
                             for k, s in pad.items()}
    return record


def _cmd_inspect(args: argparse.Namespace) -> int:
    from ..index.format import load_index

    index = load_index(args.index)
    pad = _padding_stats(args, index)
    if args.plot:
        _plot(index, pad, args)
    if args.json:
        sys.stdout.write(json.dumps(_summary(index, pad)) + "\n")
        return 0
    _print_tables(index, pad, args, sys.stdout)
    if args.plot:
        sys.stdout.write(f"plot written to {args.plot}\n")
    return 0


def _print_tables(index: Any, pad: dict[Hashable, Any] | None, args: argparse.Namespace, out: Any) -> None:
    from ..index.format import FORMAT_VERSION

    total = len(index)
    counts, sizes = index.bucket_counts(), index.bucket_bytes()
    by = dict(index.bucket_by)
    desc = ", ".join([str(by.pop("kind", "?"))] + [f"{k}={v}" for k, v in by.items() if v is not None])
    out.write(f"index {index.path} (format v{FORMAT_VERSION}, digest {index.digest[:16]}), name {index.name!r}\n")
    out.write(f"bucket_by: {desc}; members: {', '.join(index.exts) or '-'}\n\n")
    headers = ["bucket", "samples", "%", "bytes", "mean sample"]
    rows = []
    for key, n in counts.items():
        row = [str(key), n, f"{100 * n / total:.1f}%" if total else "-", _nbytes(sizes[key]),
               _nbytes(sizes[key] / n) if n else "-"]
        if pad is not None:
            s = pad[key]
            row += [s.padded_copies, s.truncated, "dropped" if s.dropped else ("empty" if not n else "kept")]
        rows.append(row)
    if pad is not None:
        headers += ["pad copies", "truncated", "status"]
    rows.append(["total", total, "100.0%" if total else "-", _nbytes(sum(sizes.values())),
                 _nbytes(sum(sizes.values()) / total) if total else "-"]
                + ([sum(s.padded_copies for s in pad.values()), sum(s.truncated for s in pad.values()), ""]
                   if pad is not None else []))
    out.write(format_table(headers, rows, align="lrrrr" + ("rrl" if pad is not None else "")) + "\n")
    if pad is not None:
        out.write(f"(padding for world size {args.world_size}, cp size {args.cp_size}, batch size "
                  f"{args.batch_size}, policy {args.pad})\n")
    per_shard = [s.samples for s in index.shards if s.size >= 0]
    nbytes = sum(max(s.size, 0) for s in index.shards)
    skipped = [s for s in index.shards if s.error is not None]
    out.write(f"\nshards: {len(index.shards)}, {_nbytes(nbytes)}, samples per shard "
              f"min {min(per_shard, default=0)} / max {max(per_shard, default=0)}, "
              f"{len(skipped)} with errors\n")
    _report_excluded(index, out)


def _plot(index: Any, pad: dict[Hashable, Any] | None, args: argparse.Namespace) -> None:
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError as exc:
        raise ConfigError("--plot needs matplotlib: pip install 'wds-pad[plot]' (or pip install matplotlib)") from exc
    counts = index.bucket_counts()
    labels = [str(k) for k in counts]
    samples = [counts[k] for k in counts]
    fig, ax = plt.subplots(figsize=(max(6.0, 0.6 * len(labels) + 2), 4.2))
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
    except OSError as exc:
        raise ConfigError(f"--plot {args.plot!r}: cannot write the image: {exc}") from exc
    finally:
        plt.close(fig)


# -- verify ---------------------------------------------------------------------------
def _add_verify(sub: Any) -> None:
    p = sub.add_parser("verify", help="check that the shards are still what the index says",
                       description="Check every shard's size and change stamp (--deep: rescan and compare "
                                   "byte ranges). Exit 1 if any shard is stale, missing or unreachable.")
    p.add_argument("index", metavar="INDEX", help="index file (path or URL)")
    p.add_argument("--deep", action="store_true", help="also rescan each shard's headers and compare offsets")
    p.set_defaults(func=_cmd_verify)


def _cmd_verify(args: argparse.Namespace) -> int:
    from ..index.format import load_index
    from ..index.build import verify_index

    index = load_index(args.index)
    problems = verify_index(index, deep=args.deep)
    unreachable = [p for p in problems if p.reason.startswith("unreachable")]
    for p in problems:
        kind = ("UNREACHABLE" if p in unreachable else "MISSING" if p.reason.startswith("missing")
                else "STALE")
        sys.stdout.write(f"{kind} {p.url}: {p.reason}\n")
    checked = sum(1 for s in index.shards if s.size >= 0)
    unchecked = len(index.shards) - checked
    note = f" ({unchecked} missing when indexed, not checked)" if unchecked else ""
    if len(problems) > len(unreachable):
        sys.stdout.write(f"{len(problems) - len(unreachable)} of {checked} shards stale or missing{note}; "
                         f"re-index them with `wds-pad index ... -o {args.index} --update`\n")
    if unreachable:  # the store's fault, not the shards': re-indexing would not help
        sys.stdout.write(f"{len(unreachable)} of {checked} shards not checked: their store cannot be "
                         "reached or found no credentials (see above); fix that, then run "
                         f"`wds-pad verify` again{'' if len(problems) > len(unreachable) else note}\n")
    if problems:
        return 1
    sys.stdout.write(f"{_plural(checked, 'shard')} OK{' (deep)' if args.deep else ''}{note}\n")
    return 0
