"""``wds-pad verify``: check that the shards are still what the index says.

Invariants:
- exit 1 if and only if it prints a stale, missing or unreachable shard (one line
  each, ``STALE`` / ``MISSING`` / ``UNREACHABLE``, then what to do); exit 0 with one
  ``OK`` line otherwise;
- the advice for stale shards is a command that fixes them as printed: ``wds-pad index
  --update -o INDEX``, with ``--rescan URL`` for each shard whose size and change stamp
  are unchanged (only ``--deep`` found it: an update alone would keep its rows), and
  ``--on-error skip`` when a shard is missing (left out, listed as skipped);
- an unreachable store is reported apart from stale shards: re-indexing would not help.
"""

from __future__ import annotations

import argparse
import shlex
import sys
from typing import Any

from .common import plural, add_relocate, relocation

__all__ = ["add_parser"]


def add_parser(sub: Any) -> None:
    """Register the ``verify`` subcommand."""
    p = sub.add_parser("verify", help="check that the shards are still what the index says",
                       description="Check every shard's size and change stamp (--deep: rescan and compare "
                                   "byte ranges). Exit 1 if any shard is stale, missing or unreachable.")
    p.add_argument("index", metavar="INDEX", help="index file (path or URL)")
    p.add_argument("--deep", action="store_true", help="also rescan each shard's headers and compare offsets")
    add_relocate(p)
    p.set_defaults(func=_cmd_verify)


def _cmd_verify(args: argparse.Namespace) -> int:
    from ..index.codec import load_index
    from ..index.verify import verify_index

    index = load_index(args.index, relocate=relocation(args))
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
        again = "".join(f" --rescan {shlex.quote(p.url)}" for p in problems if p.rescan)
        gone = any(p.reason.startswith("missing") for p in problems)
        skip = " --on-error skip" if gone else ""  # a missing shard is then left out, listed as skipped
        why = " (--on-error skip leaves the missing ones out, listed as skipped: restore them first to keep them)"
        sys.stdout.write(f"{len(problems) - len(unreachable)} of {checked} shards stale or missing{note}; "
                         f"re-index them with `wds-pad index --update -o {shlex.quote(args.index)}{again}{skip}`"
                         f"{why if gone else ''}\n")
        if gone:  # moved, not lost: --relocate reads them where they are now
            sys.stdout.write("if the shards moved, read them where they are instead: `wds-pad verify "
                             f"{shlex.quote(args.index)} --relocate OLD=NEW` (OLD: a prefix of the recorded URLs "
                             "ending at a folder boundary, e.g. /old/data=/new/data; relocate= in Python)\n")
    if unreachable:  # the store's fault, not the shards': re-indexing would not help
        sys.stdout.write(f"{len(unreachable)} of {checked} shards not checked: their store cannot be "
                         "reached or found no credentials (see above); fix that, then run "
                         f"`wds-pad verify` again{'' if len(problems) > len(unreachable) else note}\n")
    if problems:
        return 1
    sys.stdout.write(f"{plural(checked, 'shard')} OK{' (deep)' if args.deep else ''}{note}\n")
    return 0
