"""`loss_parity`: does the N-rank setup compute what one process computes on the global batch?

Every rank runs the reference (the unsharded model from build_model, the whole global
batch, shard_batch(batch, 0, 1), no collectives) next to its part of the parallel run
(parallelize + shard_batch(batch, rank, world)), step by step. After each step it compares
the gradients the optimizer stepped with, and the parameters after the step, shard by
shard: a rank's local shard against the same slice of the reference tensor, so nothing is
gathered and the reference is the only extra copy of the model a rank holds. The losses
shown for the parallel run are the mean of the ranks' losses.
"""

from __future__ import annotations

import math
import time
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

import torch

from distdiag.errors import ConfigError
from distdiag.probes import training as tr
from distdiag.probes.base import ConsolidationView
from distdiag.probes.numerics import microbatches
from distdiag.probes.numerics.batch_counts import cross_sample_modules, shard_counts
from distdiag.probes.numerics.localise import first_divergent_step, localise
from distdiag.probes.numerics.parity_evidence import accumulation_differs
from distdiag.probes.numerics.shared import STEP_SEED, ParallelRun, parallel_run
from distdiag.report.model import ProbeResult

if TYPE_CHECKING:
    from distdiag.runtime.context import RankContext

__all__ = ["LossParityProbe", "LossParityConfig", "compare_tensors", "partials_reduced", "reference_rms", "scale_fit"]

_TOP = 8
_HUGE = 1e300
"""Stands for an infinite error (a non-finite value, a missing tensor) and stays valid JSON."""
PARAM_TOLERANCE_FACTOR = 10.0
"""Parameters after a step are compared 10x more loosely than gradients (see run)."""


@dataclass
class LossParityConfig:
    """Options of the loss_parity probe, the `[probes.loss_parity]` table."""

    steps: int = 3
    """Training steps compared (make_batch(1) ... make_batch(steps))."""
    workload: str = "transformer"
    """Built-in workload used without a target: mlp or transformer."""
    tolerance_scale: float = 1.0
    """Multiplies the dtype-aware relative tolerances (fp32 1e-4, bf16 5e-2, fp16 1e-2)."""
    reference_limit_mib: float = 0.0
    """Largest model (MiB of parameters and buffers) the reference may build on a rank;
    0 = a third of the memory available per local rank (params, grads and optimizer state)."""

    def __post_init__(self) -> None:
        if isinstance(self.steps, bool) or not isinstance(self.steps, int) or not 1 <= self.steps <= 100:
            raise ConfigError(f"probes.loss_parity.steps must be an integer in [1, 100], got {self.steps!r}")
        tr.check_workload("probes.loss_parity.workload", self.workload)
        if not isinstance(self.tolerance_scale, (int, float)) or not 0 < self.tolerance_scale <= 1e6:
            raise ConfigError(f"probes.loss_parity.tolerance_scale must be in (0, 1e6], got {self.tolerance_scale!r}")
        if not isinstance(self.reference_limit_mib, (int, float)) or self.reference_limit_mib < 0:
            raise ConfigError(f"probes.loss_parity.reference_limit_mib must be >= 0, got {self.reference_limit_mib!r}")


def _local_slice(full: torch.Tensor, like: torch.Tensor) -> torch.Tensor:
    """The part of a full reference tensor that this rank's (possibly DTensor) tensor holds."""
    from torch.distributed.tensor import DTensor

    if not isinstance(like, DTensor):
        return full
    from torch.distributed.tensor._utils import compute_local_shape_and_global_offset

    shape, offset = compute_local_shape_and_global_offset(full.shape, like.device_mesh, like.placements)
    index = tuple(slice(o, o + s) for o, s in zip(offset, shape, strict=False))
    return full[index]




