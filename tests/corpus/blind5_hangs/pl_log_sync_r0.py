"""Lightning DDP regression model that logs an extra diagnostic only on global rank 0.

The author wanted the weight-norm diagnostic in the logger "once, from the main process" and
wrapped the ``self.log`` call in ``if self.global_rank == 0:``, but kept ``sync_dist=True``
(copied from the loss logging line). With ``on_step=True`` (the default in training_step)
Lightning all_reduces the value right at the ``self.log`` call.

Fault (``--mode fault``, the default): at global step 5 rank 0 logs ``diag/weight_norm`` with
``sync_dist=True`` inside the rank-0-only block, so rank 0 enters an all_reduce (1 float)
that ranks 1 and 2 never call; they go on to backward and the DDP gradient all_reduce. The
job hangs (or gloo aborts on the mismatched collectives).

Ground-truth culprit: rank 0 (it issued a collective the other ranks did not).
Expected cause: rank-dependent collective / desync (not uneven data, not a stall).
Healthy twin (``--mode healthy``): the same diagnostic is logged with ``rank_zero_only=True``
and no sync_dist; the job exits 0.

Run: torchrun --nproc-per-node 3 pl_log_sync_r0.py [--mode fault|healthy]
"""

import argparse
import time
import warnings

import lightning as L
import torch
import torch.nn as nn
import torch.nn.functional as F
from torch.utils.data import DataLoader, TensorDataset

FAULT_STEP = 5


class Regressor(L.LightningModule):
    def __init__(self, mode, lr=1e-2):
        super().__init__()
        self.save_hyperparameters()
        self.net = nn.Sequential(nn.Linear(16, 64), nn.Tanh(), nn.Linear(64, 1))

    def training_step(self, batch, batch_idx):
        x, y = batch
        loss = F.mse_loss(self.net(x).squeeze(-1), y)
        self.log("train/loss", loss, sync_dist=True, prog_bar=True)
        if self.global_rank == 0 and self.global_step % FAULT_STEP == 0 and self.global_step > 0:
            wnorm = torch.stack([p.detach().norm() for p in self.parameters()]).norm()
            if self.hparams.mode == "fault":
                print(f"FAULT_AT {time.time():.3f} rank 0: self.log(sync_dist=True) inside a rank-0-only block at step {self.global_step}", flush=True)
                self.log("diag/weight_norm", wnorm, sync_dist=True)
            else:
                self.log("diag/weight_norm", wnorm, rank_zero_only=True)
        return loss

    def validation_step(self, batch, batch_idx):
        x, y = batch
        self.log("val/loss", F.mse_loss(self.net(x).squeeze(-1), y), sync_dist=True)

    def configure_optimizers(self):
        return torch.optim.Adam(self.parameters(), lr=self.hparams.lr)


def make_data(n, seed):
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(n, 16, generator=g)
    y = (x[:, :4].sum(1) + 0.1 * torch.randn(n, generator=g))
    return TensorDataset(x, y)


def main():
    p = argparse.ArgumentParser()
    p.add_argument("--mode", choices=["fault", "healthy"], default="fault")
    args = p.parse_args()
    warnings.filterwarnings("ignore", ".*does not have many workers.*")
    L.seed_everything(0, verbose=False)

    trainer = L.Trainer(
        accelerator="cpu",
        devices=3,
        strategy="ddp",
        max_epochs=1,
        limit_train_batches=12,
        limit_val_batches=2,
        logger=False,
        enable_checkpointing=False,
        enable_progress_bar=False,
        enable_model_summary=False,
    )
    trainer.fit(Regressor(args.mode), DataLoader(make_data(1152, 0), batch_size=32),
                DataLoader(make_data(192, 1), batch_size=32))
    if trainer.is_global_zero:
        print("fit done", flush=True)


if __name__ == "__main__":
    main()
