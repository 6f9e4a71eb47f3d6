"""Train a tiny conv net under DistributedDataParallel on bucketed WebDataset shards.

    torchrun --nproc_per_node 4 examples/train_ddp.py --data /tmp/wds-data --out /tmp/run

What it shows (see docs/distributed.md):

- ``--data DIR`` holds shards and their index; if ``DIR/images.wdsidx`` is missing,
  rank 0 generates small images of five aspect ratios with strongly skewed bucket sizes
  (55 % .. 2 %) and indexes them by aspect ratio;
- every rank streams its planned batches with ``BucketedWebDataset`` + ``Loader``; each
  batch holds one aspect bucket, resized to that bucket's shape, so no batch mixes
  shapes and every rank takes the same number of steps (DDP never hangs at an epoch end);
- every ``--ckpt-every`` steps and at the end of each epoch it checkpoints model,
  optimizer and the loader position of every rank into ``OUT/ckpt/step-NNNNNN/``;
  ``OUT/ckpt/latest`` names the newest checkpoint that *every* rank finished;
- started again with the same ``--out`` it resumes from that checkpoint at the exact
  sample; on another number of processes the loader refuses the checkpoint with a
  topology error, unless ``--allow-elastic``: then it resumes the rest of the epoch on the
  new layout, every sample not yet trained on exactly once (docs/resume.md);
- each rank appends every batch it trains on (sample keys, pad flags) to
  ``OUT/samples-rankNNNNN.jsonl`` so a test can audit exactly what was seen;
- it refuses to start (exit 3, before it writes anything) while another run holds
  ``OUT/ckpt``: rank 0 holds an ``flock`` on ``OUT/ckpt/.lock`` for the life of the job,
  which the kernel drops when that process ends, however it ends (a SIGKILLed run leaves
  no stale lock). A killed torchrun can leave its workers running (docs/distributed.md,
  "Stopping a job"): they still hold the folder, and the refusal names their pid.
"""

from __future__ import annotations

import argparse
import fcntl
import json
import math
import os
import socket
import sys
import time
from pathlib import Path

import torch
import torch.distributed as dist
import torch.nn as nn
import torch.nn.functional as F
from torch.nn.parallel import DistributedDataParallel

from wds_pad import BucketedWebDataset, Loader, WdsPadError, build_index, load_state_file, save_state_file
from wds_pad import state_path

INDEX_NAME = "images.wdsidx"
PIXELS = 24 * 24  # every bucket is resized to about this many pixels, in its own aspect ratio


def ensure_dataset(data_dir: str, samples: int = 240, shards: int = 6) -> str:
    """Generate skewed image shards and their aspect index in ``data_dir`` unless present."""
    index = os.path.join(data_dir, INDEX_NAME)
    if not os.path.exists(index):
        from wds_pad.cli.synth import make_image_shards  # the test-data generator shipped with wds_pad

        urls = make_image_shards(os.path.join(data_dir, "shards"), samples=samples, shards=shards)
        build_index(urls, "aspect:width,height", output=index)  # written atomically
    return index


class TinyNet(nn.Module):
    """Two convolutions and global pooling: any image size in, 10 class logits out."""

    def __init__(self) -> None:
        super().__init__()
        self.conv1 = nn.Conv2d(3, 8, 3, padding=1)
        self.conv2 = nn.Conv2d(8, 16, 3, stride=2, padding=1)
        self.head = nn.Linear(16, 10)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = F.relu(self.conv2(F.relu(self.conv1(x))))
        return self.head(x.mean(dim=(2, 3)))


def bucket_shape(bucket: str) -> tuple[int, int]:
    """(height, width) of a bucket such as ``"16:9"``: its aspect ratio at about PIXELS pixels."""
    w, h = (float(v) for v in bucket.split(":"))
    return max(1, round(math.sqrt(PIXELS * h / w))), max(1, round(math.sqrt(PIXELS * w / h)))


def to_example(sample: dict) -> dict:
    """A decoded sample -> image resized to its bucket's shape, label and bookkeeping."""
    image = sample.get("png", sample.get("jpg"))
    image = F.interpolate(image[None], size=bucket_shape(sample["__bucket__"]), mode="bilinear",
                          align_corners=False)[0]
    return {"image": image, "label": sample["json"]["label"], "key": sample["__key__"],
            "pad": bool(sample["__pad__"]), "bucket": sample["__bucket__"], "step": sample["__step__"]}


