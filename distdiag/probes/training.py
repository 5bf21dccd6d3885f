"""What the numerical probes share: resolving hooks, building models, one training step.

A probe gets its hooks from the user's target or, without one, from a built-in workload
(distdiag.workloads). Every call into a hook goes through `call_hook`, which turns an
exception or a wrong return type into a HookError naming the hook, so a probe can report
it as a finding. Setup is local (no collectives) and ends with `agree`, one all_reduce in
which every rank learns whether any rank failed: a hook that fails on one rank never leaves
the others waiting in a collective.
"""

from __future__ import annotations

import functools
import logging
import traceback
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

import torch
from torch import nn

from distdiag.errors import DistDiagError, exc_line, publish_caught
from distdiag.probes.base import SHARDING_IMPORTS, Probe
from distdiag.workloads import WORKLOADS, get_workload
from distdiag.workloads.base import batch_on, batch_size, split_batch

if TYPE_CHECKING:
    from torch.distributed.device_mesh import DeviceMesh

    from distdiag.runtime.context import RankContext

__all__ = [
    "NumericsProbe",
    "check_workload",
    "Hooks",
    "HookError",
    "resolve_hooks",
    "missing_hooks_reason",
    "layout_reason",
    "call_hook",
    "call_loss",
    "default_parallelize",
    "default_loss",
    "make_mesh",
    "agree",
    "run_step",
    "model_bytes",
    "canonical_name",
    "rtol_for",
]

log = logging.getLogger("distdiag.probes.training")

DEFAULT_LR = 0.05
_RTOL = {torch.float64: 1e-9, torch.float32: 1e-4, torch.float16: 1e-2, torch.bfloat16: 5e-2}


class HookError(DistDiagError):
    """A user hook raised or returned something unusable; the message names the hook."""


def rtol_for(dtype: torch.dtype, scale: float = 1.0) -> float:
    """The relative tolerance of a comparison in this dtype (rounding differs with reduction order)."""
    return _RTOL.get(dtype, 1e-4) * scale


def canonical_name(name: str) -> str:
    """A parameter FQN without the wrappers' prefixes (DDP's `module.`, compile's `_orig_mod.`)."""
    parts = [p for p in name.split(".") if p not in ("_orig_mod", "_checkpoint_wrapped_module", "_fsdp_wrapped_module")]
    if parts and parts[0] == "module":
        parts = parts[1:]
    return ".".join(parts)


def _where(exc: BaseException) -> str:
    frames = [f for f in traceback.extract_tb(exc.__traceback__) if "/distdiag/" not in f.filename]
    return f" (at {frames[-1].filename}:{frames[-1].lineno})" if frames else ""


def call_hook(name: str, fn: Callable[..., Any], *args: Any) -> Any:
    """Call a hook; any exception becomes a HookError naming the hook and where it raised."""
    try:
        return fn(*args)
    except HookError:
        raise
    except Exception as exc:  # noqa: BLE001 - user code: any failure is a finding
        # Out of band first: the probe goes on to a collective (agree) that ranks the hook
        # stranded in its own collectives will never match.
        publish_caught(exc, f"hook {name}")
        raise HookError(f"hook {name} raised {exc_line(exc)}{_where(exc)}") from exc


def call_loss(hooks: Hooks, model: nn.Module, batch: Any) -> Any:
    """`loss_fn(model, batch)` with the batch on the model's device (the device contract of
    docs/targets.md): every probe calls loss_fn through here, never directly."""
    return call_hook("loss_fn", hooks.loss_fn, model, batch_on(model, batch))


def _check_batch(batch: Any, what: str) -> Any:
    ok = isinstance(batch, torch.Tensor) or (
        isinstance(batch, (tuple, list, dict)) and any(isinstance(v, torch.Tensor) for v in (batch.values() if isinstance(batch, dict) else batch))
    )
    if not ok:
        raise HookError(f"{what} returned {type(batch).__name__}, expected a tensor, a tuple of tensors or a dict of tensors")
    return batch


