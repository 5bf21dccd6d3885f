"""Naming the module whose forward or backward produced the first non-finite value.

Hooks are armed only while the monitor is looking (after it saw a non-finite loss or
gradient, or always with trace="always"): each armed module checks its inputs and outputs
with `isfinite` (a device sync per tensor), which is far too slow to leave on.

Forward: the first module (in completion order, so the innermost) whose output is
non-finite while its inputs were finite produced it. Backward: tensor hooks on each module's
inputs and outputs see the gradients flowing through it; the first module whose input (or
parameter) gradient is non-finite while the gradient arriving at its output was finite
produced it. A gradient already non-finite at the last module's output came from the loss
computation outside any module. No collective is issued here.

NaNScan looks inside the forward instead of at module boundaries: a TorchDispatchMode sees
every operation, so a NaN that a module makes and replaces (nan_to_num) before its output is
found too; it is cheap enough (one device flag, no sync) to run on sampled steps by default.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass
from functools import partial
from typing import Any

import torch
from torch.utils._python_dispatch import TorchDispatchMode

__all__ = ["NaNScan", "NonFiniteTracer", "TraceResult", "PHASES"]

log = logging.getLogger("distdiag.monitor")

PHASES = {1: "forward", 2: "backward", 3: "parameters", 4: "input", 5: "loss", 6: "inside"}
"""Where the first non-finite value was seen: a module's forward or backward, a module's
parameters (already non-finite), the data entering the model, the loss computation, an
operation inside a module's forward whose NaN was replaced before the module's output (NaNScan)."""


@dataclass
class TraceResult:
    module: str
    module_index: int
    phase: int
    step: int
    detail: str = ""


def _tensors(obj: Any) -> list[torch.Tensor]:
    if isinstance(obj, torch.Tensor):
        return [obj]
    if isinstance(obj, list | tuple):
        return [t for item in obj for t in _tensors(item)]
    if isinstance(obj, dict):
        return [t for item in obj.values() for t in _tensors(item)]
    return []


def _local(t: torch.Tensor) -> torch.Tensor:
    # a DTensor's isfinite().all() would reduce across ranks (a collective): look at our shard
    to_local = getattr(t, "to_local", None)
    return to_local() if callable(to_local) else t


def _finite(t: torch.Tensor) -> bool:
    t = _local(t)
    if not (t.is_floating_point() or t.is_complex()) or t.numel() == 0:
        return True
    return bool(torch.isfinite(t).all())


def _count_bad(t: torch.Tensor) -> str:
    t = _local(t).detach()
    bad = int((~torch.isfinite(t)).sum())
    kinds = "NaN" if bool(torch.isnan(t).any()) else "Inf"
    return f"{bad} of {t.numel()} values {kinds}, shape {tuple(t.shape)}"


class NonFiniteTracer:
    def __init__(self, model: torch.nn.Module) -> None:
        self.modules: list[tuple[str, torch.nn.Module]] = []
        for name, module in model.named_modules():
            self.modules.append((name or type(module).__name__, module))
        self.index = {name: i for i, (name, _) in enumerate(self.modules)}
        self.scan = NaNScan(self.modules, self.index)
        """Operations inside the forward; disarmed with the tracer (armed on its own)."""
        self._handles: list[Any] = []
        self.step = -1
        self._reset()

    @property
    def armed(self) -> bool:
        return bool(self._handles)

    def _reset(self) -> None:
        self.origin: TraceResult | None = None
        self._in_finite: dict[int, list[bool]] = {}
        self._grad_out_finite: dict[str, bool] = {}
        self._first_bad_grad_out: str | None = None
        self._first_bad_input: str | None = None

    def arm(self, step: int) -> None:
        """Arm the hooks for the step about to run (idempotent)."""
        self._reset()
        self.step = step
        if self._handles:
            return
        for name, module in self.modules:
            self._handles.append(module.register_forward_pre_hook(partial(self._pre, name)))
            self._handles.append(module.register_forward_hook(partial(self._post, name)))
            for pname, param in module.named_parameters(recurse=False):
                if param.requires_grad and hasattr(param, "register_post_accumulate_grad_hook"):
                    self._handles.append(param.register_post_accumulate_grad_hook(partial(self._param_grad, name, pname)))

    def disarm(self) -> None:
        """Remove the module hooks, and the NaN scan's (the monitor re-arms it after)."""
        for handle in self._handles:
            handle.remove()
        self._handles.clear()
        self.scan.disarm()

    def _found(self, name: str, phase: int, detail: str) -> None:
        if self.origin is None:
            self.origin = TraceResult(name, self.index.get(name, -1), phase, self.step, detail)
            log.warning("non-finite value first produced by %s of module %r at step %d: %s", PHASES[phase], name, self.step, detail)

    # forward -----------------------------------------------------------------
    def _pre(self, name: str, module: torch.nn.Module, args: Any) -> None:
        ins = _tensors(args)
        finite = all(_finite(t) for t in ins)
        self._in_finite.setdefault(id(module), []).append(finite)
        if not finite and self.origin is None and self._first_bad_input is None:
            self._first_bad_input = name
            bad = next(t for t in ins if not _finite(t))
            self._found(name, 4, f"an input of {name} is already non-finite ({_count_bad(bad)}): the data, or code outside modules")
        if torch.is_grad_enabled():
            for t in ins:
                if t.requires_grad:
                    t.register_hook(partial(self._grad_in, name))

    def _post(self, name: str, module: torch.nn.Module, args: Any, output: Any) -> None:
        stack = self._in_finite.get(id(module))
        inputs_finite = stack.pop() if stack else True
        outs = _tensors(output)
        if self.origin is None and inputs_finite:
            bad = next((t for t in outs if not _finite(t)), None)
            if bad is not None:
                bad_params = [p for p, t in module.named_parameters(recurse=False) if not _finite(t.detach())]
                if bad_params:
                    self._found(name, 3, f"its parameter(s) {', '.join(bad_params)} are non-finite (an earlier update applied non-finite gradients)")
                else:
                    self._found(name, 1, f"{type(module).__name__} output {_count_bad(bad)} from finite inputs")
        if torch.is_grad_enabled():
            for t in outs:
                if t.requires_grad:
                    t.register_hook(partial(self._grad_out, name))

    # backward ----------------------------------------------------------------
    def _grad_out(self, name: str, grad: torch.Tensor) -> None:
        finite = _finite(grad)
        self._grad_out_finite[name] = finite and self._grad_out_finite.get(name, True)
        if not finite and self._first_bad_grad_out is None:
            self._first_bad_grad_out = name

    def _grad_in(self, name: str, grad: torch.Tensor) -> None:
        if self.origin is None and not _finite(grad) and self._grad_out_finite.get(name, True):
            self._found(name, 2, f"gradient w.r.t. its input {_count_bad(grad)} while the gradient at its output was finite")

    def _param_grad(self, name: str, pname: str, param: torch.Tensor) -> None:
        grad = param.grad
        if self.origin is None and grad is not None and not _finite(grad) and self._grad_out_finite.get(name, True):
            self._found(name, 2, f"gradient of its parameter {pname} {_count_bad(grad)} while the gradient at its output was finite")

    def collect(self) -> TraceResult | None:
        """After the step's backward: the origin, if one was seen."""
        if self.origin is None and self._first_bad_grad_out is not None:
            name = self._first_bad_grad_out
            self._found(name, 5, f"the gradient arriving at the output of {name} was already non-finite: the loss computation (outside any module) produced it")
        return self.origin


