"""Lightning, 3 ranks: a checkpoint callback whose on_save_checkpoint calls a barrier on rank 0 only.

Fault (--mode fault): `SidecarOnSave.on_save_checkpoint` (run by ModelCheckpoint's save at the end of
every training epoch) does `if trainer.is_global_zero: torch.distributed.barrier()` ("wait for the
others before writing the sidecar file"), a rank-dependent collective. Ranks 1 and 2 never call it.
Ground-truth culprit: rank 0. Expected cause: a collective that only rank 0 issues (rank-dependent
branch in a callback), NOT uneven data; ranks 1 and 2 are stranded.
Healthy twin (--mode healthy): every rank calls the barrier in on_save_checkpoint; exits 0.

    torchrun --nproc-per-node 3 pl_ckpt_r0_barrier.py --mode fault
"""
import argparse
import os
from datetime import timedelta

import lightning as L
import torch
import torch.distributed as dist
from lightning.pytorch.callbacks import Callback
from lightning.pytorch.strategies import DDPStrategy
from torch.utils.data import DataLoader, TensorDataset

p = argparse.ArgumentParser()
p.add_argument("--mode", default="fault", choices=("fault", "healthy"))
p.add_argument("--epochs", type=int, default=3)
args = p.parse_args()


class Net(L.LightningModule):
    def __init__(self):
        super().__init__()
        self.net = torch.nn.Sequential(torch.nn.Linear(16, 32), torch.nn.ReLU(), torch.nn.Linear(32, 1))

    def training_step(self, batch, batch_idx):
        x, y = batch
        return torch.nn.functional.mse_loss(self.net(x), y)

    def configure_optimizers(self):
        return torch.optim.SGD(self.parameters(), lr=0.05)


class SidecarOnSave(Callback):
    """Writes a small JSON next to each checkpoint; the author 'syncs' before writing it."""

    def on_save_checkpoint(self, trainer, pl_module, checkpoint):
        if args.mode == "healthy" or trainer.is_global_zero:
            if args.mode == "fault":
                print(f"rank {trainer.global_rank}: barrier in on_save_checkpoint (epoch {trainer.current_epoch})", flush=True)
            dist.barrier()  # fault: only the global zero process gets here in --mode fault
        if trainer.is_global_zero:
            with open(os.path.join(trainer.default_root_dir, "sidecar.txt"), "a") as f:
                f.write(f"epoch {trainer.current_epoch} step {trainer.global_step}\n")


g = torch.Generator().manual_seed(0)
x = torch.randn(96, 16, generator=g)
ds = TensorDataset(x, x.sum(1, keepdim=True))
trainer = L.Trainer(
    accelerator="cpu", devices=int(os.environ.get("LOCAL_WORLD_SIZE", 1)), max_epochs=args.epochs,
    strategy=DDPStrategy(process_group_backend="gloo", timeout=timedelta(seconds=1800)),
    callbacks=[SidecarOnSave()], logger=False, enable_progress_bar=False, enable_model_summary=False,
    default_root_dir=os.getcwd(),
)
trainer.fit(Net(), DataLoader(ds, batch_size=4))
if trainer.is_global_zero:
    print("done", trainer.global_step)
