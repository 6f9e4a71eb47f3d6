"""PyTorch Lightning (Trainer and Fabric) with the real package.

What Lightning 2.6 does with a ``wds_pad.Loader``, checked here rather than assumed:

- it is not a torch DataLoader, so Lightning neither injects a DistributedSampler nor
  re-instantiates it, whatever ``use_distributed_sampler`` says: ``trainer.train_dataloader``
  is the loader itself;
- its fit loop calls ``loader.sampler.set_epoch(epoch)`` at every epoch start (the Loader's
  ``sampler`` is that hook), so each epoch has its own order; without it every epoch would
  repeat epoch 0's;
- a checkpoint (written by rank 0 only) holds the loader's ``state_dict()`` (collected on every
  rank: ``gather_state=True`` puts every rank's entry in it), and ``ckpt_path=`` hands it to
  ``load_state_dict`` on every rank: each resumes at its own next batch;
- Lightning starts the processes inside ``Trainer.fit``: a dataset built before it detects one
  process and is refused once the group exists (here with ``ddp_spawn``, which pickles it into
  both processes, where both would stream the whole plan).

The jobs run Lightning's own launchers (``strategy="ddp"`` re-runs the script for rank 1;
``ddp_spawn`` spawns) with 2 CPU processes over gloo on 127.0.0.1; each rank writes what it
trained on, and every sample is audited against each rank's plan over 3 epochs.
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import warnings
from pathlib import Path
from typing import Any

import pytest

from wds_pad.core.topology import Topology
from wds_pad.errors import TopologyError
from wds_pad.index.record import Index
from wds_pad.stream.loader import Loader

from data_helpers import batch_keys, image_index, make_dataset, plan_keys
from dist_helpers import ROOT, free_port

lightning = pytest.importorskip("lightning")
pytestmark = pytest.mark.filterwarnings("ignore::wds_pad.errors.DroppedBucketWarning")

EPOCHS = 3


@pytest.fixture(scope="module")
def index(tmp_path_factory: pytest.TempPathFactory) -> Index:
    return image_index(tmp_path_factory.mktemp("pl-shards"), samples=96, shards=4, seed=3)


def planned(index: Index, rank: int, epochs: int = EPOCHS) -> list[list[str]]:
    """What rank ``rank`` of 2 trains on in ``epochs`` uninterrupted epochs: its plans, in order."""
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        ds = make_dataset(index, seed=11, topology=Topology(2, rank))
    return [keys for e in range(epochs) for keys in plan_keys(ds.plan(e), index)]


def test_lightnings_epoch_hook_sets_the_loaders_epoch_and_keeps_a_restored_position(index: Index) -> None:
    from lightning.fabric.utilities.data import _set_sampler_epoch  # what the fit loop calls per epoch

    loader = Loader(make_dataset(index, quiet=True, seed=11, topology=Topology(2, 1), check_agreement=False))
    _set_sampler_epoch(loader, 1)
    assert loader.epoch == 1
    assert batch_keys(loader) == plan_keys(loader.dataset.plan(1), index)
    it = iter(loader)
    for _ in range(3):
        next(it)
    it.close()
    state = loader.state_dict()
    fresh = Loader(make_dataset(index, quiet=True, seed=11, topology=Topology(2, 1), check_agreement=False))
    fresh.load_state_dict(state)
    _set_sampler_epoch(fresh, 1)  # a mid-epoch restart calls it with the restored epoch
    assert batch_keys(fresh) == plan_keys(fresh.dataset.plan(1), index)[3:]


def test_a_dataset_built_before_the_process_group_is_refused(index: Index,
                                                             monkeypatch: pytest.MonkeyPatch) -> None:
    """Detected as 2 ranks from the environment, iterated in a group of 1: the sizes differ."""
    import torch.distributed as dist

    monkeypatch.setenv("RANK", "1")
    monkeypatch.setenv("WORLD_SIZE", "2")
    detected = Loader(make_dataset(index, quiet=True, seed=11, topology=None, check_agreement=False))
    given = Loader(make_dataset(index, quiet=True, seed=11, topology=Topology(2, 1), check_agreement=False))
    dist.init_process_group("gloo", store=dist.HashStore(), rank=0, world_size=1)
    try:
        with pytest.raises(TopologyError, match=r"detected 2 process\(es\).*has 1 ranks.*train_dataloader\(\)"):
            next(iter(detected))
        assert next(iter(given))  # an explicit topology is the user's word
    finally:
        dist.destroy_process_group()


# -- two processes under Lightning's launchers ----------------------------------------------

def run_lightning(tmp_path: Path, body: str, args: list[str], timeout: float = 120.0) -> subprocess.CompletedProcess:
    """Run ``body`` as a script: Lightning starts the second process itself (loopback only)."""
    script = tmp_path / "pl_job.py"
    script.write_text(body)
    env = {k: v for k, v in os.environ.items()
           if k not in ("RANK", "WORLD_SIZE", "LOCAL_RANK", "LOCAL_WORLD_SIZE", "NODE_RANK", "GROUP_RANK")
           and not k.startswith(("TORCHELASTIC_", "SLURM_", "PL_"))}
    env.update(PYTHONPATH=str(ROOT), MASTER_ADDR="127.0.0.1", MASTER_PORT=str(free_port()),
               GLOO_SOCKET_IFNAME="lo", OMP_NUM_THREADS="1", PYTHONUNBUFFERED="1")
    proc = subprocess.Popen([sys.executable, str(script), *args], env=env, cwd=tmp_path, stdout=subprocess.PIPE,
                            stderr=subprocess.PIPE, stdin=subprocess.DEVNULL, start_new_session=True)
    try:
        out, err = proc.communicate(timeout=timeout)  # EOF once every process holding the pipes has ended
    except subprocess.TimeoutExpired:
        os.killpg(proc.pid, signal.SIGKILL)
        out, err = proc.communicate()
        raise AssertionError(f"Lightning job timed out:\n{out.decode()[-3000:]}\n{err.decode()[-5000:]}")
    finally:
        try:
            os.killpg(proc.pid, signal.SIGKILL)  # nothing of the job outlives it
        except ProcessLookupError:
            pass
    return subprocess.CompletedProcess(proc.args, proc.returncode, out.decode(), err.decode())


def ranks(out: Path, phase: str, done: subprocess.CompletedProcess) -> list[dict[str, Any]]:
    assert done.returncode == 0, f"the job failed:\n{done.stdout[-3000:]}\n{done.stderr[-6000:]}"
    files = [out / f"{phase}-{r}.json" for r in (0, 1)]
    assert all(f.exists() for f in files), f"a rank wrote nothing:\n{done.stderr[-6000:]}"
    return [json.loads(f.read_text()) for f in files]


_TRAINER_JOB = r"""
import json, os, sys, warnings
warnings.simplefilter("ignore")
import torch
import lightning as L
from lightning.pytorch.callbacks import ModelCheckpoint
from wds_pad import BucketedWebDataset, Loader

