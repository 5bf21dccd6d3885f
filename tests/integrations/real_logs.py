"""Logs written by the real trainers, single process, for the analyze tests: a healthy run, one
whose learning rate is far too high and one with a NaN injected at a step. Tiny models from
configs, random init, no download."""

from __future__ import annotations

from pathlib import Path

import torch

from tests.integrations.hf_worker import Tokens, tiny_llama


def _nan_from(module: torch.nn.Module, counter: dict, step: int | None) -> None:
    if step is None:
        return

    def hook(mod, inputs, output):
        return output * float("nan") if mod.training and counter["step"] >= step else output

    module.register_forward_hook(hook)


def hf_run(out: Path, *, lr: float = 3e-3, nan_step: int | None = None, steps: int = 60, save: int = 0) -> Path:
    """A Trainer run reporting to TensorBoard; returns its output dir (trainer_state.json, runs/)."""
    from transformers import Trainer, TrainerCallback, TrainingArguments

    counter = {"step": 0}

    class Count(TrainerCallback):
        def on_step_begin(self, args, state, control, **kwargs):
            counter["step"] = state.global_step

    model = tiny_llama()
    _nan_from(model.get_submodule("model.layers.1.mlp"), counter, nan_step)
    args = TrainingArguments(
        output_dir=str(out), per_device_train_batch_size=4, max_steps=steps, learning_rate=lr, warmup_steps=5,
        logging_steps=1, save_strategy="steps" if save else "no", save_steps=save or 500, report_to=["tensorboard"],
        use_cpu=True, seed=0, disable_tqdm=True, dataloader_num_workers=0, eval_strategy="steps", eval_steps=10,
        per_device_eval_batch_size=8,
    )
    trainer = Trainer(model=model, args=args, train_dataset=Tokens(4 * steps, seed=3), eval_dataset=Tokens(16, seed=9), callbacks=[Count()])
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        trainer.train()
    finally:
        torch.set_num_threads(threads)
    trainer.save_state()
    return out


def lightning_run(out: Path, *, logger: str = "csv", lr: float = 0.05, nan_step: int | None = None, steps: int = 80, batch: int = 64) -> Path:
    """A Lightning run with CSVLogger or TensorBoardLogger; returns the logger's version folder."""
    import lightning.pytorch as pl
    from lightning.pytorch.loggers import CSVLogger, TensorBoardLogger

    from tests.integrations.lightning_worker import _data, _module_class

    pl.seed_everything(0, verbose=False)
    model = _module_class()(lr)
    counter = {"step": 0}

    class Count(pl.Callback):
        def on_train_batch_start(self, trainer, pl_module, batch, batch_idx):
            counter["step"] = trainer.global_step

    _nan_from(model.get_submodule("net.2"), counter, nan_step)
    log = CSVLogger(str(out), name="logs") if logger == "csv" else TensorBoardLogger(str(out), name="logs")
    trainer = pl.Trainer(
        accelerator="cpu", devices=1, max_epochs=1, logger=log, callbacks=[Count()], enable_checkpointing=False,
        enable_progress_bar=False, enable_model_summary=False, num_sanity_val_steps=0, log_every_n_steps=1,
        val_check_interval=20, limit_val_batches=4,
    )
    # fresh samples every step (one epoch): batch noise, and nothing to overfit
    train_dl = torch.utils.data.DataLoader(_data(batch * steps, 100), batch_size=batch)
    val_dl = torch.utils.data.DataLoader(_data(4 * batch, 7), batch_size=batch)
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        trainer.fit(model, train_dl, val_dl)
    finally:
        torch.set_num_threads(threads)
    return Path(log.log_dir)