def compare_tensors(
    ref: dict[str, torch.Tensor], par: dict[str, torch.Tensor], scale: float, floor_rms: float = 0.0, absent: str = "absent on the parallel model",
    fit: bool = False,
) -> dict[str, Any]:
    """Compare each parallel tensor's local part with the same slice of the reference.

    Relative error is ||a - b|| / ||b|| over the slice (with the slice's share of the full
    norm as the floor, so an all-zero slice does not inflate it; `floor_rms` adds a floor of
    that RMS per element, for parameters that start at zero). A reference tensor that is zero
    to within the tolerance (RMS below tolerance x the RMS of all reference tensors: a bias
    before a BatchNorm, whose gradient the normalisation cancels, is exactly zero or rounding
    noise) has no scale of its own: its error is judged on the absolute scale of that overall
    RMS, so rounding noise on both sides is not a relative error of 1 or more, while a parallel
    value of the model's own size where the reference has none still is. Returns the maxima and
    the tensors over tolerance, in model order.
    """
    bad, max_abs, max_rel, missing = [], 0.0, 0.0, []
    overall: list[float] = []  # reference_rms(ref), computed once, when first needed
    sums = [0.0, 0.0, 0.0, 0.0]  # scale_fit's four terms summed over every compared slice
    for name, full in ref.items():
        if name not in par:
            missing.append(name)
            bad.append({"name": name, "abs": _HUGE, "rel": _HUGE, "tol": 0.0, "detail": absent})
            continue
        mine = par[name]
        # float32 arithmetic at least (no copy for float32 tensors: the comparison must not
        # cost more than the step); the errors sought are far above float32 rounding.
        work = torch.float64 if full.dtype == torch.float64 else torch.float32
        want = _local_slice(full.detach(), mine).to(work)
        # On the reference's device: the parallel model trains on the rank's GPU, the reference
        # where build_model put it (the CPU for the built-in workloads); `got - want` across
        # devices raises. The copy is one local shard.
        got = tr.local_tensor(mine.detach()).to(device=want.device, dtype=work)
        if got.shape != want.shape:
            bad.append({"name": name, "abs": _HUGE, "rel": _HUGE, "tol": 0.0,
                        "detail": f"local shape {list(got.shape)} vs reference slice {list(want.shape)}"})
            continue
        if want.numel() == 0:
            continue
        diff = got - want
        abs_err = float(diff.abs().max())
        want_norm = float(want.norm())
        tol = tr.rtol_for(full.dtype, scale)
        overall = overall or [reference_rms(ref)]
        denom = _denominator(want_norm, want.numel(), full, work, floor_rms, tol, overall[0])
        diff_norm = float(diff.norm())
        rel = diff_norm / denom if math.isfinite(abs_err) else _HUGE
        abs_err = abs_err if math.isfinite(abs_err) else _HUGE
        # Gradients only (the diagnosis reads their factors); within tolerance, ||got - want||
        # bounds what a factor leaves, so the extra pass is paid for the failing tensors only.
        terms = scale_fit(got, want, want_norm, diff_norm if rel <= tol else None) if fit else [0.0] * 4
        sums = [a + b for a, b in zip(sums, terms, strict=True)]
        max_abs, max_rel = max(max_abs, abs_err), max(max_rel, rel)
        if not rel <= tol:
            from torch.distributed.tensor import DTensor

            bad.append({"name": name, "abs": abs_err, "rel": rel, "tol": tol, "sharded": isinstance(mine, DTensor),
                        **(_factor(terms) if fit else {})})
    return {"max_abs": max_abs, "max_rel": max_rel, "bad": bad, "missing": missing, "sums": sums}


def _denominator(want_norm: float, numel: int, full: torch.Tensor, work: torch.dtype, floor_rms: float, tol: float,
                 overall: float) -> float:
    """What a slice's ||got - want|| is divided by: its own norm, floored by `floor_rms` per element, by
    the slice's share of the full tensor's norm, and, for a reference zero to within the tolerance,
    by the reference's overall RMS per element (the absolute scale)."""
    denom = max(want_norm, floor_rms * math.sqrt(numel), 1e-12)
    full_norm = want_norm
    if numel < full.numel():
        full_norm = float(full.detach().to(work).norm())
        denom = max(denom, full_norm * math.sqrt(numel / full.numel()))
    if full_norm <= tol * overall * math.sqrt(full.numel()):  # zero to within the tolerance
        denom = max(denom, overall * math.sqrt(numel))
    return denom


def reference_rms(ref: dict[str, torch.Tensor]) -> float:
    """The RMS per element over every reference tensor: the absolute scale an all-zero one is judged on."""
    total, count = 0.0, 0
    for t in ref.values():
        total += float(t.detach().float().norm()) ** 2
        count += t.numel()
    return math.sqrt(total / max(count, 1))


