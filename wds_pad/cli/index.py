"""``wds-pad index``: build an index file from tar shards (one pass over tar headers).

Errors reach :func:`wds_pad.cli.app.main` as :class:`WdsPadError` and print one line
``wds-pad index: error: ...``.

Invariants:
- nothing is written to stdout but the command's report; the progress bar and notes
  go to stderr;
- the output is written atomically: interrupted (Ctrl-C: exit 130, SIGTERM: exit 143)
  or failed, the path holds either nothing or the previous valid index;
- an output that is one of its shards, a directory, an unwritable place, or an
  existing file that is not an index (unless ``--force``) is refused before scanning
  anything;
- ``--update -o INDEX`` without URLs re-indexes the shards INDEX lists, bucketed as
  INDEX was and with its costs (a version-1 INDEX is read converted: unchanged shards
  keep their rows); ``--relocate OLD=NEW`` is refused, naming ``relocate=``: written
  again with the moved URLs, INDEX would get another digest and the states saved with
  it would no longer resume; ``--rescan URL`` scans a shard again whatever
  its size and change stamp (what ``wds-pad verify --deep`` advises for a shard rewritten
  in place), and the report counts it among the scanned;
- ``--distributed`` (implied under torchrun with more than one process) runs one job
  over every rank (``index.distributed``), in a gloo process group made from
  torchrun's environment; only rank 0 prints the report.
"""

from __future__ import annotations

import argparse
import logging
import sys
import time
from typing import Any

from .common import (
    format_bytes,
    plural,
    positive_int,
    report_excluded,
    usage_error,
    bucket_order,
    interrupt_exit,
)

__all__ = ["add_parser"]


def add_parser(sub: Any) -> None:
    """Register the ``index`` subcommand."""
    p = sub.add_parser(
        "index", help="index tar shards into buckets (one pass over tar headers)",
        description="Index WebDataset tar shards: per sample its shard, byte range, key and bucket.",
    )
    p.add_argument("urls", nargs="*", metavar="URL_OR_PATTERN",
                   help="shard paths or fsspec URLs, brace patterns allowed: 's3://b/train-{000..099}.tar' "
                        "(none with --update: the shards INDEX lists)")
    p.add_argument("-o", "--output", required=True, metavar="INDEX", help="index file to write (path or URL)")
    p.add_argument("--bucket-by", default=None, metavar="SPEC",
                   help="none | aspect[:WIDTH_FIELD,HEIGHT_FIELD] | json:FIELD | image | map:FILE "
                        "(default: none, or with --update as INDEX was bucketed)")
    p.add_argument("--ratios", help="aspect/image: candidate ratios, e.g. '1:1,4:3,3:4,16:9'")
    p.add_argument("--boundaries", help="json:FIELD: band boundaries, e.g. '128,256,512'")
    p.add_argument("--step", type=float, help="aspect/image: round the ratio to a multiple of STEP instead")
    p.add_argument("--cost", metavar="SPEC",
                   help="also record each sample's cost: json:FIELD (a number in the .json member, FIELD a "
                        "dotted path) | image:pixels (width x height from the image header) | bytes (payload "
                        "bytes); default: none, or with --update as INDEX recorded it")
    p.add_argument("--update", action="store_true",
                   help="reuse the rows of shards unchanged since INDEX was written; scan only new or changed ones "
                        "(also converts a version-1 INDEX; without URLs: the shards INDEX lists)")
    p.add_argument("--rescan", action="append", metavar="URL_OR_PATTERN",
                   help="with --update: scan this shard again even if its size and change stamp are unchanged "
                        "(rewritten in place; `wds-pad verify --deep` names such shards); repeatable")
    p.add_argument("--workers", type=positive_int, default=8, help="shards scanned concurrently (default 8)")
    p.add_argument("--on-error", choices=["raise", "skip"], default="raise",
                   help="bad shard or sample: stop with an error (default), or leave it out and report it")
    p.add_argument("--name", help="dataset name the index plans under (default: the INDEX file stem)")
    p.add_argument("--no-progress", action="store_true", help="no progress bar on stderr")
    p.add_argument("--force", action="store_true",
                   help="let -o replace an existing file that is not a wds_pad index (never a shard being indexed)")
    p.add_argument("--distributed", action="store_true",
                   help="one job over every rank of torchrun (gloo): parts of --part-shards shards per rank, "
                        "merged by rank 0; a rerun redoes only missing parts (implied under torchrun)")
    p.add_argument("--part-shards", type=positive_int, default=64,
                   help="--distributed: shards per part, the unit of work and of reuse (default 64)")
    p.add_argument("--timeout", type=positive_int, default=600,
                   help="--distributed: seconds a rank may stay silent before the job stops (default 600)")
    p.add_argument("--relocate", action="append", default=[], metavar="OLD=NEW",
                   help="refused: an index written again with moved URLs gets another digest and its saved states "
                        "no longer resume; give --relocate to plan, inspect and verify (relocate= in Python)")
    p.set_defaults(func=_cmd_index)


