"""Indexing as a distributed job: the shards split into parts, each part indexed by one
rank and written on its own, then merged into one index by rank 0.

The job runs in a torch.distributed process group the caller made (``wds-pad index
--distributed`` makes a gloo one from torchrun's environment); this module never
creates or destroys one.

Invariants:
- the part layout depends on the shard list and ``part_shards`` only, never on the world
  size: part ``i`` is shards ``i * part_shards`` up to ``(i + 1) * part_shards``; a rerun
  with another world size finds the same parts;
- a part's file is ``OUTPUT.parts/part-<i>-<digest>.wdsidx``, the digest taken over what
  decides its content (its shards' URLs, sizes and change stamps, how buckets are
  computed, the cost recorded, ``on_error``, the format and wds_pad versions), so a finished part is reused
  and a stale one (a shard changed since) is never: it is simply not the file asked for;
- each part is written atomically (``io.atomic`` locally, one PUT elsewhere): a killed
  rank leaves whole parts or none, and a rerun redoes only the missing ones, dealt
  evenly over the ranks of the rerun;
- a shard costs one ``stat_shard`` (a HEAD over HTTP/S3) and its reads: the stat that
  names its part is the one its scan uses;
- rank 0 merges the parts with ``format.merged_parts`` (streamed: the tables and one
  slice of one part in memory, and with costs one bucket's) into the output, written
  atomically (a remote output: a local temp file, then one upload), then removes the
  part folder. The result is byte-identical to ``build_index`` of the same shards in one
  process written to the same output (shard URLs stored relative to it alike);
- no rank waits forever (``index.jobstore``: status keys and heartbeats in the process
  group's store, not collectives, once scanning starts): a rank that fails tells the
  others (each stops with an error naming it), and a rank that stops beating (killed,
  hung) for ``timeout`` seconds is named by rank 0, which stops the job.
"""

from __future__ import annotations

import contextlib
import logging
import os
import shutil
import sys
import tempfile
import time
from typing import Any, Callable, Collection, Hashable, Iterable, Mapping, Sequence

from ..core.collective import all_gather, broadcast, dist_for
from ..core.seed import json_digest
from ..errors import ConfigError, IndexFormatError, ShardError, WdsPadError
from ..io.redact import redact
from ..io.urls import expand_urls
from ..version import __version__
from .build import as_bucket_fn, check_options, default_name, rows_index, scan_shards
from .buckets.cost import CostFn, parse_cost
from .buckets.protocol import BucketFn
from .codec import load_index, serialize
from .layout import FORMAT_VERSION
from .merge import merged_parts
from .record import Index
from .jobstore import Job, failure, job_error, linger, new_job_id
from ..io.urls import local_path as _local
from .output import check_output, write_local
from .progress import Progress
from .shardfile import Stat, stat_shards
from .update import previous_index, update_and_rescan

__all__ = ["build_index_distributed", "part_layout"]

_log = logging.getLogger(__name__)
_PART_VERSION = 1  # bump when what a part holds changes


def part_layout(n_shards: int, part_shards: int) -> list[tuple[int, int]]:
    """The parts of ``n_shards`` shards: ``[(first, end), ...]`` runs of ``part_shards``."""
    if isinstance(part_shards, bool) or not isinstance(part_shards, int) or part_shards < 1:
        raise ConfigError(f"part_shards must be an int >= 1, got {part_shards!r}")
    return [(lo, min(lo + part_shards, n_shards)) for lo in range(0, n_shards, part_shards)]


def parts_dir(output: str) -> str:
    """The folder beside ``output`` that holds its parts while a job runs."""
    return output.rstrip("/") + ".parts"


def part_digest(urls: Sequence[str], stats: Sequence[Stat | None], fn: BucketFn, on_error: str,
                cost: CostFn | None = None, rescan: Collection[str] = ()) -> str:
    """What decides a part's content, hashed (a shard whose stat failed: ``None``; a
    shard named in ``rescan`` is marked, so a part written from its old rows is not reused)."""
    doc = {"part": _PART_VERSION, "format": FORMAT_VERSION, "wds_pad": __version__, "bucket_by": fn.describe(),
           "on_error": on_error, "shards": [[u, list(s) if s is not None else None] for u, s in zip(urls, stats)]}
    if cost is not None:  # (a part without costs keeps the digest it always had)
        doc["cost"] = cost.describe()
    again = [u for u in urls if u in rescan]
    if again:  # (and so does a part with no shard to rescan)
        doc["rescan"] = again
    return json_digest(doc, size=12)


