"""Module by module: the first module of the parallel model whose own computation differs from the reference's.

Run by loss_parity only when its comparison failed, at the first step where some rank's
gradients or parameters left the reference (both models put back in the state before that
step). Every rank runs one forward of the parallel model on its own shard with a hook on
every module: each module records the inputs it got, its output and the RNG state it was
entered with. The reference's module of the same name is then run on those very inputs
(the RNG restored), so a difference is that module's own computation, not what reached it.
The first module to finish whose output differs is located, and the shape of its
difference read (localise_shape.py). While the parallel module's parameters are
materialised (inside its forward) the rank also reruns it with the suspected piece
replaced: without its forward hooks, with the reference's values of the attributes that
differ (eps, p, training ...); and the reference's module in the parameter dtype the rank
computed in. On every module (FSDP2's sharded ones too, which the rank does not rerun) the
reference's module is also rerun with one piece of the rank's put in: the rank's values of the
attributes that differ, a forward method patched on the rank's instance, an autocast region of
the rank's output dtype. A rerun that reproduces the reference (or the rank) is what confirms a
mechanism. Per-module state (training flag, scalar attributes, buffers, hooks, gradient
hooks, calls per forward) is compared with the reference's as well.

Nothing here issues a collective except the parallel model's own forward (the same on
every rank) and the replay of the steps before the divergent one; every hook is guarded,
so a failure on one rank never leaves the others waiting.
"""

from __future__ import annotations

import copy
import dataclasses
import inspect
import math
import types
from collections.abc import Callable
from dataclasses import dataclass, field
from functools import partial
from typing import TYPE_CHECKING, Any

import torch
from torch import nn

from distdiag.probes import training as tr
from distdiag.probes.numerics.localise_shape import difference_shape, rel_err
from distdiag.probes.numerics.shared import STEP_SEED, ParallelRun, State

if TYPE_CHECKING:
    from distdiag.runtime.context import RankContext

__all__ = ["CAP_ELEMENTS", "Capture", "compare_calls", "first_divergent_step", "localise", "module_state", "state_diffs"]

CAP_ELEMENTS = 1 << 22
"""A module call whose inputs and output hold more elements than this is not recorded (bounded memory)."""
_NOT_FOUND = 1 << 30
_SHOWN = 16


def first_divergent_step(ctx: RankContext, steps: list[dict[str, Any]]) -> int | None:
    """The first step at which some rank's gradients or parameters are over tolerance (one all_reduce, MIN)."""
    mine = next((s["step"] for s in steps if s["grad"]["bad"] or s["param"]["bad"]), _NOT_FOUND)
    flag = torch.tensor([mine], dtype=torch.int64, device=ctx.device)
    ctx.comm.all_reduce(flag, op=torch.distributed.ReduceOp.MIN)
    step = int(flag.item())
    return None if step == _NOT_FOUND else step


def _user_fn(fn: Any) -> bool:
    """A hook the user's code registered (not torch's own, as FSDP2's, nor distdiag's)."""
    fn = getattr(fn, "func", fn)
    where = getattr(fn, "__module__", None) or ""
    return not any(where == top or where.startswith(top + ".") for top in ("torch", "distdiag"))


def _wrapper(m: nn.Module) -> bool:
    """DDP / FSDP1 / checkpoint / compile wrappers: the same canonical name as the module they wrap."""
    from torch.distributed.fsdp import FullyShardedDataParallel
    from torch.nn.parallel import DistributedDataParallel

    return isinstance(m, DistributedDataParallel | FullyShardedDataParallel) or type(m).__name__ in (
        "CheckpointWrapper", "OffloadWrapper", "OptimizedModule")


def _digest(t: torch.Tensor) -> str:
    t = tr.local_tensor(t.detach())
    return f"{t.dtype}:{float(t.double().sum()):.9g}:{float(t.double().abs().sum()):.9g}" if t.numel() else f"{t.dtype}:empty"


