"""Rank entry for tests/integrations/test_hf_trainer.py: a real `transformers.Trainer` run with DDP
on gloo (tiny Llama from a config, random init, no download), with or without DistdiagCallback.

argv: key=value words
  fault=none|sleep|uneven|nan   sleep: rank `rank` sleeps in a callback at step `step` (a hang);
                                uneven: rank `rank` gets fewer batches (it leaves the loop first);
                                nan: rank `rank`'s module `module` outputs NaN from step `step` on
  twin=1      train once without distdiag first, then with it: both losses go to the result
  steps=N     optimizer steps (default 12); timeout=S watchdog seconds; every=N monitor look period
  report=tensorboard|none  lr=F  evals=N (evaluate every N steps)  save=N (checkpoint every N steps)
Each rank writes WORKDIR/result{rank}.json: losses, findings; rank 0 saves out/trainer_state.json.
"""

from __future__ import annotations

import os
import time
from datetime import timedelta

import torch

WORDS = {"fault": "none", "rank": "1", "step": "4", "steps": "12", "twin": "0", "timeout": "8", "every": "2",
         "report": "none", "lr": "3e-3", "module": "model.layers.0.mlp", "evals": "0", "save": "0", "seed": "0"}


class Tokens(torch.utils.data.Dataset):
    """Sequences with a pattern a tiny model learns in a few steps (the next token is +1)."""

    def __init__(self, n: int, seed: int) -> None:
        gen = torch.Generator().manual_seed(seed)
        starts = torch.randint(0, 64, (n, 1), generator=gen)
        self.ids = (starts + torch.arange(16)) % 64

    def __len__(self) -> int:
        return len(self.ids)

    def __getitem__(self, i: int) -> dict:
        return {"input_ids": self.ids[i], "labels": self.ids[i]}


def tiny_llama():
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(0)
    cfg = LlamaConfig(vocab_size=64, hidden_size=32, intermediate_size=64, num_hidden_layers=2, num_attention_heads=4,
                      num_key_value_heads=2, max_position_embeddings=32)
    return LlamaForCausalLM(cfg)


def _fault_callbacks(w: dict, rank: int) -> list:
    from transformers import TrainerCallback

    class Sleeper(TrainerCallback):
        def on_step_end(self, args, state, control, **kwargs):
            if rank == int(w["rank"]) and state.global_step == int(w["step"]):
                time.sleep(120)  # FAULT:sleep

    return [Sleeper()] if w["fault"] == "sleep" else []


def _nan_hook(model, w: dict, rank: int, counter: dict) -> None:
    if w["fault"] != "nan" or rank != int(w["rank"]):
        return
    module = model.get_submodule(w["module"])

    def hook(mod, inputs, output):
        if mod.training and counter["step"] >= int(w["step"]):
            return output * float("nan")  # FAULT:nan
        return output

    module.register_forward_hook(hook)


def train(w: dict, workdir: str, *, with_distdiag: bool) -> dict:
    import torch.distributed as dist
    from transformers import TrainerCallback, TrainingArguments

    from distdiag.integrations.hf import DistdiagCallback

    rank = int(os.environ.get("RANK", "0"))
    out = os.path.join(workdir, "out" if with_distdiag else "out-plain")
    steps, batch = int(w["steps"]), 4
    world = int(os.environ.get("WORLD_SIZE", "1"))
    n = steps * batch * world
    if w["fault"] == "uneven" and rank == int(w["rank"]):
        n = (steps // 2) * batch * world  # this rank's loader ends halfway
    args = TrainingArguments(
        output_dir=out, per_device_train_batch_size=batch, num_train_epochs=1, learning_rate=float(w["lr"]),
        logging_steps=1, save_strategy="steps" if w["save"] != "0" else "no", save_steps=int(w["save"]) or 500, report_to=[] if w["report"] == "none" else [w["report"]],
        use_cpu=True, ddp_backend="gloo", ddp_timeout=60, ddp_find_unused_parameters=False, seed=int(w["seed"]), disable_tqdm=True,
        dataloader_num_workers=0, eval_strategy="steps" if w["evals"] != "0" else "no",
        eval_steps=int(w["evals"]) if w["evals"] != "0" else None, per_device_eval_batch_size=batch,
    )
    model = tiny_llama()
    counter = {"step": 0}

    class Count(TrainerCallback):
        def on_step_begin(self, args, state, control, **kwargs):
            counter["step"] = state.global_step

    _nan_hook(model, w, rank, counter)
    callbacks: list = [Count(), *_fault_callbacks(w, rank)]
    diag = None
    if with_distdiag:
        diag = DistdiagCallback(timeout=timedelta(seconds=float(w["timeout"])), every=int(w["every"]))
        callbacks.append(diag)
    train_ds = Tokens(n, seed=100 + rank if w["fault"] == "uneven" else 100)
    eval_ds = Tokens(2 * batch * world, seed=7) if w["evals"] != "0" else None
    trainer = _trainer_class(w, rank, n)(model=model, args=args, train_dataset=train_ds, eval_dataset=eval_ds, callbacks=callbacks)
    trainer.train()
    trainer.save_state()
    if dist.is_initialized():
        dist.barrier()
    losses = [e["loss"] for e in trainer.state.log_history if "loss" in e]
    return {"losses": losses, "findings": [f.to_dict() for f in (diag.findings if diag else [])]}


def _trainer_class(w: dict, rank: int, n: int):
    from transformers import Trainer

    if w["fault"] != "uneven":
        return Trainer

    class UnevenTrainer(Trainer):
        """Each rank reads its own dataset as it is, not a DistributedSampler's even shard."""

        def get_train_dataloader(self):
            return torch.utils.data.DataLoader(self.train_dataset, batch_size=self.args.per_device_train_batch_size)

    return UnevenTrainer


def main(argv: list[str]) -> int:
    from tests.integrations.common import worker_main

    return worker_main(argv, WORDS, train)