def scale_fit(got: torch.Tensor, want: torch.Tensor, want_norm: float | None = None, bound: float | None = None) -> list[float]:
    """[<got, want>, <want, want>, ||got - f want||^2, f^2 <want, want>] with f = <got, want> / <want, want>.

    What a scale factor between the parallel tensor and the reference is fitted from, in
    float32 passes (no float64 copy: the comparison must not cost more than the step). The
    residual is taken directly, not as <got, got> - f <got, want> (float32 cancellation would
    leave ~1e-3 where a pure factor leaves ~1e-7); summed over tensors, the four terms give a
    rank's factor and residual without cancellation (parity_evidence.rank_factor).
    `want_norm` saves a pass when the caller has it; `bound` (>= ||got - f want||, e.g.
    ||got - want||) stands for the residual when it is already small enough.
    """
    g, w = got.reshape(-1), want.reshape(-1)
    dot = float(torch.dot(g, w))
    ww = want_norm**2 if want_norm is not None else float(torch.dot(w, w))
    f = dot / ww if ww > 0 else 0.0
    left = bound**2 if bound is not None else float(torch.linalg.vector_norm(g - f * w)) ** 2
    return [dot, ww, left, f * dot]


def _factor(fit: list[float]) -> dict[str, float]:
    """One tensor's factor f (parallel ~ f x reference) and what is left: ||got - f want|| / ||f want||.

    A residual near 0 means the parallel tensor is the reference times a constant (a loss or
    a gradient scaled, clipping); the diagnosis reads both (probes/numerics/diagnose.py).
    """
    dot, ww, left, _ = fit
    if not all(math.isfinite(v) for v in fit) or ww <= 0:
        return {"factor": 0.0, "resid": _HUGE}
    f = dot / ww
    return {"factor": f, "resid": min(math.sqrt(left) / max(abs(f) * math.sqrt(ww), 1e-300), _HUGE)}