def grad_hook_dicts(model: nn.Module) -> list[tuple[dict[Any, Any], str]]:
    """Every gradient-hook dict of the model's parameters with the parameter's canonical name: the parameters'
    own, and those of FSDP2's sharded parameters (which its reduce-scatter runs; the module may hold another object)."""
    from torch.distributed.fsdp import FSDPModule, fully_shard

    found: dict[int, tuple[dict[Any, Any], str]] = {}

    def add(p: Any, fqn: str) -> None:
        for attr in ("_backward_hooks", "_post_accumulate_grad_hooks"):
            hooks = getattr(p, attr, None)
            if hooks:
                found.setdefault(id(hooks), (hooks, tr.canonical_name(fqn)))

    for name, p in model.named_parameters():
        add(p, name)
    names = {id(m): n for n, m in model.named_modules()}
    for m in model.modules():
        if isinstance(m, FSDPModule):
            for group in getattr(fully_shard.state(m), "_fsdp_param_groups", []) or []:  # type: ignore[attr-defined]
                for fp in getattr(group, "fsdp_params", []):
                    info = getattr(fp, "_module_info", None)
                    owner = names.get(id(getattr(info, "module", None)))
                    if owner is not None and info is not None:
                        add(fp.sharded_param, f"{owner}.{info.param_name}" if owner else info.param_name)
    return list(found.values())


def module_state(model: nn.Module) -> dict[str, dict[str, Any]]:
    """Per module (canonical name): scalar attributes (training, eps, p ...), buffer digests, user hooks, gradient hooks."""
    out: dict[str, dict[str, Any]] = {}
    hooked = [(hooks, fqn) for hooks, fqn in grad_hook_dicts(model) if any(_user_fn(h) for h in hooks.values())]
    for name, m in model.named_modules():
        if _wrapper(m):
            continue
        attrs = {k: v for k, v in vars(m).items() if not k.startswith("_") and isinstance(v, bool | int | float | str)}
        hooks = sum(1 for d in (m._forward_hooks, m._forward_pre_hooks, m._backward_hooks) for h in d.values() if _user_fn(h))
        grad_hooks = sorted({fqn for hooks, fqn in hooked if fqn.rsplit(".", 1)[0] == tr.canonical_name(name)
                             or ("." not in fqn and not tr.canonical_name(name))})
        buffers = {b: _digest(t) for b, t in m.named_buffers(recurse=False)}
        out[tr.canonical_name(name)] = {"attrs": attrs, "hooks": hooks, "grad_hooks": grad_hooks, "buffers": buffers}
    return out


def state_diffs(ref: dict[str, dict[str, Any]], par: dict[str, dict[str, Any]]) -> dict[str, dict[str, list[Any]]]:
    """What differs per module between the reference's state and the rank's: {module: {what: [reference, rank]}}."""
    out: dict[str, dict[str, list[Any]]] = {}
    for name, mine in par.items():
        theirs = ref.get(name)
        if theirs is None:
            continue
        diff = {k: [theirs["attrs"][k], v] for k, v in mine["attrs"].items() if k in theirs["attrs"] and theirs["attrs"][k] != v}
        diff.update({f"buffer {b}": [theirs["buffers"][b], v] for b, v in mine["buffers"].items()
                     if b in theirs["buffers"] and theirs["buffers"][b] != v})
        if mine["hooks"] != theirs["hooks"]:
            diff["forward/backward hooks"] = [theirs["hooks"], mine["hooks"]]
        if mine["grad_hooks"] != theirs["grad_hooks"]:
            diff["gradient hooks"] = [theirs["grad_hooks"], mine["grad_hooks"]]
        if diff:
            out[name] = diff
    return out


def _first_tensor(value: Any) -> torch.Tensor | None:
    if isinstance(value, torch.Tensor):
        return value
    items = value.values() if isinstance(value, dict) else value if isinstance(value, tuple | list) else ()
    return next((t for t in (_first_tensor(v) for v in items) if t is not None), None)


def _plain(value: Any) -> bool:
    """Only plain tensors (no DTensor activations) in a call's inputs and output."""
    from torch.distributed.tensor import DTensor

    if isinstance(value, torch.Tensor):
        return not isinstance(value, DTensor)
    items = value.values() if isinstance(value, dict) else value if isinstance(value, tuple | list) else ()
    return all(_plain(v) for v in items)


def _numel(value: Any) -> int:
    if isinstance(value, torch.Tensor):
        return value.numel()
    items = value.values() if isinstance(value, dict) else value if isinstance(value, tuple | list) else ()
    return sum(_numel(v) for v in items)


def _detached(value: Any) -> Any:
    if isinstance(value, torch.Tensor):
        return value.detach().clone()
    if isinstance(value, dict):
        return {k: _detached(v) for k, v in value.items()}
    if isinstance(value, tuple | list):
        return type(value)(_detached(v) for v in value) if not hasattr(value, "_fields") else value
    return value


