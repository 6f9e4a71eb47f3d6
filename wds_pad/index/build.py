"""Build and update indexes: one pass over tar headers per shard, rows in shard order.

Invariants:
- a sample's row records its shard, the byte range from its first header to the end of
  its last member's padded data, its webdataset key, its member extensions and bucket
  (keys and costs from the scanned samples: ``index.samples``);
- only the members a bucket function asks for are read (and only their first
  ``head_bytes`` where it says so); local shards are scanned by seeking past payloads,
  other filesystems by streaming the object once (``shardfile.open_for_scan``);
- by default any bad input raises with the URL, byte offset and key; with
  ``on_error="skip"`` the shard or sample is left out and recorded in ``excluded``;
- every shard is stat-ed before any is scanned; with ``on_error="raise"`` the shards
  missing or unreadable are one ``ShardError`` then, saying how many and naming the
  first in URL order (the same on every run);
- with a cost function (``cost="json:FIELD" | "image:pixels" | "bytes"``) every kept
  sample's cost is recorded, read from the members the scan reads anyway (the bucket
  function's and the cost's, one pass); a sample without a valid cost is an error
  naming shard, byte offset, key and field, or with ``on_error="skip"`` is left out;
- shards are scanned concurrently, but rows come out in shard order, so the same
  shards give the same index whatever the number of workers; the shards open at once
  stay within a share of the descriptor limit (``io.descriptors.fd_budget``);
- ``update`` reuses the rows of shards whose size and change stamp are unchanged
  (``index.update``), except those named in ``rescan``;
- the shards' rows are joined in shard order (``index.rows``);
- an ``output`` is checked before any shard is scanned and written once, atomically,
  after the last one (``index.output``).

Verification (``verify_index``, ``index.verify``) rescans with :func:`scan_shard`.
"""

from __future__ import annotations

import concurrent.futures
import contextlib
import dataclasses
import threading
from typing import Any, Callable, Collection, Hashable, Iterable, Mapping, Sequence

from ..errors import ConfigError, ReadError, ShardError
from ..io.descriptors import fd_budget
from ..io.redact import redact
from ..io.urls import expand_urls
from ..tar.lean import scan_many
from .buckets.builtin import SingleBucket
from .buckets.cost import CostFn, parse_cost
from .buckets.protocol import BucketFn
from .buckets.user import wrap_callable
from .output import check_output, write_index
from .progress import Progress
from .record import Index
from .rows import ShardRows, assemble, fit_exts, unreadable
from .samples import shard_rows
from .shardfile import Stat, content_of, directory_error, open_for_scan, shard_info, stat_first, stat_shard
from .update import bucket_fn_of, previous_index, reusable_rows, update_and_rescan

# bucket_fn_of, expand_urls and shard_info are offered here too, where callers have long found them
__all__ = ["bucket_fn_of", "build_index", "expand_urls", "scan_shard", "shard_info"]

_GROUP = 32  # shards scanned by one task (see _scan_group)


def scan_shard(url: str, fn: BucketFn, on_error: str,
               storage_options: Mapping[str, Any] | None, cost: CostFn | None = None) -> ShardRows:
    """One shard's rows, scanned as :func:`build_index` scans it (no progress shown)."""
    return _scan_group([url], fn, on_error, storage_options, Progress(total=0, enabled=False), cost=cost)[0]


def _wanted(fn: BucketFn, cost: CostFn | None) -> tuple[tuple[str, ...], int | None]:
    """The members a scan reads for the bucket and cost functions, and how many of their
    first bytes (None, the whole members, if either wants them whole)."""
    if cost is None or not cost.members:
        return tuple(fn.members), fn.head_bytes
    members = tuple(dict.fromkeys((*fn.members, *cost.members)))
    heads = [f.head_bytes for f in (fn, cost) if f.members]
    return members, None if None in heads else max(heads)  # type: ignore[type-var]


