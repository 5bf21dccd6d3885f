"""One parallel model per check run and rank, shared by the numerics probes.

fsdp_plan, loss_parity, param_sync and determinism each used to build and shard their own
copy of the same model and train it from the same setup: the same K steps ran up to three
times. A `ParallelRun` builds and parallelizes the model once per (rank, hooks) and keeps
its trajectory: the replicas' checksums after setup and after each step (param_sync), each
step's fingerprint (determinism), and the state before step 1, so that any probe can
rewind to the setup state and train again from there (loss_parity, which needs its
reference in lockstep; determinism, which repeats step 1). A step is always seeded the
same way (`STEP_SEED + step`), whoever drives it.

The run lives in a per-context registry: probes called on another context (tests, the
watchdog) get their own. determinism, the last consumer in the suite's order, releases it.
"""

from __future__ import annotations

import copy
import weakref
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any, TypedDict

import torch
from torch import nn

from distdiag.probes import training as tr

if TYPE_CHECKING:
    from distdiag.runtime.context import RankContext

__all__ = ["ParallelRun", "parallel_run", "release", "STEP_SEED", "State", "Fingerprint", "fingerprint"]

STEP_SEED = 1000
"""Every rank seeds STEP_SEED + step before training step `step` (dropout draws agree)."""

_RUNS: dict[int, tuple[Any, dict[str, ParallelRun]]] = {}


class State:
    """A copy of one rank's local training state (its shards only) to run a step again."""

    def __init__(self, model: nn.Module, opt: torch.optim.Optimizer) -> None:
        self.tensors = [(t, tr.local_tensor(t).detach().clone()) for t in list(model.parameters()) + list(model.buffers())]
        self.opt = copy.deepcopy(opt.state_dict())
        self.rng = torch.get_rng_state()

    def restore(self, opt: torch.optim.Optimizer) -> None:
        with torch.no_grad():
            for t, saved in self.tensors:
                tr.local_tensor(t).copy_(saved)
        opt.load_state_dict(self.opt)
        torch.set_rng_state(self.rng)


@dataclass
class StepRecord:
    """What one step of the trajectory left for the probes that did not drive it."""

    loss: float
    fingerprint: Fingerprint
    """determinism's bits of the loss and of every gradient the optimizer stepped with."""


@dataclass
class ParallelRun:
    """The parallel model of one set of hooks on this rank, and its trajectory from setup."""

    hooks: tr.Hooks
    model: nn.Module = None  # type: ignore[assignment]  # None only where `failed`, which readers check first
    ties: list[list[str]] = field(default_factory=list)
    error: str | None = None
    """This rank's setup error (a hook failed), or None."""
    failed: bool = False
    """Some rank's setup failed (agreed in one all_reduce): nothing else was run."""
    optimizer: torch.optim.Optimizer | None = None
    snaps: list[dict[str, Any]] = field(default_factory=list)
    """param_sync's checksums: after setup, then after each step."""
    steps: list[StepRecord] = field(default_factory=list)
    step_error: tuple[int, str] | None = None
    """(step, message) of a hook failing during a step (the same on every rank)."""
    initial: State | None = None

    def ensure_optimizer(self) -> torch.optim.Optimizer:
        """The parallel model's optimizer, built once (call inside the caller's setup try block)."""
        if self.optimizer is None:
            assert self.model is not None
            self.optimizer = self.hooks.optimizer(self.model)
        return self.optimizer

    def shard(self, ctx: RankContext, step: int) -> Any:
        return self.hooks.shard(self.hooks.batch(step), ctx.rank, ctx.world_size)

    def step(self, ctx: RankContext, step: int, shard: Any | None = None) -> tr.StepResult:
        """Train step `step` (the next one of the trajectory) and record it.

        The result's gradients are the live ones (the caller compares them before the next
        step); a HookError is recorded in `step_error` and raised again.
        """
        from distdiag.probes.numerics.replicas import snapshot

        assert self.model is not None and self.optimizer is not None and step == len(self.steps) + 1
        if self.initial is None:
            self.initial = State(self.model, self.optimizer)
        try:
            if shard is None:
                shard = self.shard(ctx, step)
            ctx.seed(STEP_SEED + step)
            result = tr.run_step(self.hooks, self.model, self.optimizer, shard)
        except tr.HookError as exc:
            self.step_error = (step, str(exc))
            raise
        self.steps.append(StepRecord(result.loss, fingerprint(result.loss, result.grads)))
        self.snaps.append(snapshot(self.model, ctx.world_size))
        return result

    def advance(self, ctx: RankContext, steps: int, shards: dict[int, Any]) -> None:
        """Make sure the trajectory has `steps` steps, the missing ones on `shards` (made by the
        caller before its setup agreement). Raises HookError as `step` does."""
        if self.step_error is not None and self.step_error[0] <= steps:
            raise tr.HookError(self.step_error[1])
        while len(self.steps) < steps:
            self.step(ctx, len(self.steps) + 1, shards[len(self.steps) + 1])

    @property
    def failed_step(self) -> int:
        """The step whose hook failed (after a HookError from `step` or `advance`)."""
        return self.step_error[0] if self.step_error else len(self.steps) + 1

    def rewind(self) -> None:
        """Back to the state before step 1 (parameters, buffers, optimizer, RNG)."""
        if self.initial is not None and self.optimizer is not None:
            self.initial.restore(self.optimizer)
        del self.steps[:]
        del self.snaps[1:]
        self.step_error = None


