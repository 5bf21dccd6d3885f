"""The device contract of docs/targets.md ("Devices"), checked on CPU: no GPU here.

On a GPU FSDP2 moves the model, and a forward's inputs, to the rank's device; what a loss reads
beside the model's output (targets, masks) stays where make_batch put it unless someone moves
it, and `cross_entropy(cuda_logits, cpu_targets)` raises. Here the "meta" device stands in for
the GPU: a model moved to meta with a forward pre-hook moving its inputs (what FSDP2's root
pre-forward does), a batch made on the CPU, and a dispatch mode that records the devices of the
tensors every aten op receives. A built-in loss that leaves one tensor of the batch behind
fails here as it would on the GPU ("Tensor on device cpu is not on the expected device meta").
"""

from __future__ import annotations

import pytest
import torch
from torch import nn
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_leaves, tree_map

from distdiag.probes import training as tr
from distdiag.workloads import get_workload
from distdiag.workloads import sequence as seqw
from distdiag.workloads.base import batch_on, model_device, to_device

META = torch.device("meta")


_MOVES = ("aten._to_copy", "aten.copy_", "aten._copy_from")


class DeviceLog(TorchDispatchMode):
    """Every aten op run under it, with the devices of the tensors it received (a 0-dim CPU
    tensor is a scalar torch accepts beside any device, and is left out)."""

    def __init__(self) -> None:
        super().__init__()
        self.ops: list[tuple[str, set[torch.device]]] = []

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):  # noqa: ANN001
        kwargs = kwargs or {}
        devices = {t.device for t in tree_leaves((args, kwargs))
                   if isinstance(t, torch.Tensor) and not (t.device.type == "cpu" and t.dim() == 0)}
        self.ops.append((str(func), devices))
        return func(*args, **kwargs)

    def strays(self, device: torch.device) -> list[str]:
        """Ops that computed on a tensor elsewhere than `device` (the copies that move a tensor
        there are what the contract asks for, not strays)."""
        return [f"{op} on {sorted(map(str, devs))}" for op, devs in self.ops
                if devs - {device} and not op.startswith(_MOVES)]

    def mixed(self) -> list[str]:
        """Ops that received tensors on two devices (what raises on a GPU)."""
        return [f"{op} on {sorted(map(str, devs))}" for op, devs in self.ops if len(devs) > 1]


def as_if_on_gpu(model: nn.Module) -> nn.Module:
    """The model on meta, its forward's inputs moved there as FSDP2 moves them to the GPU."""
    model = model.to(META)

    def move_inputs(_module, args, kwargs):  # noqa: ANN001
        move = lambda t: t.to(META) if isinstance(t, torch.Tensor) else t  # noqa: E731
        return tree_map(move, args), tree_map(move, kwargs)

    model.register_forward_pre_hook(move_inputs, with_kwargs=True)
    return model


def _builtin_cases():
    for name in ("mlp", "transformer"):
        for world in (1, 2):
            yield pytest.param(name, world, id=f"{name}-world{world}")
    for world in (1, 2):
        yield pytest.param("sequence", world, id=f"sequence-world{world}")


def _workload(name: str, world: int):
    """(model, a rank's shard on the CPU, the loss) of a built-in workload."""
    torch.manual_seed(0)
    if name == "sequence":
        batch = seqw.make_lm_batch(batch_size=2, seq_len=16, vocab=64, pad=3)
        shard = batch if world == 1 else seqw.contiguous_split(batch, 1, world)
        return seqw.TinyCausalLM(vocab=64, max_len=16), shard, seqw.sp_loss
    w = get_workload(name, world_size=world)
    return w.build_model(), w.shard_batch(w.make_batch(1), world - 1, world), w.loss_fn


@pytest.mark.parametrize(("name", "world"), _builtin_cases())
def test_builtin_losses_put_the_whole_batch_on_the_models_device(name: str, world: int) -> None:
    model, shard, loss_fn = _workload(name, world)
    assert {t.device.type for t in tree_leaves(shard) if isinstance(t, torch.Tensor)} == {"cpu"}
    model = as_if_on_gpu(model)
    with DeviceLog() as log:
        loss = loss_fn(model, shard)
    assert loss.device == META and loss.dim() == 0
    assert log.ops and log.strays(META) == []


def _recording_hooks(seen: list[set[torch.device]]) -> tr.Hooks:
    def devices(batch):  # noqa: ANN001
        return {t.device for t in tree_leaves(batch) if isinstance(t, torch.Tensor)}

    def loss_fn(model, batch):  # noqa: ANN001
        seen.append(devices(batch))
        return torch.zeros((), requires_grad=True)  # a real scalar: meta has no value to read

    def train_step(model, batch, optimizer):  # noqa: ANN001
        seen.append(devices(batch))
        return 0.0

    return tr.Hooks(source="test", build_model=lambda: nn.Linear(4, 2), make_batch=lambda s: None, loss_fn=loss_fn,
                    parallelize=tr.default_parallelize, shard_batch=lambda b, r, w: b,
                    build_optimizer=lambda p: torch.optim.SGD(p, lr=0.1), train_step=train_step)


