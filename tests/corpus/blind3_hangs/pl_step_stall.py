"""Lightning DDP (CPU/gloo), 4 ranks: one rank stalls inside training_step.

Fault (default, --sleep 3600): at global step 7, rank 2 calls time.sleep(--sleep) inside
training_step, before its forward (think: a blocking read from a dead network filesystem).
Ranks 0, 1 and 3 finish step 7's forward/backward and wait in DDP's gradient all_reduce.

Ground truth: culprit rank 2. Expected cause: a stall - rank 2 is computing/sleeping outside
any collective (its stack in training_step / time.sleep); NOT uneven data. Ranks 0, 1, 3 are
stranded.

Healthy twin (--sleep 6): the same stall lasts 6 s, under the 10 s watchdog timeout; must
exit 0 with no hang report.
"""
import argparse
import os
import time
from datetime import timedelta

import lightning.pytorch as L
import torch
from lightning.pytorch.strategies import DDPStrategy

p = argparse.ArgumentParser()
p.add_argument("--sleep", type=float, default=3600)
p.add_argument("--rank", type=int, default=2)
p.add_argument("--step", type=int, default=7)
args = p.parse_args()
RANK = int(os.environ.get("RANK", 0))

x = torch.randn(4 * 15 * 8, 10, generator=torch.Generator().manual_seed(1))
data = torch.utils.data.TensorDataset(x, (x[:, :3].sum(1) > 0).long())


class Clf(L.LightningModule):
    def __init__(self):
        super().__init__()
        self.body = torch.nn.Sequential(torch.nn.Linear(10, 32), torch.nn.ReLU(), torch.nn.Linear(32, 2))

    def training_step(self, batch, i):
        if self.global_step == args.step and RANK == args.rank:
            print(f"FAULT_AT {time.time():.3f} rank {RANK}: sleeping {args.sleep}s in training_step", flush=True)
            time.sleep(args.sleep)
        x, y = batch
        return torch.nn.functional.cross_entropy(self.body(x), y)

    def configure_optimizers(self):
        return torch.optim.SGD(self.parameters(), lr=0.1, momentum=0.9)


trainer = L.Trainer(accelerator="cpu", devices=int(os.environ.get("LOCAL_WORLD_SIZE", 1)), max_epochs=1,
                    strategy=DDPStrategy(process_group_backend="gloo", timeout=timedelta(seconds=1800)),
                    enable_progress_bar=False, enable_model_summary=False, enable_checkpointing=False, logger=False)
trainer.fit(Clf(), torch.utils.data.DataLoader(data, batch_size=8))
print(f"DONE rank {RANK} steps {trainer.global_step}", flush=True)
