"""DeepSpeed ZeRO-2 on the CPU accelerator (gloo), installed with DS_BUILD_OPS=0 (torch Adam, no
compiled ops): the rank's own pre-sharded batches, the loss all_reduced every 2 steps for logging,
an evaluation pass and engine.save_checkpoint at the end of every epoch. In mode branch the fault
rank alone calls deepspeed.comm.barrier().
"""
import os
import sys

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import _faults as F  # noqa: E402

p = F.parser(__doc__)
p.add_argument("--stage", type=int, default=2)
args = F.parse(p)

import deepspeed  # noqa: E402
import torch  # noqa: E402
from deepspeed import comm  # noqa: E402

torch.set_num_threads(1)
inject = F.Injector(args)
deepspeed.init_distributed(dist_backend="gloo")
torch.manual_seed(0)
model = torch.nn.Sequential(torch.nn.Linear(16, 64), torch.nn.GELU(), torch.nn.Linear(64, 1))
cfg = {"train_micro_batch_size_per_gpu": 8, "gradient_accumulation_steps": 1, "steps_per_print": 100000,
       "optimizer": {"type": "Adam", "params": {"lr": 1e-3, "torch_adam": True}},
       "zero_optimization": {"stage": args.stage}}
engine, _, _, _ = deepspeed.initialize(model=model, model_parameters=model.parameters(), config=cfg)


_save = engine.checkpoint_engine.save  # the write itself: rank 0's is slow in mode slowckpt


def slow_save(state_dict, path):
    inject.slow("ckpt")
    return _save(state_dict, path)


engine.checkpoint_engine.save = slow_save


def batches():
    g = torch.Generator().manual_seed(F.RANK)
    for _ in range(F.n_batches(args)):
        x = torch.randn(8, 16, generator=g)
        yield x, x.sum(1, keepdim=True).sin()


xv = torch.randn(32, 16, generator=torch.Generator().manual_seed(0))
step = 0
for epoch in range(args.epochs):
    for i, (x, y) in enumerate(batches()):  # noqa: B007 (i counts the batches, read after the loop)
        inject.compute(step)
        loss = torch.nn.functional.mse_loss(engine(x), y)
        engine.backward(loss)
        engine.step()
        if step % 2 == 0:
            t = loss.detach().clone()
            comm.all_reduce(t)
            if F.RANK == 0:
                inject.slow("log")
                print(f"epoch {epoch} step {step} loss {t.item() / F.WORLD:.4f}", flush=True)
        step += 1
        inject.branch(step, comm.barrier)
    F.short_done(args, i + 1)
    with torch.no_grad():
        inject.slow("val")
        v = torch.nn.functional.mse_loss(engine(xv), xv.sum(1, keepdim=True).sin()).reshape(1)
        comm.all_reduce(v)
    engine.save_checkpoint("ckpt", tag=f"epoch{epoch}")
F.stamp("DONE", f"steps={step}")
