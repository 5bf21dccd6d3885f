"""accelerate text classifier that saves a snapshot mid-training from the local main process.

A small bag-of-embeddings sentiment-style classifier trained with ``accelerator.prepare`` on
the CPU (gloo). Every ``--save-every`` steps the script saves the unwrapped model.

Fault (``--mode fault``, the default): the save block reads

    if accelerator.is_local_main_process:
        accelerator.wait_for_everyone()     # "make sure the others finished the step"
        accelerator.save(unwrapped.state_dict(), ...)

so at step 6 only rank 0 enters the barrier; ranks 1 and 2 continue with step 7 and wait in
the DDP gradient all_reduce. The job hangs (or gloo aborts on the mismatched collectives).

Ground-truth culprit: rank 0 (the only rank that called the collective barrier).
Expected cause: rank-dependent collective / desync (a barrier behind a main-process check);
not uneven data.
Healthy twin (``--mode healthy``): ``wait_for_everyone()`` is called by every rank before the
``is_local_main_process`` block; exit 0.

Run: torchrun --nproc-per-node 3 acc_wait_main_only.py [--mode fault|healthy] [--out DIR]
"""

import argparse
import os
import time

import torch
import torch.nn as nn
import torch.nn.functional as F
from accelerate import Accelerator
from torch.utils.data import DataLoader, Dataset

VOCAB, SEQ = 500, 24


class ToyReviews(Dataset):
    def __init__(self, n=960, seed=0):
        g = torch.Generator().manual_seed(seed)
        self.tokens = torch.randint(1, VOCAB, (n, SEQ), generator=g)
        self.labels = (self.tokens[:, :SEQ // 2].float().mean(1) > VOCAB / 2).long()

    def __len__(self):
        return len(self.labels)

    def __getitem__(self, i):
        return {"input_ids": self.tokens[i], "labels": self.labels[i]}


class BagClassifier(nn.Module):
    def __init__(self, dim=64):
        super().__init__()
        self.emb = nn.EmbeddingBag(VOCAB, dim, mode="mean")
        self.mlp = nn.Sequential(nn.Linear(dim, dim), nn.ReLU(), nn.Linear(dim, 2))

    def forward(self, input_ids):
        return self.mlp(self.emb(input_ids))


def main():
    p = argparse.ArgumentParser()
    p.add_argument("--mode", choices=["fault", "healthy"], default="fault")
    p.add_argument("--max-steps", type=int, default=12)
    p.add_argument("--save-every", type=int, default=6)
    p.add_argument("--out", default="acc_snapshots")
    args = p.parse_args()

    accelerator = Accelerator(cpu=True)
    torch.manual_seed(0)
    model = BagClassifier()
    opt = torch.optim.AdamW(model.parameters(), lr=2e-3)
    loader = DataLoader(ToyReviews(), batch_size=16, shuffle=True)
    model, opt, loader = accelerator.prepare(model, opt, loader)

    step = 0
    model.train()
    while step < args.max_steps:
        for batch in loader:
            logits = model(batch["input_ids"])
            loss = F.cross_entropy(logits, batch["labels"])
            accelerator.backward(loss)
            opt.step()
            opt.zero_grad()
            step += 1
            accelerator.print(f"step {step} loss {loss.item():.4f}")

            if step % args.save_every == 0:
                if args.mode == "healthy":
                    accelerator.wait_for_everyone()
                if accelerator.is_local_main_process:
                    if args.mode == "fault":
                        print(f"FAULT_AT {time.time():.3f} rank {accelerator.process_index}: wait_for_everyone() inside is_local_main_process at step {step}", flush=True)
                        accelerator.wait_for_everyone()
                    os.makedirs(args.out, exist_ok=True)
                    unwrapped = accelerator.unwrap_model(model)
                    accelerator.save(unwrapped.state_dict(), os.path.join(args.out, f"model_step{step}.pt"))
                    print(f"saved snapshot at step {step}", flush=True)
            if step >= args.max_steps:
                break

    accelerator.wait_for_everyone()
    accelerator.print("training finished")
    accelerator.end_training()


if __name__ == "__main__":
    main()