def _cast(value: Any, dtype: torch.dtype | None) -> Any:
    """Floating tensors as `dtype` (the module's parameter dtype): the same values, in the dtype it computes in."""
    if dtype is None:
        return value
    if isinstance(value, torch.Tensor):
        return value.to(dtype) if value.is_floating_point() and value.dtype != dtype else value
    if isinstance(value, dict):
        return {k: _cast(v, dtype) for k, v in value.items()}
    if isinstance(value, tuple | list) and not hasattr(value, "_fields"):
        return type(value)(_cast(v, dtype) for v in value)
    return value


def _rng() -> tuple[torch.Tensor, torch.Tensor | None]:
    return torch.get_rng_state(), torch.cuda.get_rng_state() if torch.cuda.is_available() and torch.cuda.is_initialized() else None


def _param_dtype(m: nn.Module) -> torch.dtype | None:
    p = next(m.parameters(recurse=False), None)
    p = next(m.parameters(), None) if p is None else p
    return p.dtype if p is not None else None


def buffer_snapshot(module: nn.Module) -> list[tuple[torch.Tensor, torch.Tensor]] | None:
    """Each buffer of the module (and its children) with a copy of its value now; None when they hold more than
    CAP_ELEMENTS (a forward that updates them cannot then be rerun from the same state)."""
    buffers = list(module.buffers())
    if sum(b.numel() for b in buffers) > CAP_ELEMENTS:
        return None
    return [(b, tr.local_tensor(b.detach()).clone()) for b in buffers]


def _put(buffers: list[tuple[torch.Tensor, torch.Tensor]]) -> None:
    with torch.no_grad():
        for b, value in buffers:
            tr.local_tensor(b).copy_(value)


def _run_with(module: nn.Module, call: Any, args: Any, kwargs: Any, rng: tuple[torch.Tensor, torch.Tensor | None],
              attrs: dict[str, Any] | None = None, buffers: list[tuple[torch.Tensor, torch.Tensor]] | None = None,
              ) -> torch.Tensor | None:
    """`call(*args, **kwargs)` (the module's __call__ or its bare forward) from the RNG state `rng` and the buffer
    values `buffers` (a forward may update its buffers: running statistics), with `attrs` set on the module for the
    call; attributes and buffers are put back after. The first tensor of its output, or None when it raised."""
    devices = [torch.cuda.current_device()] if rng[1] is not None else []
    saved = {k: getattr(module, k) for k in (attrs or {})}
    now = [(b, tr.local_tensor(b.detach()).clone()) for b, _ in buffers or []]
    try:
        with torch.random.fork_rng(devices=devices), torch.no_grad():
            torch.set_rng_state(rng[0])
            if rng[1] is not None:
                torch.cuda.set_rng_state(rng[1])
            _put(buffers or [])
            for k, v in (attrs or {}).items():
                setattr(module, k, v)
            out = _first_tensor(call(*args, **kwargs))
            return None if out is None else out.detach().clone()
    except Exception:  # noqa: BLE001 - an experiment that cannot run decides nothing
        return None
    finally:
        _put(now)
        for k, v in saved.items():
            setattr(module, k, v)


@dataclass
class Call:
    """One module's first call in the parallel forward: what it got and gave, and the reruns made inside it."""

    name: str
    args: Any
    kwargs: Any
    out: torch.Tensor
    rng: tuple[torch.Tensor, torch.Tensor | None]
    dtype: torch.dtype | None
    """The dtype of its parameters while it computed (FSDP2's param_dtype), None without parameters."""
    raw: torch.Tensor | None = None
    """Its bare forward (no hooks) on the same inputs and RNG."""
    trial: torch.Tensor | None = None
    """Its bare forward with the reference's values of the attributes that differ."""
    trial_attrs: dict[str, Any] = field(default_factory=dict)
    forward: Any = None
    """The function of a forward method set on its instance (a patched forward), None when it runs its class's."""


def forward_fn(m: nn.Module) -> Any:
    """The function a module's forward runs: one set on the instance (a patched forward), else its class's (FSDP2's
    class for a sharded module inherits the module's own)."""
    fn = vars(m).get("forward") or type(m).forward
    return getattr(fn, "__func__", fn)