def collate(examples: list[dict]) -> dict:
    return {"image": torch.stack([e["image"] for e in examples]),
            "label": torch.tensor([e["label"] for e in examples]),
            "keys": [e["key"] for e in examples], "pad": [e["pad"] for e in examples],
            "bucket": examples[0]["bucket"], "step": int(examples[0]["step"])}


def atomic_write(path: str, write) -> None:
    """Write through ``write(tmp_path)``, then rename: readers see the old file or the new one."""
    tmp = f"{path}.tmp{os.getpid()}"
    write(tmp)
    with open(tmp, "rb") as f:
        os.fsync(f.fileno())
    os.replace(tmp, path)


def save_checkpoint(root: str, step: int, model: nn.Module, optimizer: torch.optim.Optimizer,
                    loader: Loader, seed: int) -> None:
    """Every rank saves its loader position; rank 0 the (replicated) model and optimizer.

    ``latest`` is moved only after a barrier, so it never names a checkpoint that some
    rank has not finished writing: a kill at any instant leaves a consistent ``latest``.
    """
    rank = dist.get_rank()
    directory = os.path.join(root, f"step-{step:06d}")
    os.makedirs(directory, exist_ok=True)
    save_state_file(loader.state_dict(), directory, rank)  # atomic, rank in the file name
    if rank == 0:
        trainer = {"model": model.state_dict(), "optimizer": optimizer.state_dict(), "step": step, "seed": seed}
        atomic_write(os.path.join(directory, "trainer.pt"), lambda tmp: torch.save(trainer, tmp))
    dist.barrier()
    if rank == 0:
        atomic_write(os.path.join(root, "latest"), lambda tmp: Path(tmp).write_text(os.path.basename(directory)))


LOCK_NAME = ".lock"
EXIT_IN_USE = 3


def lock_folder(root: str) -> tuple[int | None, str]:
    """Take the checkpoint folder ``root`` for this run: an exclusive ``flock`` on ``root/.lock``.

    Returns ``(fd, "")`` with the lock held for as long as ``fd`` stays open (keep it open
    for the life of the job; the kernel releases it when the process ends, even by
    SIGKILL), or ``(None, holder)`` if another run holds it, ``holder`` being what that run
    wrote into the file (its pid, host and start time).
    """
    path = os.path.join(root, LOCK_NAME)
    fd = os.open(path, os.O_RDWR | os.O_CREAT, 0o644)
    try:
        fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
    except BlockingIOError:
        os.close(fd)
        with open(path) as f:
            return None, f.read().strip() or "a process that has not written its pid yet"
    os.ftruncate(fd, 0)
    os.write(fd, f"pid {os.getpid()} on {socket.gethostname()}, started {time.strftime('%Y-%m-%d %H:%M:%S')}\n"
             .encode())
    return fd, ""


