"""Real multi-process runs for the distributed tests: a launcher, worker scenarios, checks.

The launcher starts N processes the way torchrun does (``RANK``, ``WORLD_SIZE``,
``LOCAL_RANK``, ``MASTER_ADDR=127.0.0.1``, a free ``MASTER_PORT``), each in its own
session so that one ``killpg`` also ends its DataLoader workers. Every run has a hard
timeout: on expiry all process groups are killed and the test fails with every rank's
output. When one rank fails, the others get a short grace period, then are killed too
(fail fast, as torchrun does), so no test waits for a collective that never completes.

Run as a script (``python dist_helpers.py OUT_DIR SCENARIOS_JSON``) this module is the
worker side: it joins the gloo process group, runs the scenarios in turn, and writes their
results to ``OUT_DIR/rank<r>.json`` for the parent to check.

Invariant checks (:func:`check_epoch`) follow /work/shared/design.md: equal batch
counts, the same bucket at the same step, identical batches for CP peers, and over all
DP ranks exactly the padded plan.
"""

from __future__ import annotations

import json
import os
import signal
import socket
import subprocess
import sys
import tempfile
import time
from collections import Counter, defaultdict
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Callable, Mapping, Sequence

HERE = Path(__file__).resolve().parent
ROOT = HERE.parent
EXAMPLE = ROOT / "examples" / "train_ddp.py"

# -- the launcher (parent side) ---------------------------------------------------------


def free_port() -> int:
    """A TCP port on 127.0.0.1 that was free a moment ago (the OS picks it)."""
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


@dataclass
class RankResult:
    rank: int
    returncode: int | None  # None: killed by the launcher
    stdout: str
    stderr: str


class JobFailed(AssertionError):
    """A launched job timed out or a rank failed; the message holds every rank's output."""


def format_outputs(results: Sequence[RankResult], limit: int = 4000) -> str:
    parts = []
    for r in results:
        parts.append(f"--- rank {r.rank} (exit {r.returncode}) stdout ---\n{r.stdout[-limit:]}"
                     f"\n--- rank {r.rank} stderr ---\n{r.stderr[-limit:]}")
    return "\n".join(parts)


@dataclass
class Job:
    """N processes of one command, started like torchrun starts them.

    Args:
        argv: the command of every rank (``[sys.executable, script, ...]``).
        nprocs: number of ranks.
        timeout: seconds before every process group is killed and :meth:`wait` fails.
        grace: seconds the other ranks get once one rank has failed.
        env: extra environment variables.

    ``{port}`` in ``argv`` is replaced by the free port chosen at :meth:`start` (for
    ``torch.distributed.run --master_port {port}``). As a context manager it starts on
    entry and closes (every process group killed and reaped) on exit.
    """

    argv: Sequence[str]
    nprocs: int
    timeout: float = 120.0
    grace: float = 20.0
    env: Mapping[str, str] = field(default_factory=dict)
    port: int = 0
    procs: list[subprocess.Popen[bytes]] = field(default_factory=list)
    _files: list[tuple[Any, Any]] = field(default_factory=list)
    _killed: set[int] = field(default_factory=set)
    _deadline: float = 0.0

    def start(self) -> "Job":
        self.port = free_port()
        argv = [a.replace("{port}", str(self.port)) for a in self.argv]
        base = {**os.environ, "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": str(self.port),
                "WORLD_SIZE": str(self.nprocs), "LOCAL_WORLD_SIZE": str(self.nprocs),
                "GLOO_SOCKET_IFNAME": "lo", "OMP_NUM_THREADS": "1", "PYTHONUNBUFFERED": "1",
                **self.env}
        for rank in range(self.nprocs):
            out, err = tempfile.TemporaryFile(), tempfile.TemporaryFile()
            env = {**base, "RANK": str(rank), "LOCAL_RANK": str(rank)}
            self.procs.append(subprocess.Popen(argv, env=env, stdout=out, stderr=err,
                                               stdin=subprocess.DEVNULL, start_new_session=True))
            self._files.append((out, err))
        self._deadline = time.monotonic() + self.timeout
        return self

    def __enter__(self) -> "Job":
        return self.start()

    def __exit__(self, *exc: object) -> None:
        self.close()

    def kill(self, sig: int = signal.SIGKILL) -> None:
        """Send ``sig`` to every rank's process group (the rank and its workers)."""
        for rank, p in enumerate(self.procs):
            try:
                os.killpg(p.pid, sig)
            except ProcessLookupError:
                continue
            if p.poll() is None:
                self._killed.add(rank)

    def running(self) -> bool:
        return any(p.poll() is None for p in self.procs)

    def check_deadline(self) -> None:
        """Kill everything and fail if the job has outlived its timeout."""
        if time.monotonic() > self._deadline:
            self.kill()
            results = self.collect()
            raise JobFailed(f"job {' '.join(map(str, self.argv[1:3]))} x{self.nprocs} timed out after "
                            f"{self.timeout:.0f} s; killed every rank.\n{format_outputs(results)}")

    def wait(self) -> list[RankResult]:
        """Wait for every rank (fail-fast after a failure); returns their results."""
        failed_at: float | None = None
        while self.running():
            self.check_deadline()
            if failed_at is None and any(p.poll() not in (None, 0) for p in self.procs):
                failed_at = time.monotonic()
            if failed_at is not None and time.monotonic() - failed_at > self.grace:
                self.kill()
                break
            time.sleep(0.05)
        return self.collect()

    def collect(self) -> list[RankResult]:
        results = []
        for rank, (p, (out, err)) in enumerate(zip(self.procs, self._files)):
            code = p.wait()
            texts = []
            for f in (out, err):
                f.seek(0)
                texts.append(f.read().decode("utf-8", "replace"))
            results.append(RankResult(rank, None if rank in self._killed else code, *texts))
        return results

    def close(self) -> None:
        self.kill()
        for p in self.procs:
            p.wait()
        for out, err in self._files:
            out.close()
            err.close()