def default_loss(model: nn.Module, batch: Any) -> torch.Tensor:
    """The model's own loss: model(batch) / model(*batch) / model(**batch), then `.loss` or ["loss"]."""
    if isinstance(batch, dict):
        out = model(**batch)
    elif isinstance(batch, (tuple, list)):
        out = model(*batch)
    else:
        out = model(batch)
    if isinstance(out, torch.Tensor):
        return out
    loss = getattr(out, "loss", None)
    if loss is None and isinstance(out, dict):
        loss = out.get("loss")
    if not isinstance(loss, torch.Tensor):
        raise HookError(
            f"no loss_fn hook, and the model's output ({type(out).__name__}) has no loss; define loss_fn(model, batch)"
        )
    return loss


def _blocks(model: nn.Module) -> list[nn.Module]:
    """The repeated blocks: elements of the outermost nn.ModuleLists, else the direct children."""
    found: list[nn.Module] = []
    inside: set[int] = set()
    for _, module in model.named_modules():
        if id(module) in inside:
            continue
        if isinstance(module, nn.ModuleList):
            for child in module:
                found.append(child)
                inside.update(id(m) for m in child.modules())
    if not found:
        found = list(model.children())
    return [b for b in found if any(True for _ in b.parameters())]


def default_parallelize(
    model: nn.Module, mesh: DeviceMesh, blocks: Callable[[nn.Module], list[nn.Module]] = _blocks,
) -> nn.Module:
    """FSDP2: fully_shard each repeated block (found by ``blocks``), then the root (which takes the rest)."""
    from torch.distributed.fsdp import fully_shard

    for block in blocks(model):
        fully_shard(block, mesh=mesh)
    fully_shard(model, mesh=mesh)
    return model


def make_mesh(ctx: RankContext, dim: str = "dp") -> DeviceMesh:
    """The 1-D mesh over the world, its one dim named ``dim`` (data-parallel by default).

    FSDP2 and DTensor (and torch._dynamo, which DTensor.from_local imports on first use)
    are imported lazily, here: ~1.5-3 s per process on 2 cores, which a check that does not
    run these probes should not pay.
    """
    from torch.distributed.device_mesh import init_device_mesh

    return init_device_mesh(ctx.device.type, (ctx.world_size,), mesh_dim_names=(dim,))


@dataclass
class Hooks:
    """The hooks a probe calls, each from the target or a default, and where they came from."""

    source: str
    build_model: Callable[[], nn.Module]
    make_batch: Callable[[int], Any]
    loss_fn: Callable[[nn.Module, Any], torch.Tensor]
    parallelize: Callable[[nn.Module, DeviceMesh], nn.Module | None]
    shard_batch: Callable[[Any, int, int], Any]
    build_optimizer: Callable[[Iterator[nn.Parameter]], torch.optim.Optimizer]
    train_step: Callable[[nn.Module, Any, torch.optim.Optimizer], Any] | None = None
    defaults: list[str] = field(default_factory=list)
    optimizer_desc: str = ""

    # -- validated calls ---------------------------------------------------------------
    def model(self, seed: Callable[[], None]) -> nn.Module:
        seed()
        model = call_hook("build_model", self.build_model)
        if not isinstance(model, nn.Module):
            raise HookError(f"hook build_model returned {type(model).__name__}, expected a torch.nn.Module")
        return model

    def batch(self, step: int) -> Any:
        return _check_batch(call_hook("make_batch", self.make_batch, step), f"hook make_batch({step})")

    def shard(self, batch: Any, rank: int, world: int) -> Any:
        if "shard_batch" in self.defaults:
            size = batch_size(batch)
            if size is not None and size % world:
                raise HookError(
                    f"the global batch has {size} samples (dim 0), which {world} ranks cannot split evenly; "
                    f"make make_batch return a multiple of {world} samples or define shard_batch"
                )
        return _check_batch(call_hook("shard_batch", self.shard_batch, batch, rank, world), "hook shard_batch")

    def optimizer(self, model: nn.Module) -> torch.optim.Optimizer:
        opt = call_hook("build_optimizer", self.build_optimizer, model.parameters())
        if not isinstance(opt, torch.optim.Optimizer):
            raise HookError(f"hook build_optimizer returned {type(opt).__name__}, expected a torch.optim.Optimizer")
        return opt

    def wrap(self, model: nn.Module, mesh: DeviceMesh) -> nn.Module:
        out = call_hook("parallelize", self.parallelize, model, mesh)
        if out is None:
            return model  # fully_shard works in place; returning nothing is fine
        if not isinstance(out, nn.Module):
            raise HookError(f"hook parallelize returned {type(out).__name__}, expected the parallel nn.Module")
        return out