def test_probes_hand_loss_fn_and_train_step_the_batch_on_the_models_device() -> None:
    """The framework's side of the contract, for a user's hooks: run_step (train_step and
    loss_fn), and call_loss (loss_parity's plain backward, determinism's reference passes,
    setup_sync's forward), with tensors nested in dicts, tuples and lists."""
    seen: list[set[torch.device]] = []
    hooks = _recording_hooks(seen)
    model = nn.Linear(4, 2).to(META)
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    batch = {"x": torch.zeros(3, 4), "extra": [torch.ones(3), (torch.arange(3), "tag")], "n": 3}
    tr.run_step(hooks, model, opt, batch)  # train_step
    tr.call_loss(hooks, model, batch)
    hooks.train_step = None
    tr.run_step(hooks, model, opt, batch)  # loss_fn + backward + step
    assert seen == [{META}] * 3
    assert batch["x"].device.type == "cpu"  # the caller's batch is not changed in place


def test_to_device_keeps_containers_and_values() -> None:
    from collections import namedtuple

    Pair = namedtuple("Pair", "a b")

    class Batch(dict):
        pass

    batch = Batch(x=torch.zeros(2), pair=Pair(torch.ones(1), 5), seq=[torch.zeros(1), "s"])
    out = to_device(batch, META)
    assert type(out) is Batch and type(out["pair"]) is Pair and isinstance(out["seq"], list)
    assert out["x"].device == META and out["pair"].a.device == META and out["pair"].b == 5 and out["seq"][1] == "s"
    same = torch.zeros(2)
    assert to_device(same, "cpu") is same and to_device(batch, None) is batch


def test_model_device_is_where_the_model_computes() -> None:
    assert model_device(nn.Linear(2, 2)) == torch.device("cpu")
    assert model_device(nn.Linear(2, 2).to(META)) == META
    assert model_device(nn.ReLU()) is None
    assert batch_on(nn.ReLU(), {"x": torch.zeros(1)})["x"].device.type == "cpu"


class PretendGpu(DeviceLog):
    """DeviceLog where meta holds zeros: a copy from meta to the CPU reads zeros, so code that
    moves a "GPU" tensor to the CPU before computing with a CPU one runs to the end, and code
    that mixes them raises as it would on a GPU."""

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):  # noqa: ANN001
        kwargs = kwargs or {}
        if func is torch.ops.aten._to_copy.default and args[0].device == META and kwargs.get("device", META) != META:
            self.ops.append((str(func), {META}))
            return torch.zeros(args[0].shape, dtype=kwargs.get("dtype") or args[0].dtype, device=kwargs["device"])
        return super().__torch_dispatch__(func, types, args, kwargs)


def test_parity_compares_the_parallel_tensors_on_the_references_device() -> None:
    """loss_parity's `got - want`: the parallel model's tensors (on the rank's GPU) against the
    reference's (built on the CPU): compared on the reference's device, never across two."""
    from distdiag.probes.numerics.loss_parity import compare_tensors

    ref = {"w": torch.full((4, 3), 2.0), "b": torch.ones(3)}
    par = {"w": torch.empty(4, 3, device=META), "b": torch.empty(3, device=META)}
    with PretendGpu() as log:
        out = compare_tensors(ref, par, 1.0, fit=True)
    assert log.mixed() == [] and any(op.startswith("aten._to_copy") for op, _ in log.ops)
    assert out["max_abs"] == 2.0 and sorted(b["name"] for b in out["bad"]) == ["b", "w"]  # zeros against the reference


def test_the_example_target_follows_the_contract() -> None:
    """configs/example_target.py, as users copy it: its loss_fn and train_step (micro-batches,
    clipping, AdamW) on the batch distdiag hands them, everything on the model's device."""
    import importlib.util
    from pathlib import Path

    path = Path(__file__).resolve().parents[2] / "configs" / "example_target.py"
    spec = importlib.util.spec_from_file_location("example_target_devices", path)
    target = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(target)
    torch.manual_seed(0)
    model = as_if_on_gpu(target.build_model())
    shard = target.shard_batch(target.make_batch(1), 0, 2)
    hooks = tr.Hooks(source="example", build_model=target.build_model, make_batch=target.make_batch,
                     loss_fn=target.loss_fn, parallelize=target.parallelize, shard_batch=target.shard_batch,
                     build_optimizer=target.build_optimizer)
    opt = target.build_optimizer(model.parameters())
    with DeviceLog() as log:
        loss = tr.call_loss(hooks, model, shard)
        total = target.train_step(model, batch_on(model, shard), opt)
    assert loss.device == META and total.device == META
    assert log.strays(META) == []
