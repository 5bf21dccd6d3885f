"""Rank entry for tests/integrations/test_lightning.py: a real Lightning `Trainer` run with DDP on
gloo (a small MLP, random init), with or without distdiag's DistdiagCallback.

argv: WORKDIR then key=value words (as hf_worker.py)
  fault=none|sleep|uneven|nan  sleep: rank `rank` sleeps in a callback at step `step`;
                               uneven: rank `rank` gets fewer batches (no DistributedSampler);
                               nan: rank `rank`'s module `module` outputs NaN from step `step` on
  twin=1   train once without distdiag first; logger=csv|tensorboard; lr=F; steps=N; val=1
Each rank writes WORKDIR/result{rank}.json: losses, findings.
"""

from __future__ import annotations

import os
import time
from datetime import timedelta

import torch

WORDS = {"fault": "none", "rank": "1", "step": "4", "steps": "12", "twin": "0", "timeout": "8", "every": "2",
         "logger": "csv", "lr": "0.05", "module": "net.2", "val": "0", "seed": "0"}


def _module_class():
    import lightning.pytorch as pl

    class Regressor(pl.LightningModule):
        def __init__(self, lr: float) -> None:
            super().__init__()
            self.lr = lr
            self.net = torch.nn.Sequential(torch.nn.Linear(8, 32), torch.nn.Tanh(), torch.nn.Linear(32, 32), torch.nn.Tanh(), torch.nn.Linear(32, 1))
            self.losses: list[float] = []

        def training_step(self, batch, batch_idx):
            x, y = batch
            loss = torch.nn.functional.mse_loss(self.net(x), y)
            self.log("train_loss", loss)
            self.losses.append(loss.item())
            return loss

        def validation_step(self, batch, batch_idx):
            x, y = batch
            self.log("val_loss", torch.nn.functional.mse_loss(self.net(x), y), sync_dist=True)

        def configure_optimizers(self):
            return torch.optim.SGD(self.parameters(), lr=self.lr)

    return Regressor


def _data(n: int, seed: int):
    gen = torch.Generator().manual_seed(seed)
    x = torch.randn(n, 8, generator=gen)
    y = torch.sin(x[:, :1]) + 0.5 * x[:, 1:2]
    return torch.utils.data.TensorDataset(x, y)


def train(w: dict, workdir: str, *, with_distdiag: bool) -> dict:
    import lightning.pytorch as pl
    from lightning.pytorch.loggers import CSVLogger, TensorBoardLogger
    from lightning.pytorch.strategies import DDPStrategy

    from distdiag.integrations.lightning import DistdiagCallback

    rank, world = int(os.environ.get("RANK", "0")), int(os.environ.get("WORLD_SIZE", "1"))
    root = os.path.join(workdir, "out" if with_distdiag else "out-plain")
    steps, batch = int(w["steps"]), 8
    uneven = w["fault"] == "uneven"
    n = steps * batch * (1 if uneven else world)
    if uneven and rank == int(w["rank"]):
        n = (steps // 2) * batch
    pl.seed_everything(int(w["seed"]), verbose=False)
    model = _module_class()(float(w["lr"]))
    step_now = {"step": 0}

    class Faults(pl.Callback):
        def on_train_batch_start(self, trainer, pl_module, batch, batch_idx):
            step_now["step"] = trainer.global_step

        def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx):
            if w["fault"] == "sleep" and rank == int(w["rank"]) and trainer.global_step == int(w["step"]):
                time.sleep(120)  # FAULT:sleep

    if w["fault"] == "nan" and rank == int(w["rank"]):
        def hook(mod, inputs, output):
            if mod.training and step_now["step"] >= int(w["step"]):
                return output * float("nan")  # FAULT:nan
            return output

        model.get_submodule(w["module"]).register_forward_hook(hook)
    callbacks: list = [Faults()]
    diag = None
    if with_distdiag:
        diag = DistdiagCallback(timeout=timedelta(seconds=float(w["timeout"])), every=int(w["every"]))
        callbacks.append(diag)
    logger = CSVLogger(root, name="logs") if w["logger"] == "csv" else TensorBoardLogger(root, name="logs")
    trainer = pl.Trainer(
        accelerator="cpu", devices=world, strategy=DDPStrategy(process_group_backend="gloo", timeout=timedelta(seconds=60)),
        max_epochs=1, logger=logger, callbacks=callbacks, enable_checkpointing=False, enable_progress_bar=False,
        enable_model_summary=False, num_sanity_val_steps=0, log_every_n_steps=1, use_distributed_sampler=not uneven,
        val_check_interval=0.5 if w["val"] == "1" else None, limit_val_batches=2 if w["val"] == "1" else 0,
        default_root_dir=root,
    )
    train_dl = torch.utils.data.DataLoader(_data(n, 100 + rank if uneven else 100), batch_size=batch)
    val_dl = torch.utils.data.DataLoader(_data(4 * batch, 7), batch_size=batch) if w["val"] == "1" else None
    trainer.fit(model, train_dl, val_dl)
    return {"losses": model.losses, "findings": [f.to_dict() for f in (diag.findings if diag else [])],
            "log_dir": logger.log_dir}


def main(argv: list[str]) -> int:
    from tests.integrations.common import worker_main

    return worker_main(argv, WORDS, train)