def missing_hooks_reason(ctx: RankContext, probe: str) -> str | None:
    target = getattr(ctx, "target", None)
    if target is None:
        return None
    missing = [h for h in ("build_model", "make_batch") if not target.has(h)]
    if missing:
        return f"probe '{probe}' needs hook(s) {', '.join(m + '()' for m in missing)} in target {target.spec}"
    return None


def layout_reason(ctx: RankContext, probe: str) -> str | None:
    """Why the target's own parallel layout is not the data-parallel one this probe compares, or None.

    The numerics probes build one model per rank with build_model, split each global batch
    across ranks along dim 0 (shard_batch) and compare with one process training on the
    whole batch. A target that declares another layout and no data-parallel one is not
    trained that way: run on it, the probe reports its own wrong assumption as the user's
    bug (an SP loss normalised per sequence shard "diverges"), or, where build_model
    already holds only this rank's experts, the "1-process" reference issues the model's
    all_to_all: ranks can stall or abort on mismatched sizes (exit 3) before the probe made
    for that layout runs. Hooks are all a probe knows of the layout before it runs, so a
    dense MoE with route() skips too (the reason says how to run it).
    """
    target = getattr(ctx, "target", None)
    if target is None:
        return None
    if target.has("route"):
        return (f"probe '{probe}' does not apply to target {target.spec}: it declares route(), a mixture-of-experts "
                "layout whose experts may be split across ranks, with no one-process reference; moe_routing "
                "checks it instead (routing and router state across ranks, before and after training steps, and "
                "the all_to_all dispatch); for a dense model, use a target without route()")
    sp = [h + "()" for h in ("split_sequence", "parallelize_sp") if target.has(h)]
    if sp and not (target.has("shard_batch") or target.has("parallelize")):
        return (f"probe '{probe}' does not apply to target {target.spec}: it declares a sequence-parallel layout "
                f"({', '.join(sp)}; checked by sequence_parallel) and no data-parallel one; define shard_batch() "
                "to split the batch by sample and run it")
    return None


class NumericsProbe(Probe):
    """The four numerics probes: they skip when a target lacks build_model or make_batch, or
    declares a layout they do not compare (layout_reason).

    `run` builds models and issues FSDP2's collectives (and one all_reduce through ctx.comm
    to agree on setup failures) in the same order on every rank.
    """

    checks_a_model = True

    preload = SHARDING_IMPORTS

    def skip_reason(self, ctx: RankContext) -> str | None:
        return missing_hooks_reason(ctx, self.name) or layout_reason(ctx, self.name)


def check_workload(key: str, value: object) -> None:
    """Config validation of a `workload` option (ConfigError naming the dotted key)."""
    if value not in WORKLOADS:
        from distdiag.errors import ConfigError

        raise ConfigError(f"{key} must be one of {', '.join(WORKLOADS)}, got {value!r}")


