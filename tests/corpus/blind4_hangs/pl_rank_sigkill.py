"""Lightning, 4 ranks: rank 2 is killed (SIGKILL) in training_step at step 6.

Fault (--mode fault): at global step 6 rank 2 does `os.kill(os.getpid(), signal.SIGKILL)` inside
training_step (an OOM-killer-like death: no Python exception, no cleanup). Ranks 0, 1 and 3 go on into
the step's backward and wait in DDP's gradient all_reduce for a rank that is gone.
Ground-truth culprit: rank 2. Expected cause: rank 2 lost / died (killed by a signal); the others
are stranded.
Healthy twin (--mode healthy): no kill; exits 0.

    torchrun --nproc-per-node 4 pl_rank_sigkill.py --mode fault
"""
import argparse
import os
import signal
from datetime import timedelta

import lightning as L
import torch
from lightning.pytorch.strategies import DDPStrategy
from torch.utils.data import DataLoader, TensorDataset

p = argparse.ArgumentParser()
p.add_argument("--mode", default="fault", choices=("fault", "healthy"))
p.add_argument("--kill-rank", type=int, default=2)
p.add_argument("--kill-step", type=int, default=6)
args = p.parse_args()


class Net(L.LightningModule):
    def __init__(self):
        super().__init__()
        self.net = torch.nn.Sequential(torch.nn.Linear(16, 32), torch.nn.ReLU(), torch.nn.Linear(32, 1))

    def training_step(self, batch, batch_idx):
        if args.mode == "fault" and self.global_rank == args.kill_rank and self.global_step == args.kill_step:
            print(f"rank {self.global_rank}: SIGKILL at step {self.global_step}", flush=True)
            os.kill(os.getpid(), signal.SIGKILL)
        x, y = batch
        return torch.nn.functional.mse_loss(self.net(x), y)

    def configure_optimizers(self):
        return torch.optim.SGD(self.parameters(), lr=0.05)


g = torch.Generator().manual_seed(0)
x = torch.randn(128, 16, generator=g)
ds = TensorDataset(x, x.sum(1, keepdim=True))
trainer = L.Trainer(
    accelerator="cpu", devices=int(os.environ.get("LOCAL_WORLD_SIZE", 1)), max_epochs=2,
    strategy=DDPStrategy(process_group_backend="gloo", timeout=timedelta(seconds=1800)),
    logger=False, enable_progress_bar=False, enable_model_summary=False, enable_checkpointing=False,
)
trainer.fit(Net(), DataLoader(ds, batch_size=4))
if trainer.is_global_zero:
    print("done", trainer.global_step)