def _stat_all(urls: Sequence[str], workers: int, storage_options: Mapping[str, Any] | None) -> list[Stat | None]:
    """Each shard's stat (None where it failed: its scan reports it, per on_error)."""
    return [None if isinstance(st, ShardError) else st for st in stat_shards(urls, workers, storage_options)]


def _exists(path: str, storage_options: Mapping[str, Any] | None) -> bool:
    local = _local(path)
    if local is not None:
        return os.path.isfile(local)
    from ..io.faults import call_store
    from ..io.fs import get_filesystem

    fs, fpath = get_filesystem(path, storage_options)
    return bool(call_store(lambda: fs.exists(fpath), path, what="index part"))


def _write(path: str, chunks: Iterable[bytes | memoryview], storage_options: Mapping[str, Any] | None) -> None:
    local = _local(path)
    if local is not None:
        write_local(local, chunks, path, what="an index part")
        return
    from ..io.faults import call_store
    from ..io.fs import get_filesystem

    fs, fpath = get_filesystem(path, storage_options)
    data = b"".join(bytes(c) for c in chunks)
    call_store(lambda: fs.pipe_file(fpath, data), path, what="index part",
               fix="check the output URL and that these credentials may write there")


def build_index_distributed(
    urls: str | Iterable[str],
    bucket_by: BucketFn | Callable[..., Hashable | None] | str | None = None,
    *,
    output: str,
    workers: int = 8,
    on_error: str = "raise",
    update: Index | str | None = None,
    storage_options: Mapping[str, Any] | None = None,
    members: Sequence[str] | None = None,
    head_bytes: int | None = None,
    name: str | None = None,
    progress: bool | None = False,
    force: bool = False,
    part_shards: int = 64,
    timeout: float = 600.0,
    cost: CostFn | str | None = None,
    rescan: str | Iterable[str] | None = None,
) -> Index | None:
    """Index tar shards with every rank of the default torch.distributed process group.

    Call it on every rank with the same arguments, after
    ``torch.distributed.init_process_group`` (any backend; ``wds-pad index
    --distributed`` under torchrun does this with gloo). The arguments are those of
    :func:`wds_pad.build_index`; ``output`` is required and, on several machines, must be
    a place every rank can write and rank 0 can read (a shared filesystem or an object
    store URL). Parts go to ``OUTPUT.parts/`` until the merge; a rerun after a crash
    reuses every finished part.

    Args:
        part_shards: shards per part (the unit of work and of a rerun's reuse); the
            layout depends on it and the shard list only, not on the world size.
        timeout: seconds a rank may go without a heartbeat before the job is stopped.
        rescan: with ``update``, shards scanned again whatever their size and change
            stamp (as for :func:`wds_pad.build_index`); a part holding one is redone.

    Returns:
        On rank 0 the merged Index (loaded from ``output``), on the other ranks None.

    Raises:
        ConfigError: no process group, bad arguments, or an output refused (before
            any shard is scanned, on every rank).
        ShardError, TarFormatError, BucketError, ...: a rank's error, raised on every
            rank with ``rank R failed:`` before it.
        ReadError: a rank stopped answering for ``timeout`` seconds, or the job's store
            went away.
        IndexFormatError: the parts could not be merged (more than 64 member
            extensions together, a damaged part).
    """
    dist = dist_for()
    if dist is None:
        raise ConfigError("build_index_distributed needs a torch.distributed process group: call "
                          "torch.distributed.init_process_group() first, or run `wds-pad index --distributed` "
                          "under torchrun")
    check_options(on_error, workers)
    part_layout(1, part_shards)  # checks part_shards
    if not isinstance(output, str) or not output:
        raise ConfigError(f"build_index_distributed needs an output path, got {output!r}")
    rank, world = dist.get_rank(), dist.get_world_size()
    fn = as_bucket_fn(bucket_by, members, head_bytes)
    cost_fn = parse_cost(cost) if cost is not None else None

    # 1. rank 0 expands the URLs and checks the output; every rank gets the list or the error
    box: list[Any] = [None]  # rank 0 fills it
    if rank == 0:
        try:
            shard_urls = expand_urls(urls, storage_options)
            check_output(output, shard_urls, force=force, storage_options=storage_options)
            again = update_and_rescan(update, rescan, output, shard_urls, storage_options)[1]
            box[0] = {"ok": True, "urls": shard_urls, "job": new_job_id(), "rescan": sorted(again)}
        except WdsPadError as exc:
            box[0] = {"ok": False, "type": type(exc).__name__, "message": str(exc)}
    box[0] = broadcast(box[0])
    if not box[0]["ok"]:
        raise job_error(box[0])
    shard_urls: list[str] = box[0]["urls"]
    again = frozenset(box[0]["rescan"])
    update = update_and_rescan(update, None, output, shard_urls, storage_options)[0]
    layout = part_layout(len(shard_urls), part_shards)
    folder = parts_dir(output)
    final_name = name or default_name(output, shard_urls)

    # 2. stat the shards of parts rank::world; which parts are missing (by digest)
    mine: dict[str, Any]
    previous = None
    try:
        previous = previous_index(update, fn, storage_options, cost_fn)
        own = list(range(rank, len(layout), world))
        flat = [u for i in own for u in shard_urls[layout[i][0]:layout[i][1]]]
        stats = dict(zip(flat, _stat_all(flat, workers, storage_options)))
        mine = {"ok": True, "parts": {}}
        for i in own:
            urls_i = shard_urls[layout[i][0]:layout[i][1]]
            st = [stats[u] for u in urls_i]
            path = f"{folder}/part-{i:06d}-{part_digest(urls_i, st, fn, on_error, cost_fn, again)}.wdsidx"
            done = _exists(path, storage_options)
            mine["parts"][i] = {"path": path, "done": done,
                                "stats": None if done else {u: s for u, s in zip(urls_i, st) if s is not None}}
    except Exception as exc:  # noqa: BLE001 - every rank must reach the gather
        mine = failure(rank, exc)
    gathered: list[Any] = all_gather(mine) or [mine]
    for status in gathered:
        if not status["ok"]:
            raise job_error(status)
    parts = {int(i): p for status in gathered for i, p in status["parts"].items()}
    paths = [parts[i]["path"] for i in range(len(layout))]
    missing = sorted(i for i, p in parts.items() if not p["done"])
    todo = missing[rank::world]  # the missing parts, dealt evenly over this run's ranks
    if rank == 0:
        _log.info("%d shards in %d parts of up to %d shards: %d to index, %d done before; %d ranks",
                  len(shard_urls), len(layout), part_shards, len(missing), len(layout) - len(missing), world)

    bar = _parts_bar(len(missing), progress) if rank == 0 and missing else None
    job = Job(box[0]["job"], rank, world, timeout, bar)
    try:
        # 3. each rank indexes and writes its parts
        verdict = None
        try:
            for k, i in enumerate(todo):
                verdict = job.stopped()
                if verdict is not None:
                    break
                lo, hi = layout[i]
                t0 = time.monotonic()
                rows = scan_shards(shard_urls[lo:hi], fn, workers=workers, on_error=on_error,
                                   storage_options=storage_options, bar=Progress(total=0, enabled=False),
                                   previous=previous, stats={u: tuple(s) for u, s in parts[i]["stats"].items()},
                                   cost=cost_fn, rescan=again)
                index = rows_index(rows, fn, on_error, "part", cost=cost_fn)
                _write(paths[i], serialize(index), storage_options)
                job.add("parts_done", 1)
                _log.info("rank %d: part %d (shards %d-%d, %d samples) written in %.1f s; %d of its %d parts",
                          rank, i, lo, hi - 1, len(index), time.monotonic() - t0, k + 1, len(todo))
            if verdict is None:
                job.set(f"done/{rank}", {"ok": True})
        except BaseException as exc:  # an error, Ctrl-C, SIGTERM: tell the others, then stop
            with contextlib.suppress(Exception):  # the store may be gone too: this error matters more
                status = failure(rank, exc)
                job.set(f"done/{rank}", status)
                job.add("failed", 1)
                if rank == 0:
                    job.set("verdict", status)
                    linger(job)
            raise
        finally:
            with contextlib.suppress(Exception):
                job.add("done_n", 1)
        if verdict is not None:
            job.add("ack", 1)
            raise job_error(verdict)

        # 4. rank 0 waits for every rank, merges, removes the parts; the others wait for it
        if rank != 0:
            result = job.wait(job.outcome, [0], "rank 0 merges the parts")
            job.add("ack", 1)
            if not result["ok"]:
                raise job_error(result)
            return None
        try:
            verdict = job.wait(job.all_done, range(1, world), "the ranks index their parts")
        except WdsPadError as exc:
            verdict = {"ok": False, "type": type(exc).__name__, "message": str(exc)}
        if not verdict["ok"]:
            job.set("verdict", verdict)
            linger(job)
            raise job_error(verdict)
        if bar is not None:
            bar.update(max(0, len(missing) - bar.n))
            bar.close()
            bar = None
        try:
            merged = _merge(paths, shard_urls, layout, fn, output, final_name, storage_options, force)
            _remove_parts(folder, storage_options)
        except Exception as exc:  # noqa: BLE001
            job.set("merged", failure(0, exc))
            linger(job)
            raise
        job.set("merged", {"ok": True})
        _log.info("rank 0: merged %d parts into %s (%d samples)", len(layout), redact(output), len(merged))
        linger(job)
        return merged
    finally:
        if bar is not None:
            bar.close()
        job.close()


