"""DDP training with torch.distributed.checkpoint (DCP) saves and a per-rank "already saved" guard.

Every ``--save-every`` steps the job writes a sharded checkpoint with ``dcp.save``. To make
restarts idempotent, each rank drops a marker file ``.saved_rank{R}_step{S}`` next to the
checkpoint after its save and skips ``dcp.save`` if its own marker already exists (the author
assumed "if I saved it, everyone did").

Fault (``--mode fault``, the default): rank 2 finds a stale marker for step 4 left behind by an
earlier crashed run (the script plants it at startup to reproduce that), so at step 4 rank 2
skips ``dcp.save`` while ranks 0 and 1 enter it. dcp.save is collective (plan gather/scatter,
then a final gather of write results): ranks 0 and 1 wait in it while rank 2 goes on to the
next training step's DDP gradient all_reduce. The job hangs or gloo aborts on the mismatch.

Ground-truth culprit: rank 2 (the rank that skipped the collective save).
Expected cause: rank-dependent collective / desync (rank 2 skipped a collective the others
entered); not uneven data.
Healthy twin (``--mode healthy``): no stale marker; every rank saves at steps 4 and 8; exit 0.

Run: torchrun --nproc-per-node 3 dcp_save_skip.py [--mode fault|healthy] [--ckpt-dir DIR]
"""

import argparse
import os
import shutil
import time

import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
import torch.nn as nn
import torch.nn.functional as F
from torch.nn.parallel import DistributedDataParallel as DDP


class TinyLM(nn.Module):
    def __init__(self, vocab=256, dim=64):
        super().__init__()
        self.emb = nn.Embedding(vocab, dim)
        self.block = nn.TransformerEncoderLayer(dim, nhead=4, dim_feedforward=128, batch_first=True)
        self.head = nn.Linear(dim, vocab)

    def forward(self, tokens):
        return self.head(self.block(self.emb(tokens)))


def batches(rank, seq=32, bs=8, vocab=256):
    g = torch.Generator().manual_seed(rank)
    while True:
        t = torch.randint(0, vocab, (bs, seq + 1), generator=g)
        yield t[:, :-1], t[:, 1:]


def marker(ckpt_root, rank, step):
    return os.path.join(ckpt_root, f".saved_rank{rank}_step{step}")


def save_checkpoint(ckpt_root, model, opt, step, rank):
    path = os.path.join(ckpt_root, f"step_{step:06d}")
    if os.path.exists(marker(ckpt_root, rank, step)):
        print(f"FAULT_AT {time.time():.3f} rank {rank}: marker for step {step} exists, skipping dcp.save", flush=True)
        return
    state = {"model": model.module.state_dict(), "step": step}
    dcp.save(state, checkpoint_id=path)
    with open(marker(ckpt_root, rank, step), "w") as f:
        f.write(path)
    if rank == 0:
        print(f"saved {path}", flush=True)


def main():
    p = argparse.ArgumentParser()
    p.add_argument("--mode", choices=["fault", "healthy"], default="fault")
    p.add_argument("--steps", type=int, default=8)
    p.add_argument("--save-every", type=int, default=4)
    p.add_argument("--ckpt-dir", default="dcp_ckpt")
    args = p.parse_args()

    dist.init_process_group("gloo")
    rank = dist.get_rank()
    if rank == 0:
        shutil.rmtree(args.ckpt_dir, ignore_errors=True)
        os.makedirs(args.ckpt_dir)
    dist.barrier()
    if args.mode == "fault" and rank == 2:
        # reproduce the leftover from a previous crashed run on this rank
        with open(marker(args.ckpt_dir, 2, args.save_every), "w") as f:
            f.write("stale")

    torch.manual_seed(0)
    model = DDP(TinyLM())
    opt = torch.optim.AdamW(model.parameters(), lr=3e-4)
    data = batches(rank)
    for step in range(1, args.steps + 1):
        x, y = next(data)
        logits = model(x)
        loss = F.cross_entropy(logits.reshape(-1, logits.shape[-1]), y.reshape(-1))
        opt.zero_grad(set_to_none=True)
        loss.backward()
        opt.step()
        if rank == 0:
            print(f"step {step} loss {loss.item():.4f}", flush=True)
        if step % args.save_every == 0:
            save_checkpoint(args.ckpt_dir, model, opt, step, rank)

    dist.barrier()
    if rank == 0:
        print("training done", flush=True)
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
