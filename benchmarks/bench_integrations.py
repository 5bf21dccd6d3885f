"""What distdiag's trainer callbacks cost per step: the HF Trainer and Lightning, with and without.

    python benchmarks/bench_integrations.py [--world 2] [--repeats 6] [--steps 40] [--every 10]

Two gloo ranks on CPU. Each repeat trains the same model twice in the same processes, once
plain and once with DistdiagCallback (watchdog armed, monitor every `--every` steps, the
non-finite skip on), in alternating order so that load drifts hit both alike. A timing callback
listed first measures each optimizer step from its start to its end (the callback's step mark,
loss capture, monitor and non-finite check are inside); the first 5 steps of a run are warm-up
and left out. Reported: per repeat the ratio of the median step times (with / plain), then the
median and spread of those ratios, wall and CPU (both ranks' CPU summed). Models: a Llama of
4 layers x 128 (HF, sequence 64, batch 8), an MLP of 4 x 256 (Lightning, batch 64).
"""

from __future__ import annotations

import argparse
import json
import os
import socket
import statistics
import sys
import time
from datetime import timedelta

import torch
import torch.distributed as dist
import torch.multiprocessing as mp

WARMUP = 5


def _summary(times: list[tuple[float, float]]) -> tuple[float, float]:
    kept = times[WARMUP:]
    return statistics.median(t[0] for t in kept), statistics.median(t[1] for t in kept)


def _hf(args: argparse.Namespace, with_distdiag: bool, out: str) -> list[tuple[float, float]]:
    from transformers import LlamaConfig, LlamaForCausalLM, Trainer, TrainerCallback, TrainingArguments

    from distdiag.integrations.hf import DistdiagCallback

    times: list[tuple[float, float]] = []

    class StepTimer(TrainerCallback):
        def on_step_begin(self, a, state, control, **kw):
            self.t = (time.perf_counter(), time.process_time())

        def on_step_end(self, a, state, control, **kw):
            times.append((time.perf_counter() - self.t[0], time.process_time() - self.t[1]))

    class Tokens(torch.utils.data.Dataset):
        def __len__(self):
            return 10_000

        def __getitem__(self, i):
            ids = (torch.arange(64) + i) % 256
            return {"input_ids": ids, "labels": ids}

    torch.manual_seed(0)
    model = LlamaForCausalLM(LlamaConfig(vocab_size=256, hidden_size=128, intermediate_size=256, num_hidden_layers=4,
                                         num_attention_heads=4, num_key_value_heads=4, max_position_embeddings=64))
    callbacks: list = [StepTimer()]
    if with_distdiag:
        callbacks.append(DistdiagCallback(timeout=timedelta(minutes=5), every=args.every))
    targs = TrainingArguments(output_dir=out, per_device_train_batch_size=8, max_steps=args.steps, logging_steps=10,
                              save_strategy="no", report_to=[], use_cpu=True, ddp_backend="gloo", disable_tqdm=True,
                              ddp_find_unused_parameters=False, dataloader_num_workers=0, seed=0)
    Trainer(model=model, args=targs, train_dataset=Tokens(), callbacks=callbacks).train()
    return times


def _lightning(args: argparse.Namespace, with_distdiag: bool, out: str) -> list[tuple[float, float]]:
    import lightning.pytorch as pl
    from lightning.pytorch.strategies import DDPStrategy

    from distdiag.integrations.lightning import DistdiagCallback

    times: list[tuple[float, float]] = []

    class StepTimer(pl.Callback):
        def on_train_batch_start(self, trainer, pl_module, batch, batch_idx):
            self.t = (time.perf_counter(), time.process_time())

        def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx):
            times.append((time.perf_counter() - self.t[0], time.process_time() - self.t[1]))

    class MLP(pl.LightningModule):
        def __init__(self):
            super().__init__()
            self.net = torch.nn.Sequential(*[m for _ in range(4) for m in (torch.nn.Linear(256, 256), torch.nn.GELU())], torch.nn.Linear(256, 1))

        def training_step(self, batch, batch_idx):
            x, y = batch
            loss = torch.nn.functional.mse_loss(self.net(x), y)
            self.log("train_loss", loss)
            return loss

        def configure_optimizers(self):
            return torch.optim.AdamW(self.parameters(), lr=1e-4)

    pl.seed_everything(0, verbose=False)
    x = torch.randn(64 * args.steps, 256)
    data = torch.utils.data.DataLoader(torch.utils.data.TensorDataset(x, x[:, :1]), batch_size=64)
    callbacks: list = [StepTimer()]
    if with_distdiag:
        callbacks.append(DistdiagCallback(timeout=timedelta(minutes=5), every=args.every))
    trainer = pl.Trainer(accelerator="cpu", devices=args.world, strategy=DDPStrategy(process_group_backend="gloo"),
                         max_steps=args.steps, logger=False, callbacks=callbacks, enable_checkpointing=False,
                         enable_progress_bar=False, enable_model_summary=False, default_root_dir=out,
                         use_distributed_sampler=False)
    trainer.fit(MLP(), data)
    return times


