"""A plain-torch oracle for a generalisation target: its 1-process run against its 2-rank run, no distdiag probe.

    python tests/corpus/blind_oracle.py gen_targets/NAME.py [--steps 3]
    python tests/corpus/blind_oracle.py --blind2        # every target of the second blind set
    python tests/corpus/blind_oracle.py --blind3        # every target of the third blind set
    python tests/corpus/blind_oracle.py --blind4        # every target of the fourth blind set

Runs the target's own hooks twice from the same seed: once in one process (WORLD_SIZE=1, RANK=0, no
parallelize: the single-GPU training) and once on 2 gloo ranks (parallelize, or fully_shard on each
block and the root when the target has none). Prints, for the bug (DISTDIAG_TWIN unset) and its twin
(DISTDIAG_TWIN=healthy), each step's loss on one process and the mean of the ranks' losses, and the
largest relative L2 error of the parameters after the last step. A right pair: the bug differs, the twin
does not (beyond float32 rounding).
"""

from __future__ import annotations

import argparse
import importlib.util
import os
import sys
import tempfile
from pathlib import Path

import torch
import torch.distributed as dist
import torch.multiprocessing as mp

ROOT = Path(__file__).resolve().parents[2]


def _load(target: Path):
    sys.path.insert(0, str(target.parent))
    sys.path.insert(0, str(ROOT))
    spec = importlib.util.spec_from_file_location("oracle_target", target)
    mod = importlib.util.module_from_spec(spec)
    assert spec.loader is not None
    spec.loader.exec_module(mod)
    return mod


def _train(mod, model, rank: int, world: int, steps: int):
    opt = mod.build_optimizer(model.parameters()) if hasattr(mod, "build_optimizer") else torch.optim.SGD(model.parameters(), lr=0.05)
    losses = []
    for step in range(1, steps + 1):
        torch.manual_seed(1000 + step)
        batch = mod.shard_batch(mod.make_batch(step), rank, world)
        opt.zero_grad(set_to_none=True)
        if hasattr(mod, "train_step"):
            loss = mod.train_step(model, batch, opt)
        else:
            loss = mod.loss_fn(model, batch)
            loss.backward()
            opt.step()
        losses.append(float(loss.detach()) if torch.is_tensor(loss) else float(loss))
    return losses


def _params(model):
    from torch.distributed.tensor import DTensor
    # A DistributedDataParallel wrapper's names start with "module.": compared under the model's own names.
    return {n.removeprefix("module."): (p.full_tensor() if isinstance(p, DTensor) else p).detach().clone()
            for n, p in model.named_parameters()}


def _rank(rank: int, world: int, target: str, steps: int, init: str, out: str) -> None:
    os.environ.update(RANK=str(rank), WORLD_SIZE=str(world), LOCAL_RANK=str(rank))
    mod = _load(Path(target))
    torch.manual_seed(0)
    model = mod.build_model()
    if world > 1:
        dist.init_process_group("gloo", init_method=init, rank=rank, world_size=world)
        from torch.distributed.device_mesh import init_device_mesh
        mesh = init_device_mesh("cpu", (world,), mesh_dim_names=("dp",))
        if hasattr(mod, "parallelize"):
            model = mod.parallelize(model, mesh) or model
        else:
            from torch.distributed.fsdp import fully_shard
            for layer in model.layers:
                fully_shard(layer, mesh=mesh)
            fully_shard(model, mesh=mesh)
    losses = _train(mod, model, rank, world, steps)
    params = _params(model)
    if world > 1:
        gathered: list = [None] * world
        dist.all_gather_object(gathered, losses)
        losses = [sum(col) / world for col in zip(*gathered, strict=True)]
        dist.barrier()
        dist.destroy_process_group()
    if rank == 0:
        torch.save({"losses": losses, "params": params}, out)
    sys.stdout.flush()
    os._exit(0)  # skips the interpreter's teardown, where gloo's threads sometimes abort the process


def run(target: Path, steps: int, healthy: bool) -> dict:
    if healthy:
        os.environ["DISTDIAG_TWIN"] = "healthy"
    else:
        os.environ.pop("DISTDIAG_TWIN", None)
    with tempfile.TemporaryDirectory() as tmp:
        one, two = f"{tmp}/one.pt", f"{tmp}/two.pt"
        mp.spawn(_rank, args=(1, str(target), steps, "", one), nprocs=1)
        mp.spawn(_rank, args=(2, str(target), steps, f"file://{tmp}/rdv", two), nprocs=2)
        a, b = torch.load(one), torch.load(two)
    err = max(float((a["params"][n] - b["params"][n]).norm() / a["params"][n].norm().clamp_min(1e-12)) for n in a["params"])
    return {"one": a["losses"], "two": b["losses"], "param_rel_err": err}


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("targets", nargs="*")
    ap.add_argument("--steps", type=int, default=3)
    ap.add_argument("--blind2", action="store_true", help="every target of the second blind set (BLIND2)")
    ap.add_argument("--blind3", action="store_true", help="every target of the third blind set (BLIND3)")
    ap.add_argument("--blind4", action="store_true", help="every target of the fourth blind set (BLIND4)")
    args = ap.parse_args()
    targets = list(args.targets)
    if args.blind2:
        sys.path.insert(0, str(ROOT))
        from tests.corpus.generalisation import BLIND2
        targets += [f"gen_targets/{c.target}.py" for c in BLIND2]
    if args.blind3:
        sys.path.insert(0, str(ROOT))
        from tests.corpus.generalisation import BLIND3
        targets += [f"gen_targets/{c.target}.py" for c in BLIND3]
    if args.blind4:
        sys.path.insert(0, str(ROOT))
        from tests.corpus.generalisation import BLIND4
        targets += [f"gen_targets/{c.target}.py" for c in BLIND4]
    for t in targets:
        path = Path(t) if Path(t).is_absolute() else Path(__file__).resolve().parent / t
        for healthy in (False, True):
            r = run(path, args.steps, healthy)
            which = "twin" if healthy else "bug "
            print(f"{path.stem:32s} {which} 1-proc {[round(x, 5) for x in r['one']]}  2-rank {[round(x, 5) for x in r['two']]}"
                  f"  param rel err {r['param_rel_err']:.2e}", flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
