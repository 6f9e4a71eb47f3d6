"""Tests of ``wds-pad plan``, run as a real subprocess: JSON records, --rank all, the
summary table, steps mode, one-line usage errors with exit code 2, and a fast start
that never imports torch."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from collections import Counter, defaultdict
from pathlib import Path
from typing import Any

import numpy as np
import pytest

from wds_pad import Dataset, Topology, plan_epoch

ROOT = Path(__file__).resolve().parents[2]
KEYS = {"rank", "dp_rank", "step", "epoch", "dataset", "bucket", "samples", "pad", "seeds"}


def wds_pad(*args: str) -> subprocess.CompletedProcess[str]:
    env = dict(os.environ, PYTHONPATH=str(ROOT))
    return subprocess.run([sys.executable, "-m", "wds_pad.cli", *args], capture_output=True, text=True,
                          timeout=60, env=env, cwd=ROOT)


def plan_json(*args: str) -> list[dict[str, Any]]:
    out = wds_pad("plan", *args, "--json")
    assert out.returncode == 0, out.stderr
    records = [json.loads(line) for line in out.stdout.splitlines()]
    assert records and all(set(r) == KEYS for r in records)
    return records


BASE = ["--buckets", "a=4,b=0,c=7", "--seed", "3"]


def test_json_records_match_the_library() -> None:
    recs = plan_json(*BASE, "--world-size", "4", "--rank", "all", "--batch-size", "2", "--oversubscribe")
    assert sorted({r["rank"] for r in recs}) == [0, 1, 2, 3]
    # ids are numbered from 0 in listed order: a = 0..3, c = 4..10; b is empty
    ds = Dataset("synthetic", {"a": np.arange(0, 4), "b": np.arange(0), "c": np.arange(4, 11)})
    for rank in range(4):
        topo = Topology(4, rank)
        expected = [b.to_json(topo) for b in plan_epoch(ds, topo, seed=3, batch_size=2, oversubscribe=True)]
        assert [r for r in recs if r["rank"] == rank] == expected
    by_bucket = defaultdict(list)
    for r in recs:
        assert r["dataset"] == "synthetic" and r["epoch"] == 0 and len(r["samples"]) == len(r["pad"]) == 2
        by_bucket[r["bucket"]] += [s for s, p in zip(r["samples"], r["pad"]) if not p]
    assert sorted(by_bucket) == ["a", "c"]
    assert sorted(by_bucket["a"]) == [0, 1, 2, 3]
    assert sorted(by_bucket["c"]) == list(range(4, 11))


def test_single_rank_and_cp_peers() -> None:
    recs = plan_json(*BASE, "--world-size", "4", "--cp-size", "2", "--rank", "all", "--batch-size", "2",
                     "--oversubscribe")
    per_rank = defaultdict(list)
    for r in recs:
        assert r["dp_rank"] == r["rank"] // 2
        per_rank[r["rank"]].append((r["step"], r["bucket"], r["samples"], r["pad"]))
    assert per_rank[0] == per_rank[1] and per_rank[2] == per_rank[3] and per_rank[0] != per_rank[2]
    only = plan_json(*BASE, "--world-size", "4", "--cp-size", "2", "--rank", "3", "--batch-size", "2",
                     "--oversubscribe")
    assert {r["rank"] for r in only} == {3}
    assert [(r["step"], r["bucket"], r["samples"], r["pad"]) for r in only] == per_rank[3]


def test_policies_repeats_and_epoch() -> None:
    none = plan_json(*BASE, "--world-size", "3", "--rank", "all", "--batch-size", "2", "--pad", "none")
    assert Counter(s for r in none for s in r["samples"]) == {i: 1 for i in range(11)}
    # uneven on purpose: a gives ranks 2,1,1 entries (1 batch each), c gives 3,2,2 (2,1,1 batches)
    assert Counter(r["rank"] for r in none) == {0: 3, 1: 2, 2: 2}
    rep = plan_json(*BASE, "--world-size", "2", "--rank", "all", "--batch-size", "2", "--pad", "drop",
                    "--repeats", "1")
    counts = Counter(s for r in rep for s in r["samples"])
    assert {i: counts[i] for i in range(4)} == {i: 2 for i in range(4)}  # a: 8 entries, a multiple of 4
    assert set(counts) <= set(range(11)) and max(counts.values()) == 2
    assert sum(len(r["samples"]) for r in rep if r["bucket"] == "c") == 12  # 14 entries -> 12
    assert not any(p for r in rep for p in r["pad"])
    short = plan_json(*BASE, "--world-size", "2", "--rank", "0", "--batch-size", "4", "--pad", "cyclic",
                      "--pad-to", "rank")
    assert [len(r["samples"]) for r in short] == [2, 4]  # c: 7 -> 8 = 4 per rank; a: 4 -> 2 per rank
    e0 = plan_json(*BASE, "--world-size", "2", "--rank", "0", "--batch-size", "2")
    e5 = plan_json(*BASE, "--world-size", "2", "--rank", "0", "--batch-size", "2", "--epoch", "5")
    assert {r["epoch"] for r in e5} == {5}
    assert [r["samples"] for r in e0] != [r["samples"] for r in e5]


def test_steps_mode_prints_exactly_k_global_steps_across_epochs() -> None:
    recs = plan_json(*BASE, "--world-size", "2", "--rank", "1", "--batch-size", "2", "--mode", "steps",
                     "--steps", "7")
    assert [(r["epoch"], r["step"]) for r in recs] == [(0, 0), (0, 1), (1, 0), (1, 1), (2, 0), (2, 1), (3, 0)]
    assert not any(p for r in recs for p in r["pad"])  # auto in steps mode = drop


def test_summary_table() -> None:
    out = wds_pad("plan", *BASE, "--world-size", "4", "--rank", "0", "--batch-size", "2", "--summary")
    assert out.returncode == 0
    lines = out.stdout.splitlines()
    assert lines[0] == "epoch 0: world_size 4, dp_size 4, cp_size 1, batch 2, policy cyclic, pad unit 8"
    assert lines[1].split() == ["dataset", "bucket", "samples", "repeats", "padded", "len", "pad", "copies",
                                "pad", "%", "truncated", "status", "steps/epoch"]
    rows = {line.split()[1]: line.split() for line in lines[3:6]}
    assert rows["a"] == ["synthetic", "a", "4", "0", "0", "0", "0.0%", "4", "dropped", "0"]
    assert rows["b"] == ["synthetic", "b", "0", "0", "0", "0", "0.0%", "0", "empty", "0"]
    assert rows["c"] == ["synthetic", "c", "7", "0", "0", "0", "0.0%", "7", "dropped", "0"]
    assert lines[6].startswith("total: 11 samples, 0 padded copies, 11 samples in dropped buckets")
    assert "wds-pad plan: warning:" in out.stderr and "'a'" in out.stderr
    kept = wds_pad("plan", *BASE, "--world-size", "4", "--rank", "0", "--batch-size", "2", "--summary",
                   "--oversubscribe")
    rows = {line.split()[1]: line.split() for line in kept.stdout.splitlines()[3:6]}
    assert rows["a"] == ["synthetic", "a", "4", "0", "8", "4", "50.0%", "0", "oversubscribed", "1"]
    assert rows["c"] == ["synthetic", "c", "7", "0", "8", "1", "12.5%", "0", "oversubscribed", "1"]
    assert kept.stderr == ""


def test_summary_for_every_rank_ends_with_every_rank() -> None:
    args = ["--buckets", "16:9=9,1:1=20,9:16=9,1:2=8,4:3=8", "--seed", "3", "--world-size", "4",
            "--batch-size", "2", "--summary"]
    every = wds_pad("plan", *args, "--rank", "all")
    one = wds_pad("plan", *args, "--rank", "2")
    assert every.returncode == one.returncode == 0
    last = every.stdout.splitlines()[-1]
    assert "on rank 0" not in last and last.endswith(", 9 steps per epoch, 9 batches on every one of the 4 ranks")
    assert one.stdout.splitlines()[-1].endswith(", 9 batches on rank 2")
    rows = [ln.split()[1] for ln in every.stdout.splitlines()[3:-1]]
    assert rows == ["1:2", "9:16", "1:1", "4:3", "16:9"]  # by ratio, not as strings


@pytest.mark.parametrize(
    ("args", "match"),
    [
        (["--buckets", "a=x"], "count 'x' is not an integer"),
        (["--buckets", "a4"], "is not NAME=COUNT"),
        (["--buckets", "a=-2"], "count must be >= 0"),
        (["--buckets", "a=1,a=2"], "listed twice"),
        (["--buckets", "a=4", "--rank", "2"], "--rank 2 is out of range for --world-size 2"),
        (["--buckets", "a=4", "--rank", "x"], "--rank must be an integer or 'all'"),
        (["--buckets", "a=4", "--cp-size", "3"], "not divisible by cp_size 3"),
        (["--buckets", "a=4", "--batch-size", "0"], "expected a positive integer, got 0"),
        (["--buckets", "a=4", "--pad", "weird"], "invalid choice: 'weird'"),
        (["--buckets", "a=4", "--mode", "steps"], "--mode steps needs --steps K"),
        (["--buckets", "a=4", "--locality", "bogus"], "unknown locality 'bogus'; expected one of: none, shard"),
        (["--buckets", "a=4", "--local-world-size", "3"], "--local-world-size 3 (processes per node) is more than --world-size 2"),
        (["--buckets", "a=4", "--summary"], "not allowed with argument"),
        ([], "give either INDEX file(s) or --buckets"),
        (["--buckets", "a=4", "--seed", "18446744073709551616"], "seed must be in [0, 2**64), got 18446744073709551616"),
        (["--buckets", "a=4", "--seed", "-1"], "seed must be in [0, 2**64), got -1"),
        (["--buckets", "a=4", "--seed", "1.5"], "seed must be an integer, got '1.5'"),
        (["--buckets", "a=4", "--epoch", "1.5"], "epoch must be an integer, got '1.5'"),
        (["--buckets", "a=4", "--epoch", "2147483648"], "epoch must be in [0, MAX_EPOCH=2147483647], got 2147483648"),
        (["--buckets", "a=4", "--batch-size", "10000000000000", "--pad", "cyclic", "--oversubscribe"],
         "would be filled cyclically (oversubscribe) to one global step of 20000000000000 entries"),
    ],
)
def test_bad_arguments_print_one_line_and_exit_2(args: list[str], match: str) -> None:
    full = {"--world-size": "2", "--rank": "0", "--batch-size": "1", "--seed": "0"}
    for i in range(0, len(args) - 1):
        if args[i] in full:
            full[args[i]] = args[i + 1]
    rest = [a for i, a in enumerate(args) if a not in full and (i == 0 or args[i - 1] not in full)]
    argv = ["plan", *[x for kv in full.items() for x in kv], *rest, "--json"]
    out = wds_pad(*argv)
    assert out.returncode == 2, (argv, out.stderr)
    assert out.stdout == ""
    lines = out.stderr.splitlines()
    assert len(lines) == 1, out.stderr
    assert lines[0].startswith("wds-pad plan: error: ") and match in lines[0]


def test_missing_output_flag_and_unknown_command_are_usage_errors() -> None:
    for argv in (["plan", *BASE, "--world-size", "2", "--rank", "0", "--batch-size", "1"], ["frob"], []):
        out = wds_pad(*argv)
        assert out.returncode == 2 and len(out.stderr.splitlines()) == 1 and out.stdout == ""


def test_help_exits_zero() -> None:
    out = wds_pad("plan", "--help")
    assert out.returncode == 0 and "--oversubscribe" in out.stdout and "--pad-to" in out.stdout


_NO_TORCH = r"""
import contextlib, io, sys
from wds_pad.cli.app import main
buf = io.StringIO()
with contextlib.redirect_stdout(buf), contextlib.redirect_stderr(io.StringIO()):
    for out in ("--json", "--summary"):
        main(["plan", "--buckets", "a=4,c=7", "--world-size", "4", "--cp-size", "2", "--rank", "all",
              "--batch-size", "2", "--seed", "1", out])
    main(["plan", "--buckets", "a=4,c=7", "--world-size", "4", "--rank", "1", "--batch-size", "2", "--seed", "1",
          "--mode", "steps", "--steps", "3", "--json"])