def _scan_group(urls: Sequence[str], fn: BucketFn, on_error: str, storage_options: Mapping[str, Any] | None,
                progress: Progress, stats: Mapping[str, Stat] | None = None,
                cost: CostFn | None = None) -> list[ShardRows]:
    """Scan consecutive shards; their last headers are checked together (scan_many).

    A shard costs one ``stat_shard`` (unless ``stats`` holds it already) and its reads."""
    out: list[ShardRows | None] = [None] * len(urls)
    with contextlib.ExitStack() as stack:
        opened: list[tuple[int, str, int, str, Any, bool]] = []
        for i, url in enumerate(urls):
            try:
                known = stats.get(url) if stats is not None else None
                size, stamp, is_dir = known if known is not None else stat_shard(url, storage_options)
                try:
                    if is_dir:  # a local directory, or a prefix an object store lists as one
                        raise IsADirectoryError(url)
                    f, seekable = open_for_scan(url, storage_options, size=size, stamp=stamp)
                except FileNotFoundError:
                    raise ShardError(f"shard {redact(url)!r} does not exist; check the URL or pattern") from None
                except IsADirectoryError:
                    raise directory_error(url) from None
            except ShardError as exc:
                if on_error != "skip":
                    raise
                out[i] = unreadable(url, exc)
                continue
            stack.enter_context(f)
            opened.append((i, url, size, stamp, f, seekable))
        sources = [(f, redact(url), seekable) for _, url, _, _, f, seekable in opened]
        want, head = _wanted(fn, cost)
        kw = {"want": want, "head_bytes": head, "on_error": on_error,
              "progress": lambda n: progress.advance(samples=n)}
        try:
            scanned = scan_many(sources, **kw)
        except ShardError as exc:
            if on_error != "skip":
                raise
            if len(opened) == 1:
                out[opened[0][0]] = unreadable(opened[0][1], exc)
                return out  # type: ignore[return-value]
            # again one by one, from freshly opened files (a stream cannot go back), so
            # that only the unreadable shard is left out
            scanned = []
            for n, (i, url, size, stamp, *_) in enumerate(opened):
                try:
                    f, seekable = open_for_scan(url, storage_options, size=size, stamp=stamp)
                    stack.enter_context(f)
                    opened[n] = (i, url, size, stamp, f, seekable)
                    scanned.append(scan_many([(f, redact(url), seekable)], **kw)[0])
                except ReadError:
                    raise  # not the shard's fault (out of descriptors, the store)
                except (ShardError, OSError) as exc2:
                    out[i] = unreadable(url, exc2 if isinstance(exc2, ShardError) else ShardError(
                        f"shard {redact(url)!r} could not be opened again: {exc2}"))
                    scanned.append(None)  # type: ignore[arg-type]
        # a stream read through whole, to its end before it closes: its bytes' identity
        contents = [content_of(o[4]) if rows is not None and rows.fault is None else ""
                    for o, rows in zip(opened, scanned)]
    for (i, url, size, stamp, _, _), rows, content in zip(opened, scanned, contents):
        if rows is not None:
            out[i] = shard_rows(url, size, stamp, rows, fn, on_error, storage_options, cost)
            if content and out[i].info.error is None:
                out[i].info = dataclasses.replace(out[i].info, content=content)
    return out  # type: ignore[return-value]


def as_bucket_fn(bucket_by: Any, members: Sequence[str] | None, head_bytes: int | None) -> BucketFn:
    if bucket_by is None:
        return SingleBucket()
    if hasattr(bucket_by, "members") and hasattr(bucket_by, "describe"):
        return bucket_by  # type: ignore[no-any-return]
    if isinstance(bucket_by, str):
        from .buckets.spec import parse_bucket_by

        return parse_bucket_by(bucket_by)
    if callable(bucket_by):
        return wrap_callable(bucket_by, members=tuple(members) if members is not None else ("json",),
                             head_bytes=head_bytes)
    raise ConfigError(f"bucket_by must be None, a spec string or a callable, got {type(bucket_by).__name__}")