def resolve_hooks(ctx: RankContext, workload: str) -> Hooks:
    """The target's hooks with distdiag's defaults for the missing ones (or a built-in workload)."""
    target = getattr(ctx, "target", None)

    def sgd(params: Iterator[nn.Parameter]) -> torch.optim.Optimizer:
        return torch.optim.SGD(params, lr=DEFAULT_LR)

    sgd_desc = f"torch.optim.SGD(lr={DEFAULT_LR}) (distdiag's default: no build_optimizer hook)"
    if target is None:
        # Sized for this world: its batch and parameters split evenly across any number of ranks.
        w = get_workload(workload, world_size=ctx.world_size)
        return Hooks(
            source=f"built-in workload {w.describe()}",
            build_model=w.build_model, make_batch=w.make_batch, loss_fn=w.loss_fn,
            parallelize=functools.partial(default_parallelize, blocks=w.blocks), shard_batch=w.shard_batch, build_optimizer=sgd,
            defaults=["parallelize", "build_optimizer"], optimizer_desc=sgd_desc,
        )
    got = target.hooks
    defaults = [h for h in ("loss_fn", "parallelize", "shard_batch", "build_optimizer") if h not in got]
    return Hooks(
        source=f"target {target.spec}",
        build_model=got["build_model"],
        make_batch=got["make_batch"],
        loss_fn=got.get("loss_fn", default_loss),
        parallelize=got.get("parallelize", default_parallelize),
        shard_batch=got.get("shard_batch", split_batch),
        build_optimizer=got.get("build_optimizer", sgd),
        train_step=got.get("train_step"),
        defaults=defaults,
        optimizer_desc=sgd_desc if "build_optimizer" in defaults else "the target's build_optimizer",
    )


def local_tensor(t: torch.Tensor) -> torch.Tensor:
    """A DTensor's local shard; any other tensor as it is."""
    return t.to_local() if hasattr(t, "to_local") else t


def agree(ctx: RankContext, failed: bool) -> bool:
    """One all_reduce(MAX): True when any rank failed its local setup."""
    flag = torch.tensor([1 if failed else 0], dtype=torch.int32, device=ctx.device)
    ctx.comm.all_reduce(flag, op=torch.distributed.ReduceOp.MAX)
    return bool(flag.item())


def _scalar(value: object, hook: str) -> float:
    if isinstance(value, torch.Tensor):
        if value.numel() != 1:
            raise HookError(f"hook {hook} returned a tensor of shape {list(value.shape)}, expected a scalar loss")
        return float(value.detach().float().item())
    if isinstance(value, (int, float)):
        return float(value)
    raise HookError(f"hook {hook} returned {type(value).__name__}, expected a scalar loss tensor")


@dataclass
class StepResult:
    loss: float
    grads: dict[str, torch.Tensor]
    """The gradients the optimizer stepped with (held, not copied), by canonical FQN."""


def run_step(hooks: Hooks, model: nn.Module, optimizer: torch.optim.Optimizer, shard: Any) -> StepResult:
    """One training step: the target's train_step, else loss_fn + backward + optimizer.step.

    The gradients are captured by an optimizer pre-step hook, so they are what the optimizer
    saw (after any accumulation and clipping), even if train_step zeroes them afterwards.
    """
    names = {id(p): canonical_name(n) for n, p in model.named_parameters()}
    seen: dict[str, torch.Tensor] = {}

    def capture(opt: torch.optim.Optimizer, args: object, kwargs: object) -> None:
        for group in opt.param_groups:
            for p in group["params"]:
                if p.grad is not None and id(p) in names:
                    seen[names[id(p)]] = p.grad

    handle = optimizer.register_step_pre_hook(capture)
    try:
        optimizer.zero_grad(set_to_none=True)
        if hooks.train_step is not None:
            shard = batch_on(model, shard)  # the device contract (docs/targets.md), as call_loss
            loss = _scalar(call_hook("train_step", hooks.train_step, model, shard, optimizer), "train_step")
        else:
            out = call_loss(hooks, model, shard)
            loss = _scalar(out, "loss_fn")
            if not isinstance(out, torch.Tensor) or not out.requires_grad:
                raise HookError("hook loss_fn returned a loss that does not require grad (detached?)")
            out.backward()
            optimizer.step()
    finally:
        handle.remove()
    return StepResult(loss=loss, grads=seen)


def model_bytes(model: nn.Module) -> int:
    """Bytes of the full (unsharded) parameters and buffers of a model, sharded or not."""
    total = 0
    seen: set[int] = set()
    for t in list(model.parameters()) + list(model.buffers()):
        if id(t) in seen:
            continue
        seen.add(id(t))
        total += t.numel() * t.element_size()  # a DTensor's numel is its global numel
    return total