assert buf.getvalue()
print(sorted(m for m in sys.modules if m == "torch" or m.startswith("torch.")))
"""


def test_plan_never_imports_torch() -> None:
    out = subprocess.run([sys.executable, "-c", _NO_TORCH], capture_output=True, text=True, timeout=60,
                         env=dict(os.environ, PYTHONPATH=str(ROOT)))
    assert out.returncode == 0, out.stderr
    assert out.stdout.strip() == "[]"


def test_cli_starts_fast() -> None:
    """CPU time of a whole ``wds-pad plan`` run (CPU, not wall time: CI machines are shared)."""
    import resource

    argv = [sys.executable, "-m", "wds_pad.cli", "plan", *BASE, "--world-size", "8", "--rank", "all",
            "--batch-size", "2", "--oversubscribe", "--json"]
    best = float("inf")
    for _ in range(3):
        before = resource.getrusage(resource.RUSAGE_CHILDREN)
        subprocess.run(argv, capture_output=True, check=True, timeout=60, env=dict(os.environ, PYTHONPATH=str(ROOT)))
        after = resource.getrusage(resource.RUSAGE_CHILDREN)
        best = min(best, after.ru_utime - before.ru_utime + after.ru_stime - before.ru_stime)
    assert best < 0.8, f"wds-pad plan used {best:.2f} s of CPU"


def test_every_command_in_the_planning_doc_prints_what_the_doc_shows() -> None:
    import shlex

    text = (ROOT / "docs" / "planning.md").read_text()
    blocks = [b.split("```", 1)[0] for b in text.split("```console\n")[1:]]
    checked = 0
    for block in blocks:
        lines = block.splitlines()
        if not lines or not lines[0].startswith("$ wds-pad "):
            continue
        argv = shlex.split(lines[0][len("$ wds-pad "):])
        out = wds_pad(*argv)
        shown = "\n".join(lines[1:]) + "\n"
        assert (out.stdout if out.returncode == 0 else out.stderr) == shown, lines[0]
        checked += 1
    assert checked >= 10


def test_a_dropped_bucket_warning_is_one_line_of_advice() -> None:
    out = wds_pad("plan", "--buckets", "a=4,c=7", "--world-size", "8", "--rank", "0",
                  "--batch-size", "1", "--seed", "3", "--summary")
    assert out.returncode == 0
    lines = out.stderr.splitlines()
    assert len(lines) == 1 and lines[0].startswith("wds-pad plan: warning: 2 bucket(s)"), out.stderr
    assert "--oversubscribe" in lines[0]


@pytest.mark.parametrize("seed", [0, 2**64 - 1, -1, 2**64])
def test_cli_and_api_accept_exactly_the_same_seeds(seed: int) -> None:
    from wds_pad import ConfigError, shared_seed

    try:
        api_ok = shared_seed(seed) == seed
        plan_epoch({"a": [1]}, Topology(1, 0), seed=seed, batch_size=1)
    except ConfigError:
        api_ok = False
    out = wds_pad("plan", "--buckets", "a=1", "--world-size", "1", "--rank", "0", "--batch-size", "1",
                  "--seed", str(seed), "--json")
    assert (out.returncode == 0) == api_ok == (0 <= seed < 2**64), out.stderr
    if not api_ok:
        assert out.returncode == 2 and "seed must be in [0, 2**64)" in out.stderr


@pytest.mark.parametrize("epoch", ["0", "2147483647", "-1", "2147483648", "1.5", "2e3"])
def test_cli_and_api_accept_exactly_the_same_epochs(epoch: str) -> None:
    from wds_pad import ConfigError

    try:
        api_ok = plan_epoch({"a": [1]}, Topology(1, 0), seed=1, epoch=int(epoch), batch_size=1).epoch == int(epoch)
    except (ConfigError, ValueError):
        api_ok = False
    out = wds_pad("plan", "--buckets", "a=1", "--world-size", "1", "--rank", "0", "--batch-size", "1",
                  "--seed", "1", "--epoch", epoch, "--json")
    assert (out.returncode == 0) == api_ok, out.stderr
    if api_ok:
        assert json.loads(out.stdout.splitlines()[0])["epoch"] == int(epoch)
    else:
        assert out.returncode == 2 and "epoch must be" in out.stderr


# -- --locality and --window ----------------------------------------------------------

def _blob_index(tmp_path: Path) -> Path:
    shards = tmp_path / "shards"
    subprocess.run([sys.executable, str(ROOT / "tools" / "make_shards.py"), "blobs", str(shards),
                    "--samples", "400", "--shards", "10", "--sample-bytes", "500"],
                   check=True, capture_output=True)
    index = tmp_path / "ix.wdsidx"
    subprocess.run([sys.executable, "-m", "wds_pad", "index", str(shards / "*.tar"), "-o", str(index),
                    "--bucket-by", "aspect", "--no-progress"], check=True, capture_output=True)
    return index


def test_locality_shard_in_plan_json_and_summary(tmp_path: Path) -> None:
    from wds_pad import load_index
    from wds_pad.core.local.locality import shard_map_of

    index = _blob_index(tmp_path)
    args = [str(index), "--world-size", "4", "--rank", "2", "--batch-size", "4", "--seed", "3"]
    def records(*more: str) -> list[dict[str, Any]]:
        out = wds_pad("plan", *args, *more, "--json")
        assert out.returncode == 0, out.stderr
        return [json.loads(line) for line in out.stdout.splitlines()]

    got = records("--locality", "shard", "--window", "2")
    ix = load_index(str(index))
    ref = plan_epoch(shard_map_of(ix, ix.to_dataset()), Topology(4, 2), seed=3, batch_size=4,
                     locality="shard", window=2)
    assert [r["samples"] for r in got] == [b.samples.tolist() for b in ref]
    none = records()
    assert [r["step"] for r in got] == [r["step"] for r in none]  # the same schedule
    assert [r["samples"] for r in got] != [r["samples"] for r in none]
    out = wds_pad("plan", *args, "--summary", "--locality", "shard", "--window", "2")
    assert out.returncode == 0, out.stderr
    lines = [ln for ln in out.stdout.splitlines() if ln.startswith("locality ")]
    assert lines[0].startswith("locality shard: rank 2 reads ") and "GETs per epoch" in lines[0]
    assert lines[1].startswith("locality none (the other choice): rank 2 reads 0 shards whole")
    assert "bytes read / used" in lines[0] and "distinct shards per batch" in lines[1]
    bad = wds_pad("plan", "--buckets", "a=4", "--world-size", "2", "--rank", "0", "--batch-size", "2",
                  "--seed", "0", "--summary", "--locality", "shard")
    assert bad.returncode == 2 and "--locality shard needs INDEX file(s)" in bad.stderr
    what_if = wds_pad("inspect", str(index), "--world-size", "4", "--batch-size", "4", "--locality", "shard")
    assert what_if.returncode == 0 and "locality shard: rank 0 reads" in what_if.stdout
    pytest.importorskip("matplotlib")
    plot = wds_pad("inspect", str(index), "--world-size", "4", "--batch-size", "4", "--locality", "shard",
                   "--plot", str(tmp_path / "p.png"))
    assert plot.returncode == 0, plot.stderr
    assert (tmp_path / "p.png").stat().st_size > 1000


def _windows(records: list[dict[str, Any]]) -> dict[int, tuple[str, list[str]]]:
    """step -> (bucket, its samples over the ranks in rank order, a padded copy marked ``*``)."""
    out: dict[int, tuple[str, list[str]]] = {}
    for r in sorted(records, key=lambda r: (r["step"], r["rank"])):
        bucket, samples = out.setdefault(r["step"], (r["bucket"], []))
        samples += [f"{s}*" if pad else str(s) for s, pad in zip(r["samples"], r["pad"])]
    return out


def _listed(text: str) -> list[str]:
    return [x.strip() for x in text.split(",") if x.strip()]


@pytest.mark.parametrize("policy", ["cyclic", "drop"])
def test_planning_doc_prose_names_the_windows_its_command_prints(policy: str) -> None:
    import re

    from doc_blocks import prose

    text = prose(ROOT / "docs" / "planning.md")
    section = " ".join(text.split(f"### {policy}\n", 1)[1].split("\n### ", 1)[0].split())
    windows = _windows(plan_json(*BASE, "--world-size", "4", "--rank", "all", "--batch-size", "1", "--pad", policy))
    claims = [(int(m[1]), m[2]) for m in re.finditer(r"step (\d+) (?:is|its)[^`]*?`\[([^\]]*)\]`", section)]
    claims += [(int(m[2]), m[1]) for m in re.finditer(r"`\[([^\]]*)\]` \(step (\d+)\)", section)]
    assert claims, section
    for step, listed in claims:  # "step 1 is c's first window `[9, 7, 5, 10]`", "`[9, 7, 5, 10]` (step 1)"
        assert _listed(listed) == windows[step][1], (policy, step, listed, windows)
    for m in re.finditer(r"step (\d+) is (\w)'s", section):
        assert windows[int(m[1])][0] == m[2], (policy, m[0], windows)
    c = [s for _, (bucket, samples) in sorted(windows.items()) if bucket == "c" for s in samples]
    if policy == "cyclic":  # the shuffled order, then its prefix as padded copies
        order = _listed(re.search(r"shuffled order for seed 3 is `\[([^\]]*)\]`", section)[1])
        assert c == order + [f"{order[0]}*"]
    else:  # kept: the first entries of the same order (the cyclic section's); lost: the rest
        order = _listed(re.search(r"shuffled order for seed 3 is `\[([^\]]*)\]`", " ".join(text.split()))[1])
        lost = re.search(r"loses the other (\d+) \(`\[([^\]]*)\]`\)", section)
        assert c == order[: len(c)] and _listed(lost[2]) == order[len(c):] and int(lost[1]) == len(order) - len(c)


def test_summary_reports_shuffle_quality_and_the_gets_of_the_ranks_node(tmp_path: Path) -> None:
    from dataclasses import asdict

    from wds_pad import load_index
    from wds_pad.cli.readfigures import figures, node_figures
    from wds_pad.core.local.locality import shard_map_of
    from wds_pad.io.options import ReadOptions

    index = _blob_index(tmp_path)
    ix = load_index(str(index))
    reads = ([ix.shard], [ix.length], [[s.size for s in ix.shards]], ReadOptions().block_bytes)
    sources = {"none": ix.to_dataset(), "shard": shard_map_of(ix, ix.to_dataset())}

    def plans(locality: str, world: int, ranks: range, local: int) -> list[Any]:
        return [plan_epoch(sources[locality], Topology(world, r, local_world_size=local), seed=3, batch_size=4,
                           locality=locality, window=2, warn=False) for r in ranks]

    args = [str(index), "--world-size", "4", "--rank", "2", "--batch-size", "4", "--seed", "3", "--window", "2"]
    out = wds_pad("plan", *args, "--summary", "--locality", "shard", "--local-world-size", "2")
    assert out.returncode == 0, out.stderr
    lines = out.stdout.splitlines()
    at = [i for i, line in enumerate(lines) if line.startswith("locality ")]
    assert [lines[i].split(":")[0] for i in at] == ["locality shard", "locality none (the other choice)"]
    for i, locality in zip(at, ("shard", "none")):
        node_plans = plans(locality, 4, range(2, 4), 2)
        f = figures(node_plans[0], *reads)
        assert f"{f.distinct_per_batch:.1f} distinct shards per batch, shuffle quality {f.shuffle_quality:.2f} bits, " \
            f"{f.gets} GETs per epoch" in lines[i]
        node = node_figures(node_plans, *reads)
        head = f"  node 1 (ranks 2-3, one copy of each shard): holds {node.shards} shards, {node.gets} GETs per epoch"
        if locality == "shard":
            assert node.shards > 0
            assert lines[i + 1] == (f"{head} = {node.gets / node.shards:.2f} x the shards it holds ({node.single} "
                                    f"single reads of shards it does not hold, {node.served} served by its copy); "
                                    f"{node.alone} without sharing")
        else:
            assert lines[i + 1] == f"{head} (every sample a single read); {node.alone} without sharing"
    alone = wds_pad("plan", *args, "--summary", "--locality", "shard")
    assert alone.returncode == 0 and not any(line.startswith("  node ") for line in alone.stdout.splitlines())
    # inspect --json carries the same figures, rank 0's and node 0's
    got = wds_pad("inspect", str(index), "--world-size", "8", "--batch-size", "4", "--seed", "3", "--window", "2",
                  "--locality", "shard", "--local-world-size", "4", "--json")
    assert got.returncode == 0, got.stderr
    reading = json.loads(got.stdout)["reading"]
    assert list(reading) == ["shard", "none"]
    for locality in ("shard", "none"):
        node_plans = plans(locality, 8, range(0, 4), 4)
        f, node = figures(node_plans[0], *reads), node_figures(node_plans, *reads)
        assert reading[locality] == {**asdict(f), "foreign_fraction": f.foreign_fraction,
                                     "node": {**asdict(node), "gets_per_shard": node.gets_per_shard}}
    assert reading["none"]["node"]["gets"] == sum(p.samples.size for p in plans("none", 8, range(0, 4), 4))
    lonely = wds_pad("inspect", str(index), "--world-size", "8", "--batch-size", "4", "--local-world-size", "4")
    assert lonely.returncode == 2 and lonely.stdout == ""
    assert lonely.stderr == ("wds-pad inspect: error: --local-world-size L needs --locality (with --world-size and "
                             "--batch-size): it adds node 0's reading cost to the locality lines\n")


# -- plan --summary under a budget, the node layout in flags ------------------------------------------
@pytest.fixture(scope="module")
def costed(tmp_path_factory: pytest.TempPathFactory) -> Any:
    from wds_pad.cli.synth import make_image_shards
    from wds_pad.index.build import build_index
    from wds_pad.index.codec import load_index

    folder = tmp_path_factory.mktemp("costed")
    paths = make_image_shards(folder, samples=90, shards=6, seed=2)
    return load_index(build_index(paths, "aspect:width,height", output=str(folder / "c.wdsidx"),
                                  cost="image:pixels").path)


def _plan_main(capsys: pytest.CaptureFixture[str], *args: str) -> tuple[int, str, str]:
    from wds_pad.cli.app import main

    code = main(["plan", *args])
    got = capsys.readouterr()
    return code, got.out, got.err


def test_summary_mean_fill_counts_each_real_sample_once(costed: Any, capsys: pytest.CaptureFixture[str]) -> None:
    import re

    from wds_pad import Budget

    limit = 3 * float(np.median(np.asarray(costed.cost)))
    code, out, _ = _plan_main(capsys, costed.path, "--world-size", "4", "--rank", "0", "--seed", "3",
                              "--budget", str(limit), "--pad", "cyclic", "--summary")
    assert code == 0
    real = copies = batches = 0.0
    ds = costed.to_dataset(costs=True)
    for d in range(4):
        for b in plan_epoch(ds, Topology(4, d), seed=3, batch_size=Budget(limit), policy="cyclic", warn=False):
            real += float(costed.cost[b.samples[~b.pad]].sum())
            copies += float(costed.cost[b.samples[b.pad]].sum())
            batches += 1
    assert copies > 0, "the case must have padded copies to leave out"
    line = re.search(r"mean fill ([\d.]+)% over (\d+) batches", out)
    assert line is not None, out
    assert int(line.group(2)) == batches
    assert float(line.group(1)) == pytest.approx(100 * real / batches / limit, abs=0.051)


@pytest.mark.parametrize("locality,unit", [("none", 4), ("shard", 8)])
def test_summary_says_the_pad_unit_the_budget_padded_to(costed: Any, capsys: pytest.CaptureFixture[str],
                                                        locality: str, unit: int) -> None:
    """Under a budget with 2 accumulation steps a shard-local plan pads each bucket to dp x 2
    entries (each rank's in whole optimizer steps), the strata of locality none to dp: the
    header says the unit the table's padded lengths are multiples of."""
    limit = 3 * float(np.median(np.asarray(costed.cost)))
    code, out, _ = _plan_main(capsys, costed.path, "--world-size", "4", "--rank", "0", "--seed", "3",
                              "--budget", str(limit), "--pad", "cyclic", "--accumulation-steps", "2",
                              "--locality", locality, "--summary")
    assert code == 0
    lines = out.splitlines()
    assert lines[0].endswith(f"policy cyclic, pad unit {unit}, accumulation 2"), lines[0]
    padded = [int(line.split()[4]) for line in lines[3:] if line.split()[-2:-1] == ["kept"]]
    assert padded and all(n % unit == 0 for n in padded)


def test_summary_prints_a_fill_far_over_the_budget_as_a_multiple(costed: Any,
                                                                   capsys: pytest.CaptureFixture[str]) -> None:
    import re

    code, out, _ = _plan_main(capsys, costed.path, "--world-size", "2", "--rank", "0", "--seed", "3",
                              "--budget", "1e-27", "--summary")
    assert code == 0
    fill = re.search(r"mean fill (\S+) over", out)
    assert fill is not None and re.fullmatch(r"\d\.\d\de\+\d\dx", fill.group(1)), fill
    assert not re.search(r"\d{8}", out), "no figure of dozens of digits"


@pytest.mark.parametrize(("args", "message"), [
    (["--locality", "node"], "--locality node needs --local-world-size L, the processes each node runs"),
    (["--local-world-size", "8"], "--local-world-size 8 (processes per node) is more than --world-size 4 "
                                  "(processes of the whole job)"),
    (["--local-world-size", "3"], "--world-size 4 is not divisible by --local-world-size 3"),
    (["--locality", "node", "--local-world-size", "4", "--cp-size", "4"], None),
])
def test_the_node_layout_is_refused_in_flags(costed: Any, capsys: pytest.CaptureFixture[str], args: list[str],
                                              message: str | None) -> None:
    argv = [costed.path, "--world-size", "4", "--rank", "0", "--seed", "3", "--batch-size", "2", "--json", *args]
    if message is None:
        assert _plan_main(capsys, *argv)[0] == 0
        return
    code, _, err = _plan_main(capsys, *argv)
    assert code == 2 and message in err and "Topology(" not in err and "_size" not in err