def _exists(path: str) -> bool:
    from ..io.fs import get_filesystem

    fs, fpath = get_filesystem(path)
    return bool(fs.exists(fpath))


def _stamp(path: str) -> Any:
    """What changes when a local ``path`` is replaced (None if missing or remote)."""
    import os

    from ..io.urls import local_path

    local = local_path(path)
    if local is None:
        return None
    try:
        st = os.stat(local)
    except (OSError, ValueError):
        return None
    return (st.st_dev, st.st_ino, st.st_size, st.st_mtime_ns)


_TORCHRUN_ENV = ("RANK", "WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT")


def _under_torchrun() -> bool:
    """Started by torchrun with more than one process (its agent sets TORCHELASTIC_RUN_ID)."""
    import os

    return bool(os.environ.get("TORCHELASTIC_RUN_ID")) and int(os.environ.get("WORLD_SIZE", "1") or 1) > 1


def _cmd_index(args: argparse.Namespace) -> int:
    from ..errors import ConfigError
    from ..index.buckets.spec import parse_bucket_by
    from ..index.buckets.cost import parse_cost
    from ..index.update import bucket_fn_of, cost_fn_of
    from ..index.codec import load_index
    from ..index.output import check_output
    from ..index.build import build_index, expand_urls

    before = _stamp(args.output)
    previous = None
    urls = list(args.urls)
    if not urls and not args.update:
        raise usage_error("index", "give the shard URLs or patterns to index, or --update -o INDEX to index again "
                              "the shards an existing INDEX lists")
    if args.relocate and not args.update:
        raise usage_error("index", "--relocate applies to the index --update reads (-o INDEX); shards given as URLs "
                              "are indexed where they are")
    if args.relocate:  # the new URLs would change INDEX's digest: every state saved with it refused
        raise usage_error("index", f"--update --relocate would write {args.output} again with the shards' new URLs, which "
                              "changes its digest, so states saved with it could no longer resume; leave it as it "
                              "is and read the shards where they moved to through relocate= (--relocate OLD=NEW "
                              "on plan, inspect and verify; BucketedWebDataset(..., relocate={OLD: NEW}), "
                              "load_index(..., relocate=...)), or index them afresh where they are: "
                              "wds-pad index NEW_URLS -o NEW_INDEX")
    cost = parse_cost(args.cost) if args.cost is not None else None
    if args.rescan and not args.update:
        raise usage_error("index", "--rescan scans shards again in an update: add --update (without it every shard "
                              "is scanned anyway)")
    if args.update:
        # refuse a bad -o before reading it as the previous index (build_index checks it
        # again, before scanning, in every case)
        check_output(args.output, expand_urls(urls) if urls else (), force=args.force)
        if _exists(args.output):
            previous = load_index(args.output)
            urls = urls or list(previous.urls)
            if args.cost is None:
                cost = cost_fn_of(previous)  # with the costs INDEX records
        elif not urls:
            raise ConfigError(f"--update without shard URLs re-indexes the shards of {args.output!r}, which does "
                              "not exist; give the shard URLs or patterns")
        else:
            sys.stderr.write(f"wds-pad index: no index at {args.output} yet: indexing every shard\n")
    if args.bucket_by is None and previous is not None and (args.ratios, args.boundaries, args.step) == (None,) * 3:
        fn = bucket_fn_of(previous)  # as the index was bucketed
    else:
        fn = parse_bucket_by(args.bucket_by or "none", ratios=args.ratios, boundaries=args.boundaries,
                             step=args.step)
    distributed = args.distributed or _under_torchrun()
    if distributed:
        return _run_distributed(args, urls, fn, previous, cost)
    scan_log = logging.getLogger("wds_pad.tar.scan")
    level = scan_log.level
    if args.on_error == "skip":  # the report below lists every skipped shard once
        scan_log.setLevel(logging.ERROR)
    start = time.monotonic()
    try:
        index = build_index(urls, fn, output=args.output, workers=args.workers, on_error=args.on_error,
                            update=previous, name=args.name, progress=not args.no_progress, force=args.force,
                            cost=cost, rescan=args.rescan if previous is not None else None)
    except KeyboardInterrupt as exc:  # Ctrl-C or SIGTERM: the temp file is gone, the target untouched
        code, what = interrupt_exit(exc)
        if _stamp(args.output) == before:
            sys.stderr.write(f"wds-pad index: {what}; {args.output} was not changed\n")
        else:  # the signal came after the rename: the new index is complete
            sys.stderr.write(f"wds-pad index: {what} after {args.output} was written\n")
        return code
    finally:
        scan_log.setLevel(level)
    _report(index, args.output, time.monotonic() - start, previous, expand_urls(args.rescan) if args.rescan else ())
    return 0