def _patched_forward(m: nn.Module) -> Any:
    """The function of a forward method bound to `m` and set on the instance; None for any other forward (its
    class's, or a plain function or closure, which may reach the parallel model itself and is never rerun), and
    None for one that may communicate (see `_may_communicate`): the rerun runs on one rank, where a collective
    would wait for peers that never come."""
    fn = vars(m).get("forward")
    if not (isinstance(fn, types.MethodType) and fn.__self__ is m and inspect.isfunction(fn.__func__)):
        return None
    return None if _may_communicate(fn.__func__) else fn.__func__


_COMMUNICATING = frozenset({
    "dist", "distributed", "funcol", "_functional_collectives", "all_reduce", "all_gather", "all_gather_into_tensor",
    "_all_gather_base", "reduce_scatter", "reduce_scatter_tensor", "_reduce_scatter_base", "broadcast", "reduce",
    "gather", "scatter", "all_to_all", "all_to_all_single", "barrier", "monitored_barrier", "send", "recv", "isend",
    "irecv", "batch_isend_irecv", "all_gather_object", "broadcast_object_list", "gather_object", "scatter_object_list",
    "full_tensor", "redistribute", "wait", "wait_tensor", "unshard", "reshard",
})


def _may_communicate(fn: Any) -> bool:
    """Whether a function may reach a collective: a name it (or a function nested in it) uses is one of
    torch.distributed's, or its closure holds a module (the parallel model, whose sharded parameters gather). A
    guess from the code, erring towards True: what it rules out is only a rerun that might confirm a mechanism."""
    if any(isinstance(c.cell_contents, nn.Module) for c in (getattr(fn, "__closure__", None) or ()) if _filled(c)):
        return True
    stack = [fn.__code__]
    while stack:
        code = stack.pop()
        if _COMMUNICATING & set(code.co_names):
            return True
        stack.extend(c for c in code.co_consts if isinstance(c, types.CodeType))
    return False


def _filled(cell: Any) -> bool:
    try:
        cell.cell_contents  # noqa: B018 - an empty cell raises
    except ValueError:
        return False
    return True


class Capture:
    """Forward hooks on every module of a model: call counts per name, and (record=True) each module's first call."""

    def __init__(self, model: nn.Module, record: bool, trials: dict[str, dict[str, Any]] | None = None) -> None:
        self.model, self.record, self.trials = model, record, trials or {}
        self.calls: list[Call] = []
        self.counts: dict[str, int] = {}
        self.errors: list[str] = []
        self._seen: set[int] = set()
        self._rerunning = False
        """Set while a module is rerun inside its hook: its children's calls then are not the forward's."""
        self._entry: dict[int, list[tuple[Any, Any]]] = {}
        """Per module, a stack of (RNG state, buffer snapshot) taken as it was entered."""
        self._handles: list[Any] = []

    def __enter__(self) -> Capture:
        for name, m in self.model.named_modules():
            if _wrapper(m):
                continue
            cname = tr.canonical_name(name)
            self._handles.append(m.register_forward_pre_hook(partial(self._pre, cname)))
            self._handles.append(m.register_forward_hook(partial(self._post, cname), with_kwargs=True))
        return self

    def __exit__(self, *exc: Any) -> None:
        for h in self._handles:
            h.remove()

    def _pre(self, name: str, module: nn.Module, args: Any) -> None:
        if self._rerunning:
            return
        self.counts[name] = self.counts.get(name, 0) + 1
        if self.record:
            self._entry.setdefault(id(module), []).append((_rng(), buffer_snapshot(module)))

    def _post(self, name: str, module: nn.Module, args: Any, kwargs: Any, out: Any) -> None:
        if not self.record or self._rerunning:
            return
        rng, buffers = self._entry[id(module)].pop()
        if id(module) in self._seen:
            return
        self._seen.add(id(module))
        self._rerunning = True
        try:
            self._keep(name, module, args, kwargs, out, rng, buffers)
        except Exception as exc:  # noqa: BLE001 - never raise inside the parallel forward (peers wait in collectives)
            self.errors.append(f"{name}: {type(exc).__name__}: {exc}")
        finally:
            self._rerunning = False

    def _keep(self, name: str, module: nn.Module, args: Any, kwargs: Any, out: Any,
              rng: tuple[torch.Tensor, torch.Tensor | None], buffers: list[tuple[torch.Tensor, torch.Tensor]] | None) -> None:
        first = _first_tensor(out)
        if first is None or not _plain((args, kwargs, out)) or _numel((args, kwargs)) + first.numel() > CAP_ELEMENTS:
            return
        call = Call(name, _detached(args), _detached(kwargs), first.detach().clone(), rng, _param_dtype(module),
                    forward=_patched_forward(module))
        from torch.distributed.tensor import DTensor

        materialised = not any(isinstance(p, DTensor) for p in module.parameters())
        if materialised and buffers is not None and not isinstance(module, torch.distributed.fsdp.FSDPModule):
            call.raw = _run_with(module, module.forward, args, kwargs, rng, buffers=buffers)
            if name in self.trials:
                call.trial_attrs = self.trials[name]
                call.trial = _run_with(module, module.forward, args, kwargs, rng, self.trials[name], buffers)
        self.calls.append(call)


