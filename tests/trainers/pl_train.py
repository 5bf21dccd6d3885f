"""Lightning DDP (CPU, gloo) with validation every epoch and checkpointing on (ModelCheckpoint).

Run under `distdiag watch --nproc-per-node N -- pl_train.py --mode M` or, with --callback (the
DistdiagCallback of distdiag.integrations.lightning, --dd-timeout seconds), under plain torchrun.
Each rank reads its own stream (an IterableDataset sharded by rank); in mode short the short rank's
stream ends early, which is how the real Lightning hang comes about.
"""
import os
import sys
from datetime import timedelta

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import _faults as F  # noqa: E402

p = F.parser(__doc__)
p.add_argument("--callback", action="store_true")
p.add_argument("--dd-timeout", type=float, default=10)
p.add_argument("--bs", type=int, default=16)
args = F.parse(p)

import lightning.pytorch as L  # noqa: E402
import torch  # noqa: E402
from lightning.pytorch.callbacks import ModelCheckpoint  # noqa: E402
from lightning.pytorch.loggers import CSVLogger  # noqa: E402
from lightning.pytorch.plugins.io import TorchCheckpointIO  # noqa: E402
from lightning.pytorch.strategies import DDPStrategy  # noqa: E402

torch.set_num_threads(1)
inject = F.Injector(args)


class RankStream(torch.utils.data.IterableDataset):
    def __iter__(self):
        n = F.n_batches(args)
        g = torch.Generator().manual_seed(F.RANK)
        for _ in range(n * args.bs):
            x = torch.randn(8, generator=g)
            yield x, torch.sin(x[:1])
        F.short_done(args, n)


class Model(L.LightningModule):
    def __init__(self):
        super().__init__()
        self.net = torch.nn.Sequential(torch.nn.Linear(8, 32), torch.nn.Tanh(), torch.nn.Linear(32, 1))

    def training_step(self, batch, batch_idx):
        inject.compute(self.global_step)
        x, y = batch
        loss = torch.nn.functional.mse_loss(self.net(x), y)
        self.log("train_loss", loss)
        return loss

    def on_train_batch_end(self, outputs, batch, batch_idx):
        inject.branch(self.global_step)

    def validation_step(self, batch, batch_idx):
        if not self.trainer.sanity_checking and batch_idx == 0:
            inject.slow("val")
        x, y = batch
        self.log("val_loss", torch.nn.functional.mse_loss(self.net(x), y), sync_dist=True)

    def configure_optimizers(self):
        return torch.optim.SGD(self.parameters(), lr=0.05)


class SlowLogger(CSVLogger):
    def log_metrics(self, metrics, step=None):
        if "train_loss" in metrics:
            inject.slow("log")
        return super().log_metrics(metrics, step)


class SlowIO(TorchCheckpointIO):
    def save_checkpoint(self, checkpoint, path, storage_options=None):
        inject.slow("ckpt")
        return super().save_checkpoint(checkpoint, path, storage_options)


x = torch.randn(512, 8, generator=torch.Generator().manual_seed(0))
val = torch.utils.data.TensorDataset(x, torch.sin(x[:, :1]))
callbacks = [ModelCheckpoint(dirpath="ckpt", every_n_epochs=1, save_top_k=-1)]
if args.callback:
    from distdiag.integrations.lightning import DistdiagCallback

    callbacks.append(DistdiagCallback(timeout=timedelta(seconds=args.dd_timeout), every=10))
trainer = L.Trainer(
    accelerator="cpu", devices=int(os.environ.get("LOCAL_WORLD_SIZE", 1)), max_epochs=args.epochs,
    logger=SlowLogger("logs"), callbacks=callbacks, plugins=[SlowIO()], enable_progress_bar=False,
    enable_model_summary=False, log_every_n_steps=2, num_sanity_val_steps=1,
    strategy=DDPStrategy(process_group_backend="gloo", timeout=timedelta(seconds=1800)),
)
trainer.fit(Model(), torch.utils.data.DataLoader(RankStream(), batch_size=args.bs),
            torch.utils.data.DataLoader(val, batch_size=128))
F.stamp("DONE", f"steps={trainer.global_step}")