def build_index(
    urls: str | Iterable[str],
    bucket_by: BucketFn | Callable[..., Hashable | None] | str | None = None,
    *,
    output: str | None = None,
    workers: int = 8,
    on_error: str = "raise",
    update: Index | str | bool | None = None,
    storage_options: Mapping[str, Any] | None = None,
    members: Sequence[str] | None = None,
    head_bytes: int | None = None,
    name: str | None = None,
    progress: bool | None = False,
    force: bool = False,
    cost: CostFn | str | None = None,
    rescan: str | Iterable[str] | None = None,
) -> Index:
    """Index tar shards into buckets.

    Args:
        urls: a URL or brace pattern, or a list of them, on any fsspec filesystem.
        bucket_by: a BucketFn (see ``wds_pad.index.buckets``), a CLI-style spec string
            (``"aspect:width,height"``), a callable ``fn(key, {ext: bytes})`` returning
            a bucket key or None (excluded), or None for one bucket.
        output: where to write the index (local path or fsspec URL), atomically.
        workers: shards scanned concurrently.
        on_error: ``"raise"`` (default) or ``"skip"`` (leave the shard or sample out,
            recorded in ``index.excluded``).
        update: a previous index (or its path; ``True``: the index at ``output``): shards
            with unchanged size and change stamp keep their rows; only new or changed
            shards, and those in ``rescan``, are scanned.
        storage_options: fsspec options (credentials, endpoint) for remote shards.
        members: for a plain callable, the member extensions it needs (default json).
        head_bytes: for a plain callable, read only this many bytes of each member.
        name: the dataset name the index plans under (default: output file stem).
        progress: show a progress bar on stderr (None: only when stderr is a tty).
        force: let ``output`` replace an existing file that is not a wds_pad index.
        cost: also record each sample's cost: ``"json:FIELD"`` (a number in the
            ``.json`` member, FIELD a dotted path), ``"image:pixels"`` (width x height
            from the image header) or ``"bytes"`` (payload bytes); ``Index.cost``.
        rescan: with ``update``, shards (URLs or patterns, among ``urls``) scanned again
            whatever their size and change stamp: rewritten in place with both kept
            (pinned mtimes, ``rsync -t``), as ``verify_index(..., deep=True)`` finds them.

    Returns:
        The Index (also written to ``output`` if given: shard URLs beside or below it
        are stored relative to its folder, and the returned index is that file's).

    Raises:
        ShardError, TarFormatError, BucketError: bad input, naming URL, offset and key.
        ConfigError: wrong arguments, or an ``output`` that is refused before any
            shard is scanned (one of the shards, a directory, an existing file that is
            not an index without ``force``, an unwritable place: see ``check_output``),
            or an ``update`` whose index recorded another cost (or none).
    """
    check_options(on_error, workers)
    fn = as_bucket_fn(bucket_by, members, head_bytes)
    cost_fn = parse_cost(cost) if cost is not None else None
    shard_urls = expand_urls(urls, storage_options)
    if output is not None:
        check_output(output, shard_urls, force=force, storage_options=storage_options)
    update, again = update_and_rescan(update, rescan, output, shard_urls, storage_options)
    previous = previous_index(update, fn, storage_options, cost_fn)
    bar = Progress(total=len(shard_urls), enabled=progress, label="index")
    try:
        parts = scan_shards(shard_urls, fn, workers=workers, on_error=on_error, storage_options=storage_options,
                            bar=bar, previous=previous, cost=cost_fn, rescan=again)
    except BaseException:
        bar.close(failed=True)  # in a log, a failed build ends with its error line
        raise
    bar.close()
    index = rows_index(parts, fn, on_error, name or default_name(output, shard_urls), cost=cost_fn, path=output)
    if output is not None:
        write_index(index, output, storage_options, force=force)
    return index


def check_options(on_error: str, workers: int) -> None:
    """Refuse a bad ``on_error`` or ``workers`` (ConfigError)."""
    if on_error not in ("raise", "skip"):
        raise ConfigError(f"on_error must be 'raise' or 'skip', got {on_error!r}")
    if isinstance(workers, bool) or not isinstance(workers, int) or workers < 1:
        raise ConfigError(f"workers must be an int >= 1, got {workers!r}")