def compare_calls(calls: list[Call], ref: nn.Module, world: int, scale: float,
                  rank_attrs: dict[str, dict[str, Any]] | None = None) -> list[dict[str, Any]]:
    """Each recorded call against the reference's module of the same name on the same inputs; the ones that differ,
    in the order they finished, with the shape of the difference and what the reruns showed. `rank_attrs`: per
    module, the rank's values of the attributes that differ from the reference's (rerun in the reference)."""
    modules = {tr.canonical_name(n): m for n, m in ref.named_modules()}
    state = buffer_snapshot(ref)  # the reference's buffers before the step: every module is rerun from them
    out = []
    for call in calls:
        mod = modules.get(call.name)
        found = _compare_one(call, mod, state, world, scale, (rank_attrs or {}).get(call.name, {})) if mod is not None else None
        if found is not None:
            out.append(found)
        if len(out) >= _SHOWN:
            break
    return out


def _compare_one(call: Call, mod: nn.Module, state: list[tuple[torch.Tensor, torch.Tensor]] | None, world: int,
                 scale: float, attrs: dict[str, Any]) -> dict[str, Any] | None:
    """One call against the reference's module: its record when it differs, else None (also when the comparison
    itself fails on an unusual output: the localiser never stops the probe, whose peers go on to a collective)."""
    try:
        dtype = _param_dtype(mod)
        want = _run_with(mod, mod, _cast(call.args, dtype), _cast(call.kwargs, dtype), call.rng, buffers=state)
        if want is None or want.shape != call.out.shape:
            return None
        tol = tr.rtol_for(want.dtype, scale)
        rel = rel_err(call.out, want)
        if rel <= tol:
            return None
        return {"name": call.name, "rel": rel, "tol": tol, "shape": difference_shape(call.out, want, world, tol),
                **_reruns(call, mod, want), **_reference_reruns(call, mod, want, state, attrs)}
    except Exception:  # noqa: BLE001
        return None


def _reruns(call: Call, mod: nn.Module, want: torch.Tensor) -> dict[str, Any]:
    """What each rerun left of the difference: without hooks, with the reference's attributes, the reference's
    module computing in the rank's parameter dtype (a rerun reproducing its target within tolerance confirms)."""
    out: dict[str, Any] = {"dtype": str(call.dtype).replace("torch.", "") if call.dtype else None,
                           "ref_dtype": str(_param_dtype(mod)).replace("torch.", "") if _param_dtype(mod) else None}
    if call.raw is not None and call.raw.shape == want.shape:
        out["without_hooks"] = rel_err(call.raw, want)
        out["raw_vs_out"] = rel_err(call.raw, call.out)  # with no hook of its own: 0 when the rerun is faithful
    if call.trial is not None and call.trial.shape == want.shape:
        out["with_ref_attrs"] = {"attrs": {k: _jsonable(v) for k, v in call.trial_attrs.items()}, "rel": rel_err(call.trial, want)}
    if call.dtype is not None and call.dtype != _param_dtype(mod):
        low = copy.deepcopy(mod).to(call.dtype)
        mine = _run_with(low, low, _cast(call.args, call.dtype), _cast(call.kwargs, call.dtype), call.rng)
        if mine is not None and mine.shape == call.out.shape:
            out["ref_in_rank_dtype"] = rel_err(call.out, mine.to(call.out.dtype))
    return out