index, out, phase, stop, kill = sys.argv[1], sys.argv[2], sys.argv[3], int(sys.argv[4]), int(sys.argv[5])
ckdir = os.path.join(out, "ckpt")


class Net(L.LightningModule):
    def __init__(self):
        super().__init__()
        torch.manual_seed(0)
        self.layer = torch.nn.Linear(2, 2)
        self.keys = []

    def train_dataloader(self):  # the process group exists here
        self.loader = Loader(BucketedWebDataset(index, batch_size=4, seed=11), num_workers=1, gather_state=True)
        return self.loader

    def training_step(self, batch, batch_idx):
        self.keys.append([self.current_epoch, [s["__key__"] for s in batch]])
        return self.layer(torch.ones(1, 2)).sum()

    def configure_optimizers(self):
        return torch.optim.SGD(self.parameters(), lr=0.1)


def dump(trainer, net, **extra):
    rec = {"rank": trainer.global_rank, "world": trainer.world_size, "keys": net.keys,
           "same_loader": trainer.train_dataloader is net.loader, **extra}
    with open(os.path.join(out, f"{phase}-{trainer.global_rank}.json"), "w") as f:
        json.dump(rec, f)


class Crash(L.Callback):
    weight = None

    def on_train_start(self, trainer, net):
        self.weight = float(net.layer.weight.sum())  # after a resume: the checkpoint's

    def on_train_batch_end(self, trainer, net, outputs, batch, batch_idx):
        if trainer.global_step == stop:  # ModelCheckpoint saves after this callback, same weights
            self.weight = float(net.layer.weight.sum())
        if trainer.global_step == kill:  # killed after the checkpoint: no teardown, no last save
            dump(trainer, net, weight=self.weight)
            os._exit(0)