def latest_checkpoint(root: str) -> str | None:
    try:
        with open(os.path.join(root, "latest")) as f:
            return os.path.join(root, f.read().strip())
    except FileNotFoundError:
        return None


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--data", required=True, help="dataset directory (generated if it has no index)")
    p.add_argument("--out", required=True, help="checkpoints and per-rank sample logs")
    p.add_argument("--epochs", type=int, default=2)
    p.add_argument("--batch-size", type=int, default=4, help="per rank")
    p.add_argument("--ckpt-every", type=int, default=4, help="checkpoint every k steps (and at each epoch end)")
    p.add_argument("--lr", type=float, default=0.05)
    p.add_argument("--seed", type=int, default=None, help="default: drawn on rank 0 and broadcast")
    p.add_argument("--num-workers", type=int, default=0)
    p.add_argument("--samples", type=int, default=240, help="images to generate if --data is empty")
    p.add_argument("--allow-elastic", action="store_true",
                   help="resume on another number of processes: the rest of the epoch, every sample "
                        "not yet trained on exactly once (docs/resume.md)")
    p.add_argument("--step-delay", type=float, default=0.0, help="sleep per step (stands in for a bigger model)")
    return p.parse_args(argv)


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    cuda = torch.cuda.is_available()
    dist.init_process_group("nccl" if cuda else "gloo")  # env:// as set by torchrun
    rank = dist.get_rank()
    device = torch.device("cuda", int(os.environ.get("LOCAL_RANK", 0))) if cuda else torch.device("cpu")
    if cuda:
        torch.cuda.set_device(device)
    ckpt_root = os.path.join(args.out, "ckpt")
    # One run per checkpoint folder: rank 0 holds the lock until it exits, however it exits.
    lock, holder = (None, "")
    if rank == 0:
        os.makedirs(ckpt_root, exist_ok=True)
        lock, holder = lock_folder(ckpt_root)
    verdict = [holder]
    dist.broadcast_object_list(verdict, src=0)
    if verdict[0]:
        print(f"rank {rank}: {ckpt_root} is in use by another run ({verdict[0]}); two runs writing into "
              "one checkpoint folder overwrite each other's checkpoints. Stop that run first (a killed "
              "torchrun can leave its workers running: docs/distributed.md, 'Stopping a job'), or pass "
              "another --out. A run that was killed holds no lock.", file=sys.stderr)
        dist.destroy_process_group()
        return EXIT_IN_USE
    if rank == 0:
        ensure_dataset(args.data, samples=args.samples)
    dist.barrier()  # the other ranks wait for the index

    os.makedirs(ckpt_root, exist_ok=True)
    latest = latest_checkpoint(ckpt_root)
    trainer = torch.load(os.path.join(latest, "trainer.pt"), map_location=device) if latest else None
    # A resumed plan must be the same plan: reuse the seed the first run drew (or was given).
    dataset = BucketedWebDataset(os.path.join(args.data, INDEX_NAME), batch_size=args.batch_size,
                                 seed=trainer["seed"] if trainer else args.seed, oversubscribe=True,
                                 collation_fn=collate).decode("torchrgb").map(to_example)
    # workers kept from one epoch to the next (each starts where the loader is): no fork per epoch
    loader = Loader(dataset, num_workers=args.num_workers, persistent_workers=args.num_workers > 0)
    model = TinyNet().to(device)
    optimizer = torch.optim.SGD(model.parameters(), lr=args.lr, momentum=0.9)
    step = 0
    if latest:
        try:  # verified in full before anything changes: topology, plan fingerprint, position
            loader.load_state_dict(load_state_file(state_path(latest, rank), rank), allow_elastic=args.allow_elastic)
        except WdsPadError as exc:
            print(f"rank {rank}: cannot resume from {latest}: {type(exc).__name__}: {exc}", file=sys.stderr)
            dist.destroy_process_group()
            return 2
        model.load_state_dict(trainer["model"])
        optimizer.load_state_dict(trainer["optimizer"])
        step = trainer["step"]
    position = loader.state_dict()
    if position["index"] >= position["batches_in_epoch"]:  # saved at an epoch's end
        loader.set_epoch(position["epoch"] + 1)
    ddp = DistributedDataParallel(model, device_ids=[device.index] if cuda else None)

    log = open(os.path.join(args.out, f"samples-rank{rank:05d}.jsonl"), "a")
    log.write(json.dumps({"event": "start", "rank": rank, "world_size": dist.get_world_size(), "step": step,
                          "resumed_from": os.path.basename(latest) if latest else None,
                          "seed": dataset.seed}) + "\n")
    log.flush()
    first = dataset.epoch
    for epoch in range(first, args.epochs):
        if epoch != first:
            loader.set_epoch(epoch)  # the first epoch may continue mid-way from the checkpoint
        for batch in loader:
            loss = F.cross_entropy(ddp(batch["image"].to(device)), batch["label"].to(device))
            optimizer.zero_grad()
            loss.backward()
            optimizer.step()
            step += 1
            log.write(json.dumps({"step": step, "epoch": epoch, "plan_step": batch["step"],
                                  "bucket": batch["bucket"], "keys": batch["keys"], "pad": batch["pad"],
                                  "loss": round(loss.item(), 4)}) + "\n")
            log.flush()
            if step % args.ckpt_every == 0:
                save_checkpoint(ckpt_root, step, model, optimizer, loader, dataset.seed)
            time.sleep(args.step_delay)
        if step % args.ckpt_every:  # an epoch-boundary checkpoint: the elastic resume point
            save_checkpoint(ckpt_root, step, model, optimizer, loader, dataset.seed)
        if rank == 0:
            print(f"epoch {epoch} done at step {step}, last loss {loss.item():.3f}", flush=True)
    log.write(json.dumps({"event": "done", "step": step}) + "\n")
    log.close()
    dist.destroy_process_group()
    if lock is not None:
        os.close(lock)  # the folder is free for the next run
    return 0


if __name__ == "__main__":
    sys.exit(main())