def launch(argv: Sequence[str], nprocs: int, *, timeout: float = 120.0, expect_ok: bool = True,
           env: Mapping[str, str] | None = None) -> list[RankResult]:
    """Run a job to completion (retrying once if the free port was taken meanwhile).

    Raises:
        JobFailed: timeout, or (with ``expect_ok``) a rank exited non-zero.
    """
    for attempt in range(2):
        job = Job(argv, nprocs, timeout=timeout, env=dict(env or {})).start()
        try:
            results = job.wait()
        finally:
            job.close()
        if attempt == 0 and any("EADDRINUSE" in r.stderr or "address already in use" in r.stderr.lower()
                                for r in results):
            continue
        break
    if expect_ok and any(r.returncode != 0 for r in results):
        raise JobFailed(f"a rank failed:\n{format_outputs(results)}")
    return results


def run_scenarios(nprocs: int, out_dir: Path, scenarios: Sequence[Mapping[str, Any]],
                  timeout: float = 150.0) -> list[list[dict[str, Any]]]:
    """Launch ``nprocs`` ranks that run ``scenarios`` one after another in one process group.

    Each scenario is ``{"scenario": name, **params}`` (see :data:`SCENARIOS`); one launch
    for several checks, since every process pays for importing torch.

    Returns:
        ``results[s][rank]``: what scenario ``s`` returned on ``rank``.
    """
    out_dir.mkdir(parents=True, exist_ok=True)
    argv = [sys.executable, str(Path(__file__).resolve()), str(out_dir), json.dumps(list(scenarios))]
    launch(argv, nprocs, timeout=timeout)
    per_rank = [json.loads((out_dir / f"rank{r}.json").read_text()) for r in range(nprocs)]
    return [[per_rank[r][s] for r in range(nprocs)] for s in range(len(scenarios))]


# -- the one dataset of the test session ------------------------------------------------

_DATASETS: dict[str, dict[str, str]] = {}


