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
"""

from __future__ import annotations

import logging
from dataclasses import dataclass
from functools import partial
from typing import Any

import torch

__all__ = ["NonFiniteTracer", "TraceResult", "PHASES"]

log = logging.getLogger("distdiag.monitor")

PHASES = {1: "forward", 2: "backward", 3: "parameters", 4: "input", 5: "loss"}
"""Where the first non-finite value was seen: a module's forward or backward, a module's
parameters (already non-finite), the data entering the model, the loss computation."""


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
        for handle in self._handles:
            handle.remove()
        self._handles.clear()

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