def _parts_bar(total: int, progress: bool | None) -> Any:
    """Rank 0's bar of parts done across ranks (tqdm on stderr), or None."""
    enabled = sys.stderr.isatty() if progress is None else bool(progress)
    if not enabled or os.environ.get("TQDM_DISABLE") == "1":
        return None
    from tqdm.auto import tqdm

    return tqdm(total=total, desc="index parts", unit="part", file=sys.stderr, mininterval=0.5)


def _merge(paths: Sequence[str], shard_urls: Sequence[str], layout: Sequence[tuple[int, int]], fn: BucketFn,
           output: str, name: str, storage_options: Mapping[str, Any] | None, force: bool) -> Index:
    """Merge the parts (in order) into ``output``, streamed; the merged index, loaded."""
    tmp = tempfile.mkdtemp(prefix="wds_pad_merge_")
    try:
        loaded = []
        for path, (lo, hi) in zip(paths, layout):
            local = _local(path)
            if local is None:  # a remote part: fetched to local disk, then memory-mapped
                from ..io.faults import call_store
                from ..io.fs import get_filesystem

                fs, fpath = get_filesystem(path, storage_options)
                local = os.path.join(tmp, os.path.basename(fpath))
                call_store(lambda: fs.get_file(fpath, local), path, what="index part")
            if not os.path.isfile(local):
                raise IndexFormatError(f"index part {redact(path)!r} was written but rank 0 cannot see it: on several "
                                       "machines, -o must be on a filesystem every rank shares (or an object store URL)")
            part = load_index(local, verify=True)
            want = list(shard_urls[lo:hi])
            if list(part.urls) != want or dict(part.bucket_by) != dict(fn.describe()):
                raise IndexFormatError(f"index part {redact(path)!r} does not hold shards {lo}-{hi - 1} as this job "
                                       f"indexes them; delete {redact(parts_dir(output))!r} and rerun")
            loaded.append(part)
        check_output(output, shard_urls, force=force, storage_options=storage_options)
        local_out = _local(output)
        if local_out is not None:
            write_local(local_out, merged_parts(loaded, name=name, path=output), output)
            index = load_index(local_out, verify=False, location=output)
        else:  # a local temp file, then one upload
            from ..io.faults import call_store
            from ..io.fs import get_filesystem

            staged = os.path.join(tmp, "merged.wdsidx")
            write_local(staged, merged_parts(loaded, name=name, path=output), staged,
                        what="the merged index (staged for the upload)")
            fs, fpath = get_filesystem(output, storage_options)
            call_store(lambda: fs.put_file(staged, fpath), output, what="index output",
                       fix="check the output URL and that these credentials may write there")
            index = load_index(staged, verify=False, location=output)  # mapped: the pages outlive the temp file
        return index
    finally:
        shutil.rmtree(tmp, ignore_errors=True)


def _remove_parts(folder: str, storage_options: Mapping[str, Any] | None) -> None:
    """Remove the part folder: every part file of ours in it (stale ones too), then it."""
    local = _local(folder)
    if local is not None:
        try:
            names = os.listdir(local)
        except FileNotFoundError:
            return
        for n in names:
            if n.startswith(("part-", ".part-")) and (n.endswith(".wdsidx") or n.endswith(".tmp")):
                try:
                    os.unlink(os.path.join(local, n))
                except FileNotFoundError:
                    pass
        try:
            os.rmdir(local)
        except OSError:  # something else in it: left alone
            _log.warning("index: %s is not empty after the merge; left in place", local)
        return
    from ..io.fs import get_filesystem

    fs, fpath = get_filesystem(folder, storage_options)
    try:
        found = fs.ls(fpath, detail=False)
    except (FileNotFoundError, OSError):
        return
    ours = [p for p in found if p.rsplit("/", 1)[-1].startswith("part-") and p.endswith(".wdsidx")]
    if ours:
        fs.rm(ours)