def session_dataset(tmp_path_factory: Any) -> dict[str, str]:
    """Generate the session's dataset once (with the example's own generator).

    Returns ``{"dir", "index", "other_index"}``: the data directory as
    ``examples/train_ddp.py --data`` takes it, its index, and a second index of the same
    name over all shards but the last (for the disagreement tests).
    """
    if "main" not in _DATASETS:
        import importlib.util

        from wds_pad.index.build import build_index
        from wds_pad.index.codec import load_index

        spec = importlib.util.spec_from_file_location("train_ddp_example", EXAMPLE)
        module = importlib.util.module_from_spec(spec)  # type: ignore[arg-type]
        spec.loader.exec_module(module)  # type: ignore[union-attr]
        data = tmp_path_factory.mktemp("dist-data")
        index = module.ensure_dataset(str(data))
        other = data / "other" / os.path.basename(index)
        other.parent.mkdir()
        build_index(list(load_index(index).urls)[:-1], "aspect:width,height", output=str(other))
        _DATASETS["main"] = {"dir": str(data), "index": index, "other_index": str(other)}
    return _DATASETS["main"]


# -- invariant checks (parent side) -----------------------------------------------------


def check_epoch(streams: Mapping[int, Sequence[Mapping[str, Any]]], topologies: Mapping[int, Mapping[str, int]],
                bucket_keys: Mapping[str, Sequence[str]], *, batch_size: int, repeats: int = 0,
                epoch: int | None = None) -> None:
    """Check one epoch of every rank's stream against the design's invariants.

    Args:
        streams: rank -> its batches in order, each ``{"step", "bucket", "keys", "pad"}``.
        topologies: rank -> ``Topology.to_dict()`` of that rank.
        bucket_keys: bucket -> the webdataset keys of its samples (from the index).
        batch_size: samples per batch per DP rank; repeats: configured repeats.

    Raises:
        AssertionError: naming the epoch, rank, step or bucket that breaks an invariant.
    """
    where = f"epoch {epoch}: " if epoch is not None else ""
    ranks = sorted(streams)
    counts = {r: len(streams[r]) for r in ranks}
    assert len(set(counts.values())) == 1, f"{where}unequal batch counts per rank: {counts}"
    ref = ranks[0]
    sched = [(b["step"], b["bucket"]) for b in streams[ref]]
    for r in ranks:
        other = [(b["step"], b["bucket"]) for b in streams[r]]
        assert other == sched, f"{where}rank {r} takes other (step, bucket) than rank {ref}"
    by_dp: dict[int, int] = {}
    for r in ranks:
        d = topologies[r]["dp_rank"]
        if d in by_dp:
            assert list(streams[r]) == list(streams[by_dp[d]]), \
                f"{where}CP peers {by_dp[d]} and {r} (dp_rank {d}) got different batches"
        else:
            by_dp[d] = r
    dp = topologies[ref]["dp_size"]
    assert sorted(by_dp) == list(range(dp)), f"{where}dp ranks seen {sorted(by_dp)}, expected 0..{dp - 1}"
    # rebuild each bucket's global padded order: rank d's i-th entry of window k sits at
    # global position d + (k * batch_size + i) * dp
    seqs: dict[str, dict[int, tuple[str, bool]]] = defaultdict(dict)
    for d, r in by_dp.items():
        windows: Counter[str] = Counter()
        for b in streams[r]:
            assert len(b["keys"]) == len(b["pad"]) == batch_size, \
                f"{where}rank {r} step {b['step']}: batch of {len(b['keys'])} samples, expected {batch_size}"
            k = windows[b["bucket"]]
            windows[b["bucket"]] += 1
            for i, (key, pad) in enumerate(zip(b["keys"], b["pad"])):
                p = d + (k * batch_size + i) * dp
                assert p not in seqs[b["bucket"]], f"{where}bucket {b['bucket']} position {p} twice"
                seqs[b["bucket"]][p] = (key, bool(pad))
    unit = dp * batch_size
    nonempty = {b for b, keys in bucket_keys.items() if len(keys)}
    assert set(seqs) == nonempty, f"{where}buckets streamed {sorted(seqs)} != buckets {sorted(nonempty)}"
    for bucket, entries in seqs.items():
        members = set(bucket_keys[bucket])
        m = len(members) * (1 + repeats)
        length = len(entries)
        assert sorted(entries) == list(range(length)), f"{where}bucket {bucket}: gaps in its global order"
        assert length == max(-(-m // unit), 1) * unit, \
            f"{where}bucket {bucket}: {length} entries for {m} planned (pad unit {unit})"
        seq = [entries[p] for p in range(length)]
        firsts = Counter(k for k, _ in seq[:m])
        assert set(firsts) == members and set(firsts.values()) == {1 + repeats}, \
            f"{where}bucket {bucket}: not every sample exactly {1 + repeats} times before padding"
        for p, (key, pad) in enumerate(seq):
            assert pad == (p >= m), f"{where}bucket {bucket} position {p}: pad flag {pad}, expected {p >= m}"
            if p >= m:  # a padded copy is taken cyclically from the front of the shuffled order
                assert key == seq[p % m][0], f"{where}bucket {bucket}: padded copy {p} is {key}, " \
                                             f"expected the cyclic copy of position {p % m}"


def bucket_keys_of(index_path: str) -> dict[str, list[str]]:
    """Bucket -> webdataset keys, from an index file."""
    from wds_pad.index.codec import load_index

    index = load_index(index_path)
    return {str(b): [index.key(int(i)) for i in ids] for b, ids in index.bucket_samples().items()}


# -- the worker side --------------------------------------------------------------------


def _stream(params: dict[str, Any]) -> dict[str, Any]:
    """Stream epochs with the real seed broadcast and topology detection; record every batch."""
    from wds_pad import BucketedWebDataset, Loader, Topology

    if params.get("mesh"):
        from torch.distributed.device_mesh import init_device_mesh

        mesh = init_device_mesh("cpu", tuple(params["mesh"]), mesh_dim_names=("dp", "cp"))
        kwargs: dict[str, Any] = {"topology": Topology.from_mesh(mesh, dp_dims=("dp",))}
    else:
        kwargs = {"cp_size": params.get("cp", 1)}  # Topology.detect() from the process group
    ds = BucketedWebDataset(params["index"], batch_size=params["batch_size"], seed=None,
                            oversubscribe=True, repeats=params.get("repeats", 0), **kwargs)
    loader = Loader(ds, num_workers=params.get("num_workers", 0))
    batches = []
    for epoch in range(params.get("epochs", 1)):
        loader.set_epoch(epoch)
        for batch in loader:
            batches.append({"epoch": epoch, "step": int(batch[0]["__step__"]), "bucket": batch[0]["__bucket__"],
                            "keys": [s["__key__"] for s in batch], "pad": [bool(s["__pad__"]) for s in batch]})
    return {"seed": ds.seed, "topology": ds.topology.to_dict(), "batches": batches}


def _agreement(params: dict[str, Any]) -> dict[str, Any]:
    """One rank differs (index, seed, batch size): every rank must raise the same error.

    Then ``check_agreement=False``: no collective at all, so a run where only some ranks
    iterate finishes (the others go straight to a barrier).
    """
    import torch.distributed as dist

    from wds_pad import BucketedWebDataset, Loader, WdsPadError

    calls = {"n": 0}
    real = dist.all_gather_object

    def counting(*args: Any, **kwargs: Any) -> Any:
        calls["n"] += 1
        return real(*args, **kwargs)

    dist.all_gather_object = counting  # check_agreement resolves it at call time
    rank, bad = dist.get_rank(), params["bad_rank"]
    cases: dict[str, dict[str, Any]] = {}
    for case in ("index", "seed", "batch_size"):
        kw: dict[str, Any] = {"index": params["index"], "seed": 7, "batch_size": 2}
        if rank == bad:
            kw.update({"index": params["other_index"]} if case == "index" else
                      {"seed": 8} if case == "seed" else {"batch_size": 3})
        ds = BucketedWebDataset(kw.pop("index"), oversubscribe=True, **kw)
        before, t0 = calls["n"], time.monotonic()
        source = iter(Loader(ds)) if case != "seed" else iter(ds)  # both entry points check
        try:
            next(source)
            outcome: dict[str, Any] = {"error": None}
        except WdsPadError as exc:
            outcome = {"error": type(exc).__name__, "message": str(exc)}
        outcome.update(seconds=time.monotonic() - t0, collectives=calls["n"] - before)
        cases[case] = outcome
    before = calls["n"]
    ds = BucketedWebDataset(params["index"], batch_size=2, seed=7 + (rank == bad), oversubscribe=True,
                            check_agreement=False)
    batches = sum(1 for _ in Loader(ds)) if rank in (0, bad) else 0
    dist.barrier()
    cases["disabled"] = {"batches": batches, "collectives": calls["n"] - before}
    return cases


def _elastic_phase(params: dict[str, Any]) -> dict[str, Any]:
    """One job of an elastic run: resume (``resume_from``: the old job's state files, new
    rank r loading old rank ``r * old_world // world``'s) with allow_elastic=True, log every
    batch to ``log/rank<r>.jsonl``; with ``save_at``, save the state after that many batches,
    mark it, and train on slowly until the parent kills the job (with ``then_next``, leave
    this epoch there for the launch's next scenario: the job is killed in a later one)."""
    import torch.distributed as dist

    from wds_pad import BucketedWebDataset, Loader, load_state_file, save_state_file

    from wds_pad import Budget, Pack

    rank, world = dist.get_rank(), dist.get_world_size()
    size = Budget(params["budget"]) if params.get("budget") else params["batch_size"]
    if params.get("pack"):
        size = Pack(**params["pack"])
    ds = BucketedWebDataset(params["index"], batch_size=size, seed=params["seed"],
                            oversubscribe=True, locality=params.get("locality", "none"),
                            accumulation_steps=params.get("accumulation_steps", 1))
    loader = Loader(ds)
    if params.get("resume_from"):
        old = params["old_world"]
        loader.load_state_dict(load_state_file(params["resume_from"], rank * old // world), allow_elastic=True)
    log_dir, save_at = Path(params["log"]), params.get("save_at")
    n = 0
    with open(log_dir / f"rank{rank}.jsonl", "w") as log:
        for batch in loader:
            n += 1
            log.write(json.dumps({"step": int(batch[0]["__step__"]), "bucket": batch[0]["__bucket__"],
                                  "keys": [s["__key__"] for s in batch],
                                  "pad": [bool(s["__pad__"]) for s in batch],
                                  "pack": [s.get("__pack__") for s in batch],
                                  "dataset": batch[0]["__dataset__"], "ids": [int(s["__index__"]) for s in batch],
                                  "seeds": [None if s.get("__seed__") is None else int(s["__seed__"])
                                            for s in batch]}) + "\n")
            log.flush()
            if n == save_at:
                save_state_file(loader.state_dict(), params["state_dir"], rank)
                dist.barrier()
                (log_dir / f"saved{rank}").touch()
                if params.get("then_next"):
                    break  # the launch's next scenario goes on: the job is killed in a later one
            elif save_at and n > save_at:
                time.sleep(0.5)  # training on, until the parent kills the job
    return {"batches": n, "state": loader.state_dict()}


SCENARIOS: dict[str, Callable[[dict[str, Any]], dict[str, Any]]] = {
    "stream": _stream, "agreement": _agreement, "elastic_phase": _elastic_phase}


def _worker(argv: Sequence[str]) -> None:
    import datetime
    import warnings

    import torch.distributed as dist

    warnings.simplefilter("ignore")  # dropped-bucket and DataLoader notices are not the test
    out_dir, scenarios = Path(argv[0]), json.loads(argv[1])
    dist.init_process_group("gloo", timeout=datetime.timedelta(seconds=60))
    # From here on only the process group says who we are: Topology.detect and
    # shared_seed must not need the environment torchrun set.
    for name in ("RANK", "WORLD_SIZE", "LOCAL_RANK", "LOCAL_WORLD_SIZE"):
        os.environ.pop(name, None)
    result = [SCENARIOS[params["scenario"]](params) for params in scenarios]
    path = out_dir / f"rank{dist.get_rank()}.json"
    tmp = path.with_suffix(".tmp")
    tmp.write_text(json.dumps(result))
    os.replace(tmp, path)
    dist.barrier()
    dist.destroy_process_group()


if __name__ == "__main__":
    _worker(sys.argv[1:])