def _reference_reruns(call: Call, mod: nn.Module, want: torch.Tensor, state: list[tuple[torch.Tensor, torch.Tensor]] | None,
                      attrs: dict[str, Any]) -> dict[str, Any]:
    """The reference's module rerun on the same inputs with one piece of the rank's put in (every rank, any module:
    FSDP's sharded modules too, which are not rerun on the rank): the rank's values of the attributes that differ;
    the rank's forward, where a method patched on its instance is another function; an autocast region of the rank's output dtype, where
    that is lower and the parameters' dtype the same. Each: how far from the rank's output (within tolerance, or
    far closer than the reference was, reproduces it)."""
    out: dict[str, Any] = {}
    dtype = _param_dtype(mod)
    args, kwargs = _cast(call.args, dtype), _cast(call.kwargs, dtype)

    def gap(mine: torch.Tensor | None) -> float | None:
        return rel_err(call.out, mine.to(call.out.dtype)) if mine is not None and mine.shape == call.out.shape else None

    if attrs and (rel := gap(_run_with(mod, mod, args, kwargs, call.rng, attrs, state))) is not None:
        out["ref_with_rank_attrs"] = {"attrs": {k: _jsonable(v) for k, v in attrs.items()}, "rel": rel}
    theirs = forward_fn(mod)
    if call.forward is not None and call.forward is not theirs:
        if (rel := gap(_with_forward(mod, call.forward, lambda: _run_with(mod, mod, args, kwargs, call.rng, buffers=state)))) is not None:
            out["ref_with_rank_forward"] = {"forward": _qualname(call.forward), "reference": _qualname(theirs), "rel": rel}
    low = call.out.dtype
    if low != want.dtype and low.is_floating_point and call.dtype == dtype and low.itemsize < want.dtype.itemsize:
        try:
            with torch.autocast(call.out.device.type, dtype=low):
                mine = _run_with(mod, mod, args, kwargs, call.rng, buffers=state)
        except Exception:  # noqa: BLE001 - an autocast this device does not have decides nothing
            mine = None
        if (rel := gap(mine)) is not None:
            out["ref_under_autocast"] = {"dtype": str(low).replace("torch.", ""), "rel": rel}
    return out


def _with_forward(mod: nn.Module, fn: Any, run: Callable[[], torch.Tensor | None]) -> torch.Tensor | None:
    """`run()` with `fn` bound as `mod`'s forward; the module's own forward (on the instance or its class's) put back."""
    own = vars(mod).get("forward")
    mod.forward = types.MethodType(fn, mod)  # type: ignore[method-assign]
    try:
        return run()
    finally:
        if own is None:
            del mod.forward
        else:
            mod.forward = own  # type: ignore[method-assign]


def _qualname(fn: Any) -> str:
    """A function as a user finds it: its qualified name and where it is defined (file name and line)."""
    code = getattr(fn, "__code__", None)
    where = f" ({code.co_filename.rsplit('/', 1)[-1]}:{code.co_firstlineno})" if code is not None else ""
    return f"{getattr(fn, '__qualname__', repr(fn))}{where}"


def _jsonable(v: Any) -> Any:
    return v if isinstance(v, bool | int | str) or (isinstance(v, float) and math.isfinite(v)) else repr(v)


def localise(ctx: RankContext, run: ParallelRun, ref_shards: list[Any], par_shards: list[Any], step: int,
             scale: float, compare: Callable[[dict[str, torch.Tensor], dict[str, torch.Tensor]], dict[str, Any]]) -> dict[str, Any]:
    """The module-by-module record of this rank at `step` (both models replayed to the state before it). The
    parallel model, its optimizer and RNG are put back where the trajectory left them."""
    par, opt = run.model, run.optimizer
    assert par is not None and opt is not None and run.initial is not None
    saved = State(par, opt)
    try:
        run.initial.restore(opt)
        ref = run.hooks.model(ctx.seed)
        ref_opt = run.hooks.optimizer(ref)
        for s in range(1, step):
            ctx.seed(STEP_SEED + s)
            tr.run_step(run.hooks, par, opt, par_shards[s - 1])
            ctx.seed(STEP_SEED + s)
            tr.run_step(run.hooks, ref, ref_opt, ref_shards[s - 1])
        opt.zero_grad(set_to_none=True)
        record = _at_step(ctx, run.hooks, ref, par, par_shards[step - 1], step, scale)
        shards = (ref_shards[step - 1], par_shards[step - 1])
        if tr.agree(ctx, bool(record["grad_hooks"])):  # every rank steps again, hooks or not (collectives)
            record["without_grad_hooks"] = _rerun_step(_without_grad_hooks, ctx, run, ref, ref_opt, shards, step, compare)
        if run.hooks.train_step is not None:  # the same hooks on every rank: every rank reruns
            record["without_train_step"] = _rerun_step(_without_train_step, ctx, run, ref, ref_opt, shards, step, compare)
        return record
    except tr.HookError as exc:  # the same on every rank: the hooks already ran these steps
        return {"step": step, "error": str(exc)}
    finally:
        saved.restore(opt)
        opt.zero_grad(set_to_none=True)


