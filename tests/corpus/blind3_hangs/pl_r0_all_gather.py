"""Lightning DDP (CPU/gloo), 3 ranks: a rank-dependent self.all_gather on global zero only.

Fault (--mode fault): in on_train_epoch_end, inside `if self.trainer.is_global_zero:`, the
module calls self.all_gather(...) to collect a per-rank statistic for printing. Only rank 0
enters that all_gather; ranks 1 and 2 go on to the next epoch (their next collective is DDP's
gradient all_reduce in backward), so the job hangs (or gloo pairs mismatched collectives).

Ground truth: culprit rank 0 (the only rank that called the extra collective). Expected cause:
a rank-dependent collective / desync on rank 0 - NOT uneven data (every rank has the same
number of batches). Ranks 1 and 2 are stranded.

--mode healthy: the all_gather is called on every rank (the correct code); must exit 0.
"""
import argparse
import os
import time
from datetime import timedelta

import lightning.pytorch as L
import torch
from lightning.pytorch.strategies import DDPStrategy

p = argparse.ArgumentParser()
p.add_argument("--mode", default="fault", choices=("fault", "healthy"))
p.add_argument("--epochs", type=int, default=3)
args = p.parse_args()
RANK = int(os.environ.get("RANK", 0))

x = torch.randn(3 * 10 * 16, 5, generator=torch.Generator().manual_seed(0))
data = torch.utils.data.TensorDataset(x, (x ** 2).sum(1, keepdim=True))


class Net(L.LightningModule):
    def __init__(self):
        super().__init__()
        self.body = torch.nn.Sequential(torch.nn.Linear(5, 16), torch.nn.Tanh(), torch.nn.Linear(16, 1))
        self.seen = 0

    def training_step(self, batch, i):
        x, y = batch
        self.seen += len(x)
        return torch.nn.functional.mse_loss(self.body(x), y)

    def on_train_epoch_end(self):
        stat = torch.tensor([float(self.seen)])
        if args.mode == "healthy":
            allstat = self.all_gather(stat)
            if self.trainer.is_global_zero:
                print(f"epoch {self.current_epoch} samples per rank {allstat.flatten().tolist()}", flush=True)
        elif self.trainer.is_global_zero:
            print(f"FAULT_AT {time.time():.3f} rank 0: all_gather only on global zero", flush=True)
            allstat = self.all_gather(stat)
            print(f"epoch {self.current_epoch} samples per rank {allstat.flatten().tolist()}", flush=True)

    def configure_optimizers(self):
        return torch.optim.SGD(self.parameters(), lr=0.01)


trainer = L.Trainer(accelerator="cpu", devices=int(os.environ.get("LOCAL_WORLD_SIZE", 1)), max_epochs=args.epochs,
                    strategy=DDPStrategy(process_group_backend="gloo", timeout=timedelta(seconds=1800)),
                    enable_progress_bar=False, enable_model_summary=False, enable_checkpointing=False, logger=False)
trainer.fit(Net(), torch.utils.data.DataLoader(data, batch_size=16, shuffle=True))
print(f"DONE rank {RANK} steps {trainer.global_step}", flush=True)
