"""Train a tiny causal transformer on packed token rows for a few steps (CPU is enough).

    python examples/train_packed.py --data /tmp/wds-tokens --steps 20

What it shows (see docs/packing.md):

- ``--data DIR`` holds token shards and their index; if ``DIR/tokens.wdsidx`` is missing
  it generates shards of log-normal lengths (``tokens.npy`` members, a ``.json`` with
  ``tokens`` and ``source``) and indexes them by source, with each sample's token count
  as its cost;
- ``BucketedWebDataset(..., batch_size=Pack(L, packs=B))`` plans batches of B packs of at
  most L tokens each, and ``pack_collate`` lays them out as (B, L) rows with positions
  restarting at every sample, segment ids and the loss mask;
- attention stays inside each sample (a causal mask within its segment), and the loss
  counts only next tokens of the same real sample: padding and padded copies add nothing.

It prints one line per step (loss, real tokens, fill) and the mean fill.
"""

from __future__ import annotations

import argparse
import os

import torch
import torch.nn as nn
import torch.nn.functional as F

from wds_pad import BucketedWebDataset, Loader, Pack, Topology, build_index, pack_collate

INDEX_NAME = "tokens.wdsidx"
VOCAB = 256


def ensure_dataset(data_dir: str, samples: int = 400, shards: int = 4) -> str:
    """Generate token shards and their index in ``data_dir`` unless present."""
    index = os.path.join(data_dir, INDEX_NAME)
    if not os.path.exists(index):
        from wds_pad.cli.synth import make_token_shards  # the test-data generator shipped with wds_pad

        urls = make_token_shards(os.path.join(data_dir, "shards"), samples=samples, shards=shards, seed=0)
        build_index(urls, "json:source", output=index, cost="json:tokens")
    return index


class TinyLM(nn.Module):
    """One attention block over token and position embeddings."""

    def __init__(self, seq_len: int, dim: int = 32) -> None:
        super().__init__()
        self.tok = nn.Embedding(VOCAB, dim)
        self.pos = nn.Embedding(seq_len, dim)
        self.attn = nn.MultiheadAttention(dim, 2, batch_first=True)
        self.mlp = nn.Sequential(nn.Linear(dim, 2 * dim), nn.GELU(), nn.Linear(2 * dim, dim))
        self.head = nn.Linear(dim, VOCAB)

    def forward(self, ids: torch.Tensor, pos: torch.Tensor, seg: torch.Tensor) -> torch.Tensor:
        x = self.tok(ids) + self.pos(pos)
        n = ids.shape[1]
        causal = torch.ones(n, n, dtype=torch.bool).tril()
        same = (seg[:, :, None] == seg[:, None, :]) & (seg[:, :, None] >= 0)
        allowed = same & causal
        allowed |= torch.eye(n, dtype=torch.bool)  # padding attends to itself: no empty row
        mask = (~allowed).repeat_interleave(self.attn.num_heads, dim=0)
        x = x + self.attn(x, x, x, attn_mask=mask, need_weights=False)[0]
        x = x + self.mlp(x)
        return self.head(x)


def next_token_loss(logits: torch.Tensor, batch: dict) -> tuple[torch.Tensor, int]:
    """Cross entropy of each next token of the same real sample (the loss mask, shifted)."""
    ids, seg, mask = batch["input_ids"], batch["segment_ids"], batch["loss_mask"]
    keep = mask[:, 1:] & (seg[:, 1:] == seg[:, :-1])
    loss = F.cross_entropy(logits[:, :-1][keep], ids[:, 1:][keep])
    return loss, int(keep.sum())


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--data", required=True, help="directory of the token shards and their index")
    parser.add_argument("--steps", type=int, default=20)
    parser.add_argument("--seq-len", type=int, default=256)
    parser.add_argument("--packs", type=int, default=4, help="packs per batch")
    args = parser.parse_args(argv)
    torch.manual_seed(0)
    index = ensure_dataset(args.data)
    dataset = BucketedWebDataset(index, batch_size=Pack(args.seq_len, packs=args.packs, oversize="alone"),
                                 topology=Topology(1, 0), seed=0, mode="steps",
                                 collation_fn=pack_collate("tokens.npy", seq_len=args.seq_len))
    model = TinyLM(args.seq_len)
    opt = torch.optim.AdamW(model.parameters(), lr=3e-3)
    fills = []
    for step, batch in enumerate(Loader(dataset)):
        if step >= args.steps:
            break
        logits = model(batch["input_ids"], batch["position_ids"], batch["segment_ids"])
        loss, targets = next_token_loss(logits, batch)
        opt.zero_grad()
        loss.backward()
        opt.step()
        fill = float(batch["loss_mask"].float().mean())
        fills.append(fill)
        print(f"step {step}: loss {loss.item():.3f} over {targets} targets, fill {fill:.3f}", flush=True)
    print(f"mean fill {sum(fills) / max(len(fills), 1):.3f} over {len(fills)} steps")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
