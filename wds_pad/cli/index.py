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
  anything.
"""

from __future__ import annotations

import argparse
import logging
import sys
import time
from typing import Any

from .common import _nbytes, _plural, _positive, _report_excluded, bucket_order, interrupt_exit

__all__ = ["add_parser"]


def add_parser(sub: Any) -> None:
    """Register the ``index`` subcommand."""
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
    from ..io.fs import get_filesystem

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
    from ..index.format import load_index
    from ..index.output import check_output
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
        top = ", ".join(f"{k}={counts[k]}" for k in bucket_order(counts)[:12])
        more = f", ... ({len(counts) - 12} more)" if len(counts) > 12 else ""
        out.write(f"buckets: {top}{more}\n")
    _report_excluded(index, out)
    return 0