def _at_step(ctx: RankContext, hooks: tr.Hooks, ref: nn.Module, par: nn.Module, shard: Any, step: int,
             scale: float) -> dict[str, Any]:
    """One captured forward of each model on this rank's shard, the per-module comparison and the state diffs."""
    _reshard(par)
    diffs = state_diffs(module_state(ref), module_state(par))
    trials = {name: {k: v[0] for k, v in d.items() if k in vars(_named(ref, name) or nn.Module())} for name, d in diffs.items()}
    trials = {n: t for n, t in trials.items() if t}
    mine = {name: {k: v[1] for k, v in d.items() if k in vars(_named(ref, name) or nn.Module())} for name, d in diffs.items()}
    before = buffer_snapshot(par)
    ctx.seed(STEP_SEED + step)
    try:
        with torch.no_grad(), Capture(par, record=True, trials=trials) as cap:
            par_loss = _loss(hooks, par, shard)
    finally:
        _reshard(par)
        if before is not None:
            _put(before)  # a forward that updates buffers (running statistics) leaves them as before the step
    differing = compare_calls(cap.calls, ref, ctx.world_size, scale, {n: t for n, t in mine.items() if t})
    state = buffer_snapshot(ref)
    ctx.seed(STEP_SEED + step)
    with torch.no_grad(), Capture(ref, record=False) as ref_cap:
        ref_loss = _loss(hooks, ref, shard)
    if state is not None:
        _put(state)  # the reference's buffers as before the step, for the reruns after
    calls = {n: [c, ref_cap.counts.get(n, 0)] for n, c in cap.counts.items() if c != ref_cap.counts.get(n, 0)}
    first = differing[0] if differing else None
    if first is not None:
        # It finished first of those that differ: every recorded module inside it computed the reference's output.
        first["children_exact"] = sum(1 for c in cap.calls if _inside(c.name, first["name"]))
        try:
            first["extra_calls"] = _repeat_trial(ref, first["name"], calls, cap.calls, ctx.world_size, scale)
        except Exception:  # noqa: BLE001 - an experiment that cannot run decides nothing
            first["extra_calls"] = None
    return {"step": step, "loss": [par_loss, ref_loss], "compared": len(cap.calls), "differing": differing[:_SHOWN],
            "first": first, "calls": dict(list(calls.items())[:_SHOWN]), "state": _shown(diffs),
            "grad_hooks": sorted({g for s in module_state(par).values() for g in s["grad_hooks"]})[:_SHOWN],
            "errors": cap.errors[:4]}


def _without_grad_hooks(ctx: RankContext, run: ParallelRun, ref: nn.Module, ref_opt: torch.optim.Optimizer,
                        shards: tuple[Any, Any], step: int, compare: Compare) -> dict[str, Any]:
    """The rerun that decides a gradient hook: step `step` again with the user's gradient hooks taken off the
    parallel model's parameters; which hooked gradients still differ from the reference's."""
    par, opt = run.model, run.optimizer
    assert opt is not None
    removed = []
    for hooks, fqn in grad_hook_dicts(par):
        for key, fn in list(hooks.items()):
            if _user_fn(fn):
                removed.append((hooks, key, fn, fqn))
                del hooks[key]
    try:
        ctx.seed(STEP_SEED + step)
        want = tr.run_step(run.hooks, ref, ref_opt, shards[0]).grads
        ctx.seed(STEP_SEED + step)
        got = tr.run_step(run.hooks, par, opt, shards[1]).grads
        hooked = sorted({r[3] for r in removed})
        cmp = compare({n: want[n] for n in hooked if n in want}, {n: got[n] for n in hooked if n in got})
        return {"hooked": hooked, "still_bad": [b["name"] for b in cmp["bad"]], "max_rel": cmp["max_rel"]}
    finally:
        for hooks, key, fn, _ in removed:
            hooks[key] = fn


Compare = Callable[[dict[str, torch.Tensor], dict[str, torch.Tensor]], dict[str, Any]]