class Fingerprint(TypedDict):
    """The bits of one step: the loss as float.hex() and each gradient's bit_checksum, by name."""

    loss: str
    grads: dict[str, str]


def fingerprint(loss: float, grads: dict[str, torch.Tensor]) -> Fingerprint:
    """The bits of a step's loss and gradients (determinism compares them)."""
    from distdiag.probes.numerics.replicas import bit_checksum

    return {"loss": float(loss).hex(), "grads": {n: bit_checksum(tr.local_tensor(g)) for n, g in grads.items()}}


def _registry(ctx: RankContext) -> dict[str, ParallelRun]:
    entry = _RUNS.get(id(ctx))
    if entry is None or entry[0]() is not ctx:
        for key in [k for k, (ref, _) in _RUNS.items() if ref() is None]:
            del _RUNS[key]
        entry = (weakref.ref(ctx), {})
        _RUNS[id(ctx)] = entry
    return entry[1]


def parallel_run(ctx: RankContext, workload: str) -> ParallelRun:
    """This rank's shared run for the hooks the probe resolves (built and agreed on first use).

    Setup is the same on every rank and ends with one all_reduce (`agree`), so a hook that
    fails on one rank never leaves the others waiting; a later probe gets the same answer
    without a collective.
    """
    hooks = tr.resolve_hooks(ctx, workload)
    runs = _registry(ctx)
    run = runs.get(hooks.source)
    if run is not None:
        return run
    from distdiag.probes.numerics.replicas import snapshot

    run = ParallelRun(hooks=hooks)
    mesh = tr.make_mesh(ctx)
    model = None
    try:
        model = hooks.model(ctx.seed)
        run.ties = ties(model)
    except tr.HookError as exc:
        run.error = str(exc)
    # requires_grad set per rank makes FSDP2/DDP's collectives differ in size: a gloo abort or an NCCL hang
    # in the first forward. One all_reduce before parallelize turns it into a finding instead.
    if trainable_differs(ctx, model) and model is not None:
        frozen = [tr.canonical_name(n) for n, p in model.named_parameters() if not p.requires_grad]
        run.error = (f"requires_grad differs across ranks: this rank has {sum(1 for p in model.parameters() if p.requires_grad)} "
                     f"trainable parameter(s), frozen: {', '.join(frozen[:6]) or 'none'}"
                     f"{' (+more)' if len(frozen) > 6 else ''}; parallelize not run (FSDP2/DDP would reduce different "
                     "sets of gradients on different ranks: a collective mismatch). Freeze the same parameters on every rank")
    if run.error is None and model is not None:
        try:
            run.model = hooks.wrap(model, mesh)
        except tr.HookError as exc:
            run.error = str(exc)
    run.failed = tr.agree(ctx, run.error is not None)
    if not run.failed:
        run.snaps.append(snapshot(run.model, ctx.world_size))  # "after setup", before anything draws
    runs[hooks.source] = run
    return run


def trainable_differs(ctx: RankContext, model: nn.Module | None) -> bool:
    """Whether the names of the trainable parameters differ across ranks (one all_reduce of a hash and its
    negation, MAX: equal on every rank exactly when max(h) == min(h))."""
    import hashlib

    names = ",".join(tr.canonical_name(n) for n, p in model.named_parameters() if p.requires_grad) if model is not None else ""
    h = int(hashlib.blake2b(names.encode(), digest_size=7).hexdigest(), 16) if model is not None else -1
    both = torch.tensor([h, -h], dtype=torch.int64, device=ctx.device)
    ctx.comm.all_reduce(both, op=torch.distributed.ReduceOp.MAX)
    hi, lo = int(both[0]), -int(both[1])
    return hi != lo and lo >= 0  # a rank without a model (-1) is the build error's finding, not this one


def release(ctx: RankContext, run: ParallelRun) -> None:
    """Forget the run (its model, optimizer and saved state go with it)."""
    runs = _registry(ctx)
    if runs.get(run.hooks.source) is run:
        del runs[run.hooks.source]


def ties(model: nn.Module) -> list[list[str]]:
    """Names that share one parameter in the model as built (before parallelize)."""
    by_id: dict[int, list[str]] = {}
    for name, p in model.named_parameters(remove_duplicate=False):
        by_id.setdefault(id(p), []).append(tr.canonical_name(name))
    return [names for names in by_id.values() if len(names) > 1]