def _report(index: Any, output: str, elapsed: float, previous: Any, rescanned: Any = ()) -> None:
    out = sys.stdout
    nbytes = sum(max(s.size, 0) for s in index.shards)
    out.write(f"indexed {plural(len(index.shards), 'shard')} ({format_bytes(nbytes)}), "
              f"{plural(len(index), 'sample')} in {plural(len(index.buckets), 'bucket')} "
              f"in {elapsed:.2f} s -> {output}\n")
    if previous is not None:
        old = {(s.url, s.size, s.stamp) for s in previous.shards if s.error is None}
        again = set(rescanned)
        kept = sum((s.url, s.size, s.stamp) in old and s.url not in again for s in index.shards if s.error is None)
        out.write(f"update: {plural(len(index.shards) - kept, 'shard')} scanned, {kept} unchanged\n")
    counts = index.bucket_counts()
    if counts:
        top = ", ".join(f"{k}={counts[k]}" for k in bucket_order(counts)[:12])
        more = f", ... ({len(counts) - 12} more)" if len(counts) > 12 else ""
        out.write(f"buckets: {top}{more}\n")
    if index.cost is not None and len(index):
        c = index.cost
        out.write(f"cost {index.cost_kind}: min {_number(c.min())}, mean {_number(c.mean())}, "
                  f"max {_number(c.max())} (wds-pad inspect: per bucket)\n")
    report_excluded(index, out)


def _number(value: Any) -> str:
    """A cost for a report: whole numbers as such, others with 4 significant digits."""
    v = float(value)
    return f"{int(v):,}" if v == int(v) else f"{v:,.4g}"


def _run_distributed(args: argparse.Namespace, urls: list[str], fn: Any, previous: Any, cost: Any) -> int:
    """``--distributed``: a gloo group from torchrun's environment, one job, rank 0 reports."""
    import datetime
    import os

    from ..errors import ConfigError
    from ..index.distributed import build_index_distributed
    from ..io.urls import expand_urls

    missing = [k for k in _TORCHRUN_ENV if not os.environ.get(k)]
    if missing:
        raise ConfigError(f"--distributed runs under torchrun, but {', '.join(missing)} "
                          f"{'is' if len(missing) == 1 else 'are'} not set; start it as `torchrun --nproc-per-node N "
                          "-m wds_pad index --distributed ...` (on several machines: --nnodes, --rdzv-endpoint), "
                          "or leave out --distributed to index in this process")
    import torch.distributed as dist

    log = logging.getLogger("wds_pad.index.distributed")
    handler = logging.StreamHandler(sys.stderr)
    handler.setFormatter(logging.Formatter("wds-pad index: %(message)s"))
    log.addHandler(handler)
    saved = log.level
    log.setLevel(logging.INFO)
    made = not dist.is_initialized()
    start = time.monotonic()
    try:
        if made:
            dist.init_process_group("gloo", timeout=datetime.timedelta(seconds=args.timeout))
        index = build_index_distributed(
            urls, fn, output=args.output, workers=args.workers, on_error=args.on_error,
            update=previous, name=args.name,
            progress=not args.no_progress, force=args.force, part_shards=args.part_shards,
            timeout=float(args.timeout), cost=cost, rescan=args.rescan if previous is not None else None)
    finally:
        log.removeHandler(handler)
        log.setLevel(saved)
        if made and dist.is_initialized():
            dist.destroy_process_group()
    if index is not None:
        _report(index, args.output, time.monotonic() - start, previous,
                expand_urls(args.rescan) if args.rescan else ())
    return 0