net, crash = Net(), Crash()
trainer = L.Trainer(accelerator="cpu", devices=2, strategy="ddp", max_epochs=3, logger=False,
                    enable_progress_bar=False, enable_model_summary=False, num_sanity_val_steps=0,
                    use_distributed_sampler=(phase == "save"),  # either: a Loader is left as it is
                    callbacks=[crash, ModelCheckpoint(dirpath=ckdir, every_n_train_steps=stop, save_top_k=-1)])
ckpts = sorted(os.listdir(ckdir)) if phase == "load" else []
trainer.fit(net, ckpt_path=os.path.join(ckdir, ckpts[0]) if ckpts else None)
dump(trainer, net, weight=crash.weight, ckpts=ckpts)
"""


@pytest.mark.slow
def test_trainer_ddp_checkpoint_mid_epoch_and_resume_every_rank_exactly(index: Index, tmp_path: Path) -> None:
    per_epoch = len(planned(index, 0, 1))
    stop, kill = per_epoch + 3, per_epoch + 5  # the checkpoint mid-epoch 1, the kill two batches later
    first = ranks(tmp_path, "save", run_lightning(tmp_path, _TRAINER_JOB, [str(index.path), str(tmp_path), "save",
                                                                         str(stop), str(kill)]))
    second = ranks(tmp_path, "load", run_lightning(tmp_path, _TRAINER_JOB, [str(index.path), str(tmp_path), "load",
                                                                          str(stop), "-1"]))
    assert second[0]["ckpts"] == [f"epoch=1-step={stop}.ckpt"]  # the one checkpoint, mid-epoch 1
    seen: list[str] = []
    for rank in (0, 1):
        expected = planned(index, rank)
        assert first[rank]["world"] == 2 and first[rank]["same_loader"] and second[rank]["same_loader"]
        before = [k for _, k in first[rank]["keys"]]
        after = [k for _, k in second[rank]["keys"]]
        assert before == expected[:kill]  # epoch 1 is epoch 1's order, not epoch 0's again
        assert after == expected[stop:], f"rank {rank} did not continue exactly"
        assert [e for e, _ in second[rank]["keys"]] == [1] * (per_epoch - 3) + [2] * per_epoch
        assert second[rank]["weight"] == first[rank]["weight"]  # the model came back with it
        seen += [k for b in before[:stop] + after for k in b]
    assert planned(index, 0, 1) != planned(index, 0, 2)[per_epoch:]  # set_epoch matters here
    assert sorted(seen) == sorted(k for r in (0, 1) for b in planned(index, r) for k in b)


_FABRIC_JOB = r"""
import json, os, sys, warnings
warnings.simplefilter("ignore")
import torch
import lightning as L
from wds_pad import BucketedWebDataset, Loader

index, out, phase, stop, kill = sys.argv[1], sys.argv[2], sys.argv[3], int(sys.argv[4]), int(sys.argv[5])
ckpt = os.path.join(out, "fabric.ckpt")
fabric = L.Fabric(accelerator="cpu", devices=2, strategy="ddp")
fabric.launch()  # starts rank 1 and the process group: build the dataset after it
torch.manual_seed(0)
model = torch.nn.Linear(2, 2)
opt = torch.optim.SGD(model.parameters(), lr=0.1)
model, opt = fabric.setup(model, opt)
loader = Loader(BucketedWebDataset(index, batch_size=4, seed=11), num_workers=1, gather_state=True)
state = {"model": model, "optimizer": opt, "loader": loader, "step": 0}
if phase == "load":
    fabric.load(ckpt, state)