def _worker(rank: int, world: int, port: int, args: argparse.Namespace, out_path: str) -> None:
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), RANK=str(rank), WORLD_SIZE=str(world),
                      LOCAL_RANK=str(rank), LOCAL_WORLD_SIZE=str(world), GROUP_RANK="0")
    torch.set_num_threads(1)
    import logging

    logging.disable(logging.WARNING)  # the trainers' banners; results go to the JSON
    runs = {"hf": _hf, "lightning": _lightning}
    frameworks = [f for f in args.frameworks.split(",") if f]
    pairs: dict[str, list] = {f: [] for f in frameworks}
    out_dir = os.path.join("/tmp", f"bench_integrations_{os.getppid()}")
    for rep in range(args.repeats):
        for f in frameworks:
            order = (False, True) if rep % 2 == 0 else (True, False)
            got = {flag: _summary(runs[f](args, flag, out_dir)) for flag in order}
            pairs[f].append({"plain": got[False], "with": got[True]})
    gathered: list = [None] * world
    dist.all_gather_object(gathered, pairs)
    if rank == 0:
        result: dict = {"world": world, "repeats": args.repeats, "steps": args.steps, "every": args.every}
        for f in frameworks:
            entry = {}
            for kind in ("wall", "cpu"):
                if kind == "wall":
                    plain = [p["plain"][0] for p in gathered[0][f]]
                    with_ = [p["with"][0] for p in gathered[0][f]]
                else:  # both ranks' CPU, summed
                    plain = [sum(g[f][i]["plain"][1] for g in gathered) for i in range(args.repeats)]
                    with_ = [sum(g[f][i]["with"][1] for g in gathered) for i in range(args.repeats)]
                ratios = [w / p for w, p in zip(with_, plain, strict=True)]
                entry[kind] = {"plain_step_ms": round(1e3 * statistics.median(plain), 2), "with_step_ms": round(1e3 * statistics.median(with_), 2),
                               "ratio_median": round(statistics.median(ratios), 4), "ratio_min": round(min(ratios), 4), "ratio_max": round(max(ratios), 4)}
            result[f] = entry
        with open(out_path, "w") as fh:
            json.dump(result, fh)
    if dist.is_initialized():
        dist.destroy_process_group()


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--world", type=int, default=2)
    p.add_argument("--repeats", type=int, default=6)
    p.add_argument("--steps", type=int, default=40)
    p.add_argument("--every", type=int, default=10)
    p.add_argument("--frameworks", default="hf,lightning")
    args = p.parse_args()
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    out_path = os.path.join("/tmp", f"bench_integrations_{os.getpid()}.json")
    mp.start_processes(_worker, args=(args.world, port, args, out_path), nprocs=args.world, join=True, start_method="spawn")
    with open(out_path) as fh:
        result = json.load(fh)
    os.unlink(out_path)
    print(json.dumps(result, indent=2))
    for f in args.frameworks.split(","):
        for kind in ("wall", "cpu"):
            r = result[f][kind]
            print(f"{f:>9} {kind:>4}: {r['plain_step_ms']:.1f} ms/step plain, {r['with_step_ms']:.1f} with distdiag: "
                  f"x{r['ratio_median']:.3f} median over {args.repeats} pairs [{r['ratio_min']:.3f}, {r['ratio_max']:.3f}]")
    sys.stdout.flush()


if __name__ == "__main__":
    main()