def scan_shards(shard_urls: Sequence[str], fn: BucketFn, *, workers: int, on_error: str,
                storage_options: Mapping[str, Any] | None, bar: Progress, previous: Index | None = None,
                stats: Mapping[str, Stat] | None = None, cost: CostFn | None = None,
                rescan: Collection[str] = ()) -> list[ShardRows]:
    """Every shard's rows, in shard order: reused from ``previous`` where unchanged (and
    not in ``rescan``), else scanned (``workers`` concurrently). ``stats`` are shards'
    known (size, stamp, is a directory): they are not asked for again. ``cost``: each
    sample's cost too."""
    stats = stat_first(shard_urls, workers, on_error, storage_options, stats)
    reused = reusable_rows(previous, shard_urls, storage_options, stats, rescan) if previous is not None else {}
    todo = [u for u in shard_urls if u not in reused]
    if todo and getattr(fn, "reuse_only", False):
        raise ConfigError(
            f"--update: {len(todo)} shard(s) changed or are new (first: {redact(todo[0])!r}), but the index "
            f"was bucketed by {fn.describe()}, which cannot be rebuilt from the index file; index again with "
            "the bucket function given (Python: build_index(..., bucket_by=fn, update=PATH))"
        )
    bar.advance(unchanged=len(reused))  # done, but not scanned: no part of the rates
    results: dict[str, ShardRows] = dict(reused)

    stop = threading.Event()

    def task(group: Sequence[str]) -> list[ShardRows]:
        if stop.is_set():  # a worker may dequeue a group while the pool is being shut down
            raise concurrent.futures.CancelledError()
        rows = _scan_group(group, fn, on_error, storage_options, bar, stats, cost)
        for r in rows:
            bar.advance(shards=1, nbytes=max(r.nbytes, 0))
        return rows

    # consecutive shards form a group (their last headers are checked together); with
    # several workers, groups are small enough to keep every worker busy; a group's shards
    # are open at once, so all the groups in flight stay within a share of RLIMIT_NOFILE
    room = fd_budget()
    workers = min(workers, room)
    size = _GROUP if workers == 1 else max(1, min(_GROUP, len(todo) // (4 * workers)))
    size = max(1, min(size, room // workers))
    groups = [todo[i : i + size] for i in range(0, len(todo), size)]
    if workers == 1 or len(groups) <= 1:
        for group in groups:
            results.update(zip(group, task(group)))
    else:
        with concurrent.futures.ThreadPoolExecutor(max_workers=workers) as pool:
            futures: dict[concurrent.futures.Future[list[ShardRows]], Sequence[str]] = {}
            try:  # the submitting too: a signal while groups are submitted must cancel the rest
                for group in groups:
                    futures[pool.submit(task, group)] = group
                for fut in concurrent.futures.as_completed(futures):
                    results.update(zip(futures[fut], fut.result()))
            except BaseException:  # a failed shard, Ctrl-C, SIGTERM: start no further group
                stop.set()
                pool.shutdown(wait=False, cancel_futures=True)
                raise
    return [results[u] for u in shard_urls]


def rows_index(parts: list[ShardRows], fn: BucketFn, on_error: str, name: str, *, cost: CostFn | None = None,
               path: str | None = None) -> Index:
    """The Index of the shards' rows (in shard order), as ``build_index`` assembles it
    (``path``: where it will be written)."""
    parts = fit_exts(parts, on_error)
    skipped = [p.fault for p in parts if p.fault is not None]  # shard order: same for any workers
    return assemble(parts, fn.describe(), skipped, name, cost_kind=cost.describe() if cost is not None else None,
                    path=path)


def default_name(output: str | None, urls: Sequence[str]) -> str:
    base = output or urls[0]
    stem = base.rstrip("/").rsplit("/", 1)[-1]
    for suffix in (".wdsidx", ".idx", ".tar"):
        stem = stem[: -len(suffix)] if stem.endswith(suffix) else stem
    return stem or "index"