keys, weight = [], float(model.weight.sum())


def dump():
    with open(os.path.join(out, f"{phase}-{fabric.global_rank}.json"), "w") as f:
        json.dump({"rank": fabric.global_rank, "world": fabric.world_size, "keys": keys, "weight": weight,
                   "step": state["step"]}, f)


for epoch in range(loader.epoch, 3):
    loader.set_epoch(epoch)  # the restored epoch keeps its restored position
    for batch in loader:
        keys.append([epoch, [s["__key__"] for s in batch]])
        fabric.backward(model(torch.ones(1, 2)).sum())
        opt.step()
        opt.zero_grad()
        state["step"] += 1
        if state["step"] == stop:
            fabric.save(ckpt, state)  # every rank collects, rank 0 writes
            weight = float(model.weight.sum())
        if state["step"] == kill:
            dump()
            os._exit(0)
dump()
"""


@pytest.mark.slow
def test_fabric_save_mid_epoch_and_load_resume_every_rank_exactly(index: Index, tmp_path: Path) -> None:
    per_epoch = len(planned(index, 0, 1))
    stop, kill = per_epoch + 3, per_epoch + 5
    first = ranks(tmp_path, "save", run_lightning(tmp_path, _FABRIC_JOB, [str(index.path), str(tmp_path), "save",
                                                                        str(stop), str(kill)]))
    second = ranks(tmp_path, "load", run_lightning(tmp_path, _FABRIC_JOB, [str(index.path), str(tmp_path), "load",
                                                                         "-1", "-1"]))
    seen: list[str] = []
    for rank in (0, 1):
        expected = planned(index, rank)
        assert first[rank]["world"] == 2
        assert [k for _, k in first[rank]["keys"]] == expected[:kill]
        assert [k for _, k in second[rank]["keys"]] == expected[stop:], f"rank {rank} did not continue exactly"
        assert second[rank]["weight"] == first[rank]["weight"]  # model and optimizer came back
        assert second[rank]["step"] == len(expected)  # the checkpoint's step, then the rest
        seen += [k for b in [k for _, k in first[rank]["keys"]][:stop] + [k for _, k in second[rank]["keys"]]
                 for k in b]
    assert sorted(seen) == sorted(k for r in (0, 1) for b in planned(index, r) for k in b)


_SPAWN_JOB = r"""
import json, os, sys, warnings
warnings.simplefilter("ignore")
import torch
import lightning as L
from wds_pad import BucketedWebDataset, Loader


class Net(L.LightningModule):
    def __init__(self):
        super().__init__()
        self.layer = torch.nn.Linear(2, 2)

    def training_step(self, batch, batch_idx):
        return self.layer(torch.ones(1, 2)).sum()

    def configure_optimizers(self):
        return torch.optim.SGD(self.parameters(), lr=0.1)


if __name__ == "__main__":
    loader = Loader(BucketedWebDataset(sys.argv[1], batch_size=4, seed=11))  # too early: one process
    trainer = L.Trainer(accelerator="cpu", devices=2, strategy="ddp_spawn", max_epochs=1, logger=False,
                        enable_progress_bar=False, enable_model_summary=False, enable_checkpointing=False)
    try:
        trainer.fit(Net(), train_dataloaders=loader)
        print(json.dumps({"refused": None}))
    except Exception as exc:
        print(json.dumps({"refused": f"{type(exc).__name__}: {exc}"}))
"""


@pytest.mark.slow
def test_ddp_spawn_refuses_a_loader_built_before_the_processes(index: Index, tmp_path: Path) -> None:
    done = run_lightning(tmp_path, _SPAWN_JOB, [str(index.path)])
    assert done.returncode == 0, done.stderr[-6000:]
    rows = [json.loads(line) for line in done.stdout.splitlines() if line.startswith('{"refused"')]
    assert rows and rows[-1]["refused"], f"both processes trained on the whole plan:\n{done.stderr[-3000:]}"
    assert "TopologyError" in done.stderr + rows[-1]["refused"]
    assert "train_dataloader()" in done.stderr + rows[-1]["refused"]
