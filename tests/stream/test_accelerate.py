"""Hugging Face Accelerate with the real package.

``accelerator.prepare`` leaves a ``wds_pad.Loader`` as it is (it is not a torch DataLoader),
but wraps a torch DataLoader over our datasets: by default rank 0 iterates and dispatches
slices of its batches (DataLoaderDispatcher); with ``dispatch_batches=False`` each rank's
stream is re-batched and split (IterableDatasetShard). Both are refused with a ConfigError.
A two-process CPU job launched with ``accelerate launch --multi_gpu --num_processes 2``
(``--cpu`` launches one process; the script's ``Accelerator(cpu=True)`` makes gloo CPU ranks) saves mid-epoch through
``accelerator.save_state`` (the loader registered for checkpointing, ``gather_state=True``)
and resumes through ``load_state``: every sample of both ranks is audited.
"""

from __future__ import annotations

import json
import os
import shutil
import signal
import subprocess
import sys
import warnings
from pathlib import Path

import pytest

from wds_pad.core.topology import Topology
from wds_pad.errors import ConfigError
from wds_pad.index.record import Index
from wds_pad.stream.loader import Loader

from data_helpers import image_index, make_dataset, plan_keys
from dist_helpers import ROOT, free_port

accelerate = pytest.importorskip("accelerate")
pytestmark = pytest.mark.filterwarnings("ignore::wds_pad.errors.DroppedBucketWarning")


@pytest.fixture(scope="module")
def index(tmp_path_factory: pytest.TempPathFactory) -> Index:
    return image_index(tmp_path_factory.mktemp("acc-shards"), samples=96, shards=4, seed=3)


def test_prepare_returns_a_loader_unchanged_and_refuses_a_dispatched_dataloader(index: Index) -> None:
    from torch.utils.data import DataLoader

    acc = accelerate.Accelerator(cpu=True)
    ds = make_dataset(index, quiet=True, seed=11, check_agreement=False, topology=Topology(1, 0))
    loader = Loader(ds)
    assert acc.prepare(loader) is loader  # not a torch DataLoader: left as it is
    wrapped = acc.prepare(DataLoader(ds, batch_size=None))
    assert type(wrapped).__name__ == "DataLoaderDispatcher"  # the default for an IterableDataset
    with pytest.raises(ConfigError, match=r"DataLoaderDispatcher.*rank 0's batches.*wds_pad\.Loader"):
        next(iter(wrapped))


_JOB = r"""
import json, sys, warnings
warnings.simplefilter("ignore")
import torch
from torch.utils.data import DataLoader
from accelerate import Accelerator, DataLoaderConfiguration
from wds_pad import BucketedWebDataset, ConfigError, Loader

index, ckpt, phase, stop = sys.argv[1], sys.argv[2], sys.argv[3], int(sys.argv[4])
acc = Accelerator(cpu=True)
torch.manual_seed(0)
model = torch.nn.Linear(2, 2)
opt = torch.optim.SGD(model.parameters(), lr=0.1)
loader = Loader(BucketedWebDataset(index, batch_size=4, seed=11), num_workers=1, gather_state=True)
model, opt, prepared = acc.prepare(model, opt, loader)
assert prepared is loader
acc.register_for_checkpointing(loader)
out = {"rank": acc.process_index, "world": acc.num_processes, "keys": []}
if phase == "save":
    # the other configuration: no dispatch, each rank's stream re-batched and split
    plain = Accelerator(cpu=True, dataloader_config=DataLoaderConfiguration(dispatch_batches=False,
                                                                           split_batches=False))
    for size in (None, 1):  # batch_size=None: accelerate's own TypeError before our dataset runs
        wrapped = plain.prepare(DataLoader(BucketedWebDataset(index, batch_size=4, seed=11), batch_size=size))
        try:
            next(iter(wrapped))
            out[f"refused{size}"] = None
        except (ConfigError, TypeError) as exc:
            out[f"refused{size}"] = f"{type(exc).__name__}: {exc}"
    for batch in loader:
        out["keys"].append([s["__key__"] for s in batch])
        loss = model(torch.ones(1, 2)).sum()
        acc.backward(loss)
        opt.step()
        opt.zero_grad()
        if len(out["keys"]) == stop:
            break
    acc.save_state(ckpt)
else:
    acc.load_state(ckpt)
    for batch in loader:
        out["keys"].append([s["__key__"] for s in batch])
out["weight"] = float(acc.unwrap_model(model).weight.sum())
acc.wait_for_everyone()
# a file per rank: the ranks share the launcher's stdout, where two lines can interleave
with open(f"result-{phase}-{acc.process_index}.json", "w") as f:
    json.dump(out, f)
"""