_UNINITIALISED = ("empty", "new_empty", "resize", "set_")
"""Operations whose output is memory not yet written (NaN bit patterns are legitimate there);
collectives (other namespaces than aten) are skipped too: an async all-gather's buffer is not
filled until its wait."""


class _OpWatch(TorchDispatchMode):
    """Sees every operation of the forward while a NaNScan is armed and hands its outputs over."""

    def __init__(self, scan: NaNScan) -> None:
        super().__init__()
        self.scan = scan

    def __torch_dispatch__(self, func: Any, types: Any, args: Any = (), kwargs: Any = None) -> Any:
        out = func(*args, **(kwargs or {}))
        self.scan._op(func, args, out)
        return out


def _plain_floats(obj: Any) -> list[torch.Tensor]:
    # subclasses (DTensor, FakeTensor) are skipped: a check on them could issue a collective
    return [t for t in _tensors(obj) if type(t) is torch.Tensor and t.is_floating_point() and t.numel()]


class NaNScan:
    """Finds a NaN that an operation inside a module's forward produced, also one replaced
    (nan_to_num, where, masked_fill) before any module output, which the module hooks of
    NonFiniteTracer cannot see.

    Armed for one step, it enters a TorchDispatchMode while any module of the model runs its
    forward. Cheap (`naming=False`, at step 0 and every `nan_scan_every` steps): every floating output of
    an operation is OR-ed into one device flag, no sync until `result()`. Naming (the steps
    after a detection): each output is checked at once (a sync per operation) and the first
    operation whose output holds NaN from NaN-free inputs is named with the innermost module
    running it. Only NaN: -inf is a legitimate attention-mask value. No collective."""

    def __init__(self, modules: list[tuple[str, torch.nn.Module]], index: dict[str, int]) -> None:
        self.modules, self.index = modules, index
        self._handles: list[Any] = []
        self._stack: list[str] = []
        self._mode: _OpWatch | None = None
        self.naming = False
        self.step = -1
        self._flag: torch.Tensor | None = None
        self.origin: TraceResult | None = None
        self.waiting = False
        """Armed for a step whose result has not been read yet (the hooks may be gone: only the
        first forward after arming is scanned, not an evaluation loop that runs before the next step)."""

    @property
    def armed(self) -> bool:
        return bool(self._handles)

    def arm(self, step: int, naming: bool) -> None:
        self.step, self.naming, self._flag, self.origin, self.waiting = step, naming, None, None, True
        if self._handles:
            return
        for name, module in self.modules:
            self._handles.append(module.register_forward_pre_hook(partial(self._enter, name)))
            self._handles.append(module.register_forward_hook(partial(self._leave, name), always_call=True))

    def disarm(self) -> None:
        for handle in self._handles:
            handle.remove()
        self._handles.clear()
        if self._mode is not None:  # a forward that raised past its hooks
            self._mode.__exit__(None, None, None)
            self._mode = None
        self._stack.clear()

    def result(self) -> bool | TraceResult | None:
        """After the step: cheap: whether some operation produced a NaN (one sync); naming: the origin."""
        self.waiting = False
        if self.naming:
            return self.origin
        return bool(self._flag) if self._flag is not None else False

    def _enter(self, name: str, module: torch.nn.Module, args: Any) -> None:
        if not self._stack:
            self._mode = _OpWatch(self)
            self._mode.__enter__()
        self._stack.append(name)

    def _leave(self, name: str, module: torch.nn.Module, args: Any, output: Any) -> None:
        if self._stack:
            self._stack.pop()
        if not self._stack and self._mode is not None:
            self._mode.__exit__(None, None, None)
            self._mode = None
            for handle in self._handles:  # one forward scanned: the result waits for result()
                handle.remove()
            self._handles.clear()

    def _op(self, func: Any, args: Any, out: Any) -> None:
        if getattr(func, "namespace", "aten") != "aten" or getattr(func, "__name__", "").startswith(_UNINITIALISED):
            return
        outs = _plain_floats(out)
        if not outs:
            return
        if not self.naming:
            # no sync here: the flag is a device tensor read once, after the step
            for t in outs:
                bad = torch.isnan(t).any()
                self._flag = bad if self._flag is None else self._flag.logical_or_(bad)
            return
        if self.origin is not None or not any(bool(torch.isnan(t).any()) for t in outs):
            return
        if any(bool(torch.isnan(t).any()) for t in _plain_floats(args)):
            return
        name = self._stack[-1] if self._stack else ""
        bad = next(t for t in outs if bool(torch.isnan(t).any()))
        self.origin = TraceResult(name, self.index.get(name, -1), 6, self.step, f"{func} output {_count_bad(bad)} from NaN-free inputs")
        log.warning("NaN first produced by %s inside module %r at step %d", func, name, self.step)
