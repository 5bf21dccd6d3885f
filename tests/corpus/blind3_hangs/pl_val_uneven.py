"""Lightning DDP (CPU/gloo), 3 ranks: uneven VALIDATION data, training even.

Fault (--mode fault): every rank trains on 12 identical-length batches per epoch, but the
validation stream is built per rank (an IterableDataset, so Lightning leaves it unsharded) and
rank 1's validation shard holds 5 batches where ranks 0 and 2 hold 8. validation_step logs
val_loss with sync_dist=True and on_step=True, so every validation batch is an all_reduce.
After its 5th validation batch rank 1 leaves validation (epoch-end sync, then the next training
epoch's DDP all_reduce) while ranks 0 and 2 wait in the 6th validation-step all_reduce.

Ground truth: culprit rank 1. Expected cause: uneven data - rank 1 ran out of validation
batches (uneven_data); ranks 0 and 2 are stranded.

Healthy twin (--mode slowval): even validation data; rank 1 sleeps --slow-s (6 s) in its first
validation batch of epoch 0, under a 10 s watchdog timeout: must exit 0, no hang report.
--mode healthy: nothing wrong.
"""
import argparse
import os
import time
from datetime import timedelta

import lightning.pytorch as L
import torch
from lightning.pytorch.strategies import DDPStrategy

p = argparse.ArgumentParser()
p.add_argument("--mode", default="fault", choices=("fault", "healthy", "slowval"))
p.add_argument("--slow-s", type=float, default=6)
p.add_argument("--epochs", type=int, default=2)
args = p.parse_args()
RANK = int(os.environ.get("RANK", 0))
BS = 16


class Stream(torch.utils.data.IterableDataset):
    def __init__(self, batches, seed, short_rank=None, short_batches=None):
        self.batches, self.seed, self.short_rank, self.short_batches = batches, seed, short_rank, short_batches

    def __iter__(self):
        n = self.short_batches if RANK == self.short_rank else self.batches
        g = torch.Generator().manual_seed(self.seed + RANK)
        for _ in range(n * BS):
            x = torch.randn(6, generator=g)
            yield x, x[:2].sum(0, keepdim=True).cos()
        if RANK == self.short_rank:
            print(f"FAULT_AT {time.time():.3f} rank {RANK}: validation data exhausted after {n} batches", flush=True)


class Net(L.LightningModule):
    def __init__(self):
        super().__init__()
        self.body = torch.nn.Sequential(torch.nn.Linear(6, 24), torch.nn.ReLU(), torch.nn.Linear(24, 1))

    def training_step(self, batch, i):
        x, y = batch
        loss = torch.nn.functional.mse_loss(self.body(x), y)
        self.log("train_loss", loss)
        return loss

    def validation_step(self, batch, i):
        x, y = batch
        if args.mode == "slowval" and RANK == 1 and i == 0 and self.current_epoch == 0:
            print(f"SLOW_AT {time.time():.3f} rank 1 sleeps {args.slow_s}s in validation", flush=True)
            time.sleep(args.slow_s)
        self.log("val_loss", torch.nn.functional.mse_loss(self.body(x), y), sync_dist=True, on_step=True, on_epoch=True)

    def configure_optimizers(self):
        return torch.optim.Adam(self.parameters(), lr=1e-2)


train = torch.utils.data.DataLoader(Stream(12, 100), batch_size=BS)
val = torch.utils.data.DataLoader(Stream(8, 200, short_rank=1 if args.mode == "fault" else None, short_batches=5), batch_size=BS)
trainer = L.Trainer(accelerator="cpu", devices=int(os.environ.get("LOCAL_WORLD_SIZE", 1)), max_epochs=args.epochs,
                    strategy=DDPStrategy(process_group_backend="gloo", timeout=timedelta(seconds=1800)),
                    enable_progress_bar=False, enable_model_summary=False, enable_checkpointing=False, logger=False,
                    num_sanity_val_steps=0)
trainer.fit(Net(), train, val)
print(f"DONE rank {RANK} steps {trainer.global_step}", flush=True)