def _accelerate_launch(tmp_path: Path, args: list[str], timeout: float = 150.0) -> list[dict]:
    """``accelerate launch --multi_gpu --num_processes 2`` on loopback, CPU ranks; every rank's result."""
    script = tmp_path / "acc_job.py"
    script.write_text(_JOB)
    launcher = shutil.which("accelerate", path=str(Path(sys.executable).parent)) or "accelerate"
    env = {**os.environ, "PYTHONPATH": str(ROOT), "HF_HUB_OFFLINE": "1", "OMP_NUM_THREADS": "1",
           "GLOO_SOCKET_IFNAME": "lo", "ACCELERATE_DISABLE_RICH": "1"}
    # --cpu alone runs one process (several need an MPI hostfile); --multi_gpu is accelerate's
    # torchrun launcher, and Accelerator(cpu=True) makes each process a CPU rank over gloo
    argv = [launcher, "launch", "--multi_gpu", "--num_processes", "2", "--num_machines", "1",
            "--mixed_precision", "no", "--dynamo_backend", "no", "--main_process_ip", "127.0.0.1",
            "--main_process_port", str(free_port()), str(script), *args]
    proc = subprocess.Popen(argv, env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                            start_new_session=True, cwd=tmp_path)
    try:
        out, err = proc.communicate(timeout=timeout)
    except subprocess.TimeoutExpired:
        os.killpg(proc.pid, signal.SIGKILL)
        out, err = proc.communicate()
        raise AssertionError(f"accelerate launch timed out:\n{out.decode()[-3000:]}\n{err.decode()[-3000:]}")
    assert proc.returncode == 0, f"accelerate launch failed:\n{out.decode()[-3000:]}\n{err.decode()[-5000:]}"
    phase = args[2]
    rows = [json.loads((tmp_path / f"result-{phase}-{r}.json").read_text()) for r in range(2)]
    return sorted(rows, key=lambda r: r["rank"])


@pytest.mark.slow
def test_accelerate_launch_save_state_and_load_state_resume_every_rank_exactly(index: Index,
                                                                               tmp_path: Path) -> None:
    stop = 3
    ckpt = str(tmp_path / "ckpt")
    first = _accelerate_launch(tmp_path, [str(index.path), ckpt, "save", str(stop)])
    second = _accelerate_launch(tmp_path, [str(index.path), ckpt, "load", "0"])
    assert [r["world"] for r in first] == [2, 2]
    for r in first:  # the configuration that does not dispatch fails too, ours naming what to pass
        assert r["refusedNone"].startswith("TypeError")
        assert r["refused1"].startswith("ConfigError") and "IterableDatasetShard" in r["refused1"]
        assert "wds_pad.Loader" in r["refused1"]
    seen, planned = [], []
    for rank in (0, 1):
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            plan = make_dataset(index, seed=11, topology=Topology(2, rank)).plan(0)
        expected = plan_keys(plan, index)
        assert stop < len(expected), "the save was not mid-epoch"
        assert first[rank]["keys"] == expected[:stop]
        assert second[rank]["keys"] == expected[stop:], f"rank {rank} did not continue exactly"
        assert second[rank]["weight"] == first[rank]["weight"]  # the model came back with it
        seen += [k for b in first[rank]["keys"] + second[rank]["keys"] for k in b]
        planned += [k for b in expected for k in b]
    assert sorted(seen) == sorted(planned)  # no sample lost or duplicated over the two ranks