def _rerun_step(rerun: Callable[..., dict[str, Any]], ctx: RankContext, run: ParallelRun, ref: nn.Module,
                ref_opt: torch.optim.Optimizer, shards: tuple[Any, Any], step: int, compare: Compare) -> dict[str, Any]:
    """One rerun of step `step` on both models, which are put back in the state before it afterwards."""
    assert run.optimizer is not None
    par_state, ref_state = State(run.model, run.optimizer), State(ref, ref_opt)
    try:
        return rerun(ctx, run, ref, ref_opt, shards, step, compare)
    finally:
        par_state.restore(run.optimizer)
        ref_state.restore(ref_opt)
        run.optimizer.zero_grad(set_to_none=True)
        ref_opt.zero_grad(set_to_none=True)


def _without_train_step(ctx: RankContext, run: ParallelRun, ref: nn.Module, ref_opt: torch.optim.Optimizer,
                        shards: tuple[Any, Any], step: int, compare: Compare) -> dict[str, Any]:
    """The rerun that decides train_step: the step again on both models as one loss_fn backward and
    optimizer.step; which gradients still differ from the reference's."""
    plain = dataclasses.replace(run.hooks, train_step=None)
    ctx.seed(STEP_SEED + step)
    want = tr.run_step(plain, ref, ref_opt, shards[0]).grads
    ctx.seed(STEP_SEED + step)
    got = tr.run_step(plain, run.model, run.optimizer, shards[1]).grads  # type: ignore[arg-type]
    cmp = compare(want, got)
    return {"still_bad": [b["name"] for b in cmp["bad"]][:_SHOWN], "bad_count": len(cmp["bad"]), "max_rel": cmp["max_rel"]}


def _reshard(model: nn.Module) -> None:
    """FSDP2 keeps the root's parameters unsharded after a forward without backward (the root does not reshard after
    forward): shard them again, so that the module holds the sharded parameters the optimizer steps."""
    from torch.distributed.fsdp import FSDPModule

    for m in model.modules():
        if isinstance(m, FSDPModule):
            m.reshard()


def _shown(diffs: dict[str, dict[str, list[Any]]]) -> dict[str, dict[str, list[Any]]]:
    return {n: {k: [_jsonable(a) if not isinstance(a, list) else a, _jsonable(b) if not isinstance(b, list) else b]
                for k, (a, b) in d.items()} for n, d in list(diffs.items())[:_SHOWN]}


def _inside(name: str, parent: str) -> bool:
    return name.startswith(parent + ".") if parent else bool(name)


def _named(model: nn.Module, name: str) -> nn.Module | None:
    return {tr.canonical_name(n): m for n, m in model.named_modules()}.get(name)


def _loss(hooks: tr.Hooks, model: nn.Module, shard: Any) -> float | None:
    out = tr.call_loss(hooks, model, shard)
    return float(out.detach().float()) if isinstance(out, torch.Tensor) and out.numel() == 1 else None


def _repeat_trial(ref: nn.Module, parent: str, calls: dict[str, list[int]], recorded: list[Call], world: int,
                  scale: float) -> dict[str, Any] | None:
    """A module inside `parent` called more often per forward than in the reference: rerun the reference's parent
    with that module applied as many times in a row, on the parent's inputs; whether it reproduces the rank."""
    inside = [n for n in calls if _inside(n, parent) and calls[n][0] > calls[n][1] > 0]
    call = next((c for c in recorded if c.name == parent), None)
    pmod = _named(ref, parent)
    child = _named(ref, inside[0]) if inside else None
    if call is None or pmod is None or child is None:
        return None
    name = inside[0]
    times = calls[name][0] // calls[name][1]
    original = child.forward

    def repeated(*args: Any, **kwargs: Any) -> Any:
        out = original(*args, **kwargs)
        for _ in range(times - 1):
            out = original(out)
        return out

    own = vars(child).get("forward")  # a forward the user's code set on the instance, put back after
    child.forward = repeated  # type: ignore[method-assign]
    try:
        mine = _run_with(pmod, pmod, _cast(call.args, _param_dtype(pmod)), _cast(call.kwargs, _param_dtype(pmod)), call.rng,
                         buffers=buffer_snapshot(pmod))
    finally:
        if own is None:
            del child.forward
        else:
            child.forward = own  # type: ignore[method-assign]
    rel = rel_err(call.out, mine) if mine is not None and mine.shape == call.out.shape else None
    return {"module": name, "calls": calls[name], "rel": rel}