def partials_reduced(grads: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """The gradients with every Partial placement of a DTensor made Replicate (an all-reduce over
    that mesh dim; Shard dims stay local). A Partial(sum) gradient (a Replicate norm weight under
    SequenceParallel) is a per-rank part of the gradient, not the gradient: only its sum over the
    ranks is comparable with the reference. Every rank calls it on the same tensors in the same
    order (the optimizer's), so the collectives match."""
    from torch.distributed.tensor import DTensor, Replicate

    out = {}
    for name, g in grads.items():
        if isinstance(g, DTensor) and any(p.is_partial() for p in g.placements):
            g = g.redistribute(g.device_mesh, [Replicate() if p.is_partial() else p for p in g.placements])
        out[name] = g
    return out


def _sq_share(grads: dict[str, torch.Tensor], world: int) -> float:
    """This rank's share of the parallel grad norm squared (summed over ranks: the norm squared)."""
    from torch.distributed.tensor import DTensor, Replicate

    total = 0.0
    for g in grads.values():
        if isinstance(g, DTensor):
            replicas = 1
            for dim, p in enumerate(g.placements):
                if isinstance(p, Replicate):
                    replicas *= g.device_mesh.size(dim)
            total += float(g.to_local().float().norm()) ** 2 / replicas
        else:
            total += float(g.float().norm()) ** 2 / world
    return total


def _norm(grads: dict[str, torch.Tensor]) -> float:
    return math.sqrt(sum(float(g.detach().float().norm()) ** 2 for g in grads.values()))


def _accumulation_check(stepped: dict[str, torch.Tensor], plain: dict[str, torch.Tensor], scale: float) -> dict[str, Any]:
    """train_step's gradients against one loss_fn backward on the same global batch."""
    cmp = compare_tensors(plain, stepped, scale)
    dot = sum(float(torch.vdot(stepped[n].float().reshape(-1), plain[n].float().reshape(-1))) for n in plain if n in stepped)
    pp = sum(float(plain[n].float().norm()) ** 2 for n in plain)
    factor = dot / pp if pp > 0 else 1.0
    resid = math.sqrt(sum(float((stepped[n].float() - factor * plain[n].float()).norm()) ** 2 for n in plain if n in stepped))
    return {
        "equal": not cmp["bad"],
        "max_rel": cmp["max_rel"],
        "bad": cmp["bad"][:_TOP],
        "factor": factor,
        "scaled_resid": resid / max(math.sqrt(pp) * abs(factor), 1e-12),
        "plain_norm": math.sqrt(pp),
        "stepped_norm": _norm(stepped),
    }


_BUFFER_CAP = 1 << 22
"""Buffers (elements in all) that the accumulation check copies to see what train_step changes; above it, not told."""


def _buffer_values(model: torch.nn.Module) -> dict[str, torch.Tensor] | None:
    """A copy of each buffer of the reference model (None above _BUFFER_CAP elements)."""
    buffers = dict(model.named_buffers())
    if sum(b.numel() for b in buffers.values()) > _BUFFER_CAP:
        return None
    return {n: b.detach().clone() for n, b in buffers.items()}


def _restore_buffers(model: torch.nn.Module, values: dict[str, torch.Tensor] | None) -> None:
    """Put the reference's buffers back as they were: a forward that updates them (running statistics, a step
    counter) must run as often in the reference as in the parallel run."""
    if values is None:
        return
    with torch.no_grad():
        for n, b in model.named_buffers():
            if n in values:
                b.copy_(values[n])


def _changed_by_step(before: dict[str, torch.Tensor] | None, after_loss: dict[str, torch.Tensor] | None,
                     after_step: dict[str, torch.Tensor] | None) -> list[str]:
    """Buffers that one loss_fn backward left as they were and train_step (run from the same state) changed:
    state train_step advances itself (a step counter, a schedule), which the forward may read, so its gradients
    are not those of one loss_fn backward from the same state."""
    if before is None or after_loss is None or after_step is None:
        return []
    return sorted(n for n, b in before.items() if n in after_loss and n in after_step
                  and torch.equal(b, after_loss[n]) and not torch.equal(b, after_step[n]))[:_TOP]


@dataclass
class _Reference:
    """The 1-process reference: its model and optimizer, and the global batch of each step for it and for this rank."""

    model: torch.nn.Module
    opt: torch.optim.Optimizer
    shards: list[Any]
    par_shards: list[Any]


class LossParityProbe(tr.NumericsProbe):
    name = "loss_parity"
    private_apis = ("torch.distributed.tensor._utils:compute_local_shape_and_global_offset",)
    summary = "an N-rank setup whose loss, gradients or parameters differ from a 1-process reference on the same global batch"
    Config = LossParityConfig
    shared_fields = ("setup",)
    """Stored once for all ranks (issue 21): how the workload was set up: the same on every rank."""

    def run(self, ctx: RankContext) -> dict[str, Any]:
        opts: LossParityConfig = self.options(ctx)
        run = parallel_run(ctx, opts.workload)  # the parallel model, built once for the numerics probes
        hooks = run.hooks
        base = {"source": hooks.source, "defaults": hooks.defaults, "optimizer": hooks.optimizer_desc,
                "train_step": hooks.train_step is not None}
        if run.failed:
            return {**base, "setup_error": run.error}
        error, ref = self._build_reference(ctx, opts, run)
        if tr.agree(ctx, error is not None):
            return {**base, "setup_error": error}
        assert ref is not None
        run.rewind()  # the reference trains in lockstep from setup (a probe before may have trained on)
        started = time.perf_counter()
        steps, accum = [], None
        floor = _rms(ref.model)  # the initial weights' RMS: the scale parameter errors are judged at
        setup = _setup_state(ref.model, run.model, opts.tolerance_scale, floor)
        try:
            for i in range(opts.steps):
                step = i + 1
                record, checked = self._compare_step(ctx, opts, run, ref, step, floor)
                if checked is not None:
                    accum = checked
                steps.append(record)
        except tr.HookError as exc:
            # Raised the same way on every rank (the hooks are deterministic), so no rank waits.
            return {**base, "setup_error": f"step {step}: {exc}"}
        localised = None
        if (divergent := first_divergent_step(ctx, steps)) is not None:  # only when parity failed: no cost otherwise
            localised = localise(ctx, run, ref.shards, ref.par_shards, divergent, opts.tolerance_scale,
                                 lambda want, got: compare_tensors(want, got, opts.tolerance_scale))
        return {
            **base,
            "localised": localised,
            "steps": steps,
            "setup": setup,
            "accumulation": accum,
            "model_bytes": tr.model_bytes(ref.model),
            "time_s": round(time.perf_counter() - started, 4),
        }

    @staticmethod
    def _build_reference(ctx: RankContext, opts: LossParityConfig, run: ParallelRun) -> tuple[str | None, _Reference | None]:
        """The reference model, its optimizer and both runs' batches; or why they could not be built."""
        hooks = run.hooks
        try:
            size = tr.model_bytes(run.model)
            limit = _limit_bytes(opts, ctx)
            if size > limit:
                raise tr.HookError(
                    f"the model ({size / 2**20:.1f} MiB of parameters and buffers) does not fit the reference: "
                    f"the limit is {limit / 2**20:.1f} MiB (probes.loss_parity.reference_limit_mib, default a third of "
                    "the free memory per local rank); run the probe on a smaller configuration of the model"
                )
            model = hooks.model(ctx.seed)
            opt = hooks.optimizer(model)
            run.ensure_optimizer()
            batches = [hooks.batch(step) for step in range(1, opts.steps + 1)]
            ref_shards = [hooks.shard(b, 0, 1) for b in batches]
            par_shards = [hooks.shard(b, ctx.rank, ctx.world_size) for b in batches]
        except tr.HookError as exc:
            return str(exc), None
        except MemoryError as exc:
            ctx.caught(exc, "building the model")  # before agree: parallelize may have left peers in a collective
            return f"building the model ran out of memory on rank {ctx.rank}: {exc}", None
        return None, _Reference(model, opt, ref_shards, par_shards)

    def _compare_step(self, ctx: RankContext, opts: LossParityConfig, run: ParallelRun, ref: _Reference, step: int,
                      floor: float) -> tuple[dict[str, Any], dict[str, Any] | None]:
        """Step both runs once and compare them: the step's record, and the accumulation check on step 1."""
        ref_res, accum = self._reference_step(ctx, opts, run.hooks, ref, step)
        par = run.model
        par_res = run.step(ctx, step, ref.par_shards[step - 1])  # seeded as the reference step was
        par_res.grads = partials_reduced(par_res.grads)
        grads = compare_tensors(
            ref_res.grads, par_res.grads, opts.tolerance_scale,
            absent="no gradient reached the optimizer on the parallel model (left unreduced: "
            "set_requires_gradient_sync(False) or set_requires_all_reduce(False) still in force?)", fit=True,
        )
        # Parameters get 10x the gradient tolerance and the model's RMS as a floor: an
        # adaptive optimizer (Adam) turns rounding-level gradient differences of
        # near-zero entries into update-sized ones; a real bug shows in the gradients.
        params = compare_tensors(
            {tr.canonical_name(n): p for n, p in ref.model.named_parameters()},
            {tr.canonical_name(n): p for n, p in par.named_parameters()},
            opts.tolerance_scale * PARAM_TOLERANCE_FACTOR,
            floor_rms=floor,
        )
        # This step's gradients go with this frame, before the next step allocates new ones:
        # held across the step they would be one more copy of the model.
        return {
            "step": step,
            "loss": par_res.loss,
            "ref_loss": ref_res.loss,
            "ref_grad_norm": _norm(ref_res.grads),
            "grad_sq_share": _sq_share(par_res.grads, ctx.world_size),
            "grad": _trim(grads),
            "param": _trim(params),
            "order": [tr.canonical_name(n) for n, _ in par.named_parameters()] if step == 1 else None,
            "counts": shard_counts(ref.par_shards[step - 1]),
            "ref_counts": shard_counts(ref.shards[step - 1]),
            "cross_sample": cross_sample_modules(par) if step == 1 else None,
            "sharded": sum(1 for p in par.parameters() if hasattr(p, "to_local")),  # DTensor (FSDP-managed) ones
            "fsdp": _has_fsdp(par) if step == 1 else None,
            "reducer": _reducer(par) if step == 1 else None,
            "ddp_unreduced": _ddp_unreduced(par) if step == 1 else None,
            "trainable_diff": _trainable_diff(ref.model, par) if step == 1 else None,
            "dtype": str(next(iter(ref.model.parameters())).dtype).replace("torch.", ""),
        }, accum

    def _reference_step(self, ctx: RankContext, opts: LossParityConfig, hooks: tr.Hooks, ref: _Reference,
                        step: int) -> tuple[Any, dict[str, Any] | None]:
        """The reference's step (and, on step 1 with a train_step, its accumulation check)."""
        plain = None
        if hooks.train_step is not None and step == 1:
            before = _buffer_values(ref.model)
            plain = self._plain_grads(ctx, hooks, ref.model, ref.opt, ref.shards[step - 1])
            after_loss = _buffer_values(ref.model)
            _restore_buffers(ref.model, before)  # the check must not advance the reference past the parallel run
            start = {n: p.detach().clone() for n, p in ref.model.named_parameters()}
        ctx.seed(STEP_SEED + step)
        counter = microbatches.BackwardCounter(ref.model) if plain is not None else None
        try:
            ref_res = tr.run_step(hooks, ref.model, ref.opt, ref.shards[step - 1])
        finally:
            backwards = counter.close() if counter is not None else None
        if not ref_res.grads:
            raise tr.HookError(
                "no gradient reached the optimizer in the reference step "
                "(train_step must call optimizer.step() after backward)"
            )
        accum = _accumulation_check(ref_res.grads, plain, opts.tolerance_scale) if plain is not None else None
        if accum is not None:
            accum["state_changed"] = _changed_by_step(before, after_loss, _buffer_values(ref.model))
            accum["backwards"] = backwards
            if plain is not None and accumulation_differs(accum):
                accum["parts"] = microbatches.explain(ctx, hooks, ref.model, ref.shards[step - 1], start, ref_res.grads, plain)
        return ref_res, accum  # plain's gradients go with this frame, before the parallel step

    @staticmethod
    def _plain_grads(ctx: RankContext, hooks: tr.Hooks, ref: torch.nn.Module, opt: torch.optim.Optimizer, shard: Any) -> dict[str, torch.Tensor]:
        """One loss_fn backward on the global batch; the grads are moved out, not copied."""
        opt.zero_grad(set_to_none=True)
        ctx.seed(STEP_SEED + 1)
        loss = tr.call_loss(hooks, ref, shard)
        if not isinstance(loss, torch.Tensor) or not loss.requires_grad:
            raise tr.HookError("hook loss_fn must return a scalar tensor that requires grad")
        loss.backward()
        out = {}
        for n, p in ref.named_parameters():
            if p.grad is not None:
                out[tr.canonical_name(n)] = p.grad
                p.grad = None
        return out

    def consolidate(self, payloads: dict[int, dict[str, Any]], view: ConsolidationView) -> ProbeResult:
        from distdiag.probes.numerics.parity_report import consolidate_parity

        return consolidate_parity(self.name, payloads, view)


def _setup_state(ref: torch.nn.Module, par: torch.nn.Module, scale: float, floor: float) -> dict[str, Any]:
    """Before step 1: the parallel model against this rank's reference, and the reference's bits.

    Both are built from the same seed, so they must agree before any training; a difference
    here is setup (weights loaded or initialised on some ranks only, a rank-seeded init), not
    training. The bits let the consolidation see a build_model that differs across ranks.
    """
    cmp = compare_tensors(
        {tr.canonical_name(n): p for n, p in ref.named_parameters()},
        {tr.canonical_name(n): p for n, p in par.named_parameters()}, scale, floor_rms=floor,
    )
    bits = {tr.canonical_name(n): _bits_sum(t) for n, t in list(ref.named_parameters()) + list(ref.named_buffers())}
    return {"param": _trim(cmp), "ref_bits": bits}


_INT_OF_SIZE = {8: torch.int64, 4: torch.int32, 2: torch.int16, 1: torch.uint8}


def _bits_sum(t: torch.Tensor) -> str:
    """The tensor's bits summed as integers (exact and order-free, one pass): equal tensors agree.

    Cheaper than replicas.bit_checksum (no position weights): telling a rank-dependent
    build_model apart needs no more, since different weights give a different sum.
    """
    t = t.detach().reshape(-1)
    if t.dtype == torch.bool or t.is_complex():
        t = t.to(torch.uint8) if t.dtype == torch.bool else torch.view_as_real(t).reshape(-1)
    return f"{int(t.view(_INT_OF_SIZE[t.element_size()]).sum(dtype=torch.int64))}-{t.numel()}"


def _has_fsdp(model: torch.nn.Module) -> bool:
    """Whether any module is FSDP-managed (FSDP2's fully_shard or FSDP1's wrapper)."""
    from torch.distributed.fsdp import FSDPModule, FullyShardedDataParallel

    return any(isinstance(m, FSDPModule | FullyShardedDataParallel) for m in model.modules())


def _trainable_diff(ref: torch.nn.Module, par: torch.nn.Module) -> dict[str, list[str]]:
    """Parameters trainable in the reference but frozen on the parallel model ("frozen"), and the reverse
    ("thawed"): parallelize changed what trains (names canonical, at most 16 each)."""
    def trainable(m: torch.nn.Module) -> dict[str, bool]:
        return {tr.canonical_name(n): p.requires_grad for n, p in m.named_parameters()}

    a, b = trainable(ref), trainable(par)
    both = [n for n in a if n in b]
    return {"frozen": [n for n in both if a[n] and not b[n]][:16], "thawed": [n for n in both if b[n] and not a[n]][:16]}


def _ddp_unreduced(model: torch.nn.Module) -> dict[str, int] | None:
    """Trainable parameters a DistributedDataParallel wrapper does not reduce: DDP builds its reducer from the
    parameters that require grad when it is constructed, so one made trainable afterwards is never averaged.
    {"count", "bytes"} of the gap between the parameters that require grad now and those the reducer holds (its
    logging data); None without DDP, without a gap, or where that data cannot be read."""
    from torch.nn.parallel import DistributedDataParallel

    for m in model.modules():
        if not isinstance(m, DistributedDataParallel):
            continue
        try:
            data = m._get_ddp_logging_data()
            held, held_bytes = int(data["num_parameter_tensors"]), int(data["total_parameter_size_bytes"])
        except Exception:  # noqa: BLE001 - a private record of DDP's: without it nothing is told
            return None
        now = [p for n, p in m.module.named_parameters() if p.requires_grad and n not in m.parameters_to_ignore]
        gap = len(now) - held
        if gap > 0:
            return {"count": gap, "bytes": sum(p.numel() * p.element_size() for p in now) - held_bytes}
    return None


def _reducer(model: torch.nn.Module) -> str:
    """What reduces the parallel model's gradients: fsdp, ddp, dtensor (a tensor-parallel plan), hooks (gradient
    hooks on some parameter: a hand-made reduction) or none (a bare model: nothing reduces them)."""
    from torch.nn.parallel import DistributedDataParallel

    if _has_fsdp(model):
        return "fsdp"
    if any(isinstance(m, DistributedDataParallel) for m in model.modules()):
        return "ddp"
    params = list(model.parameters())
    if any(hasattr(p, "to_local") for p in params):
        return "dtensor"
    if any(getattr(p, "_post_accumulate_grad_hooks", None) or getattr(p, "_backward_hooks", None) for p in params):
        return "hooks"
    return "none"


def _rms(model: torch.nn.Module) -> float:
    total, count = 0.0, 0
    for p in model.parameters():
        total += float(p.detach().float().norm()) ** 2
        count += p.numel()
    return math.sqrt(total / max(count, 1))


def _trim(cmp: dict[str, Any]) -> dict[str, Any]:
    """Every failing name, but details only for the worst few (payloads stay small)."""
    worst = sorted(cmp["bad"], key=lambda b: -b["rel"])[:_TOP]
    return {**cmp, "bad": worst, "bad_names": [b["name"] for b in cmp["bad"]]}


def _limit_bytes(opts: LossParityConfig, ctx: RankContext) -> float:
    if opts.reference_limit_mib > 0:
        return opts.reference_limit_mib * 2**20
    import psutil

    local = max(1, getattr(ctx.info, "local_world_size", 1))
    return psutil.virtual_memory().available / local / 3
