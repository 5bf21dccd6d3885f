"""The user's target: a module (`mypkg.diag`) or a file (`path/to/diag.py`) exposing hooks.

Every hook is optional; a probe that needs a missing hook says which one and skips. Hooks
are validated when the target loads: a hook that is not callable or cannot be called with
the documented arguments is bad input (exit 2 on every rank), before anything runs.
distdiag seeds every rank identically before calling a hook (RankContext.seed).
"""

from __future__ import annotations

import hashlib
import importlib
import importlib.util
import inspect
import os
import sys
import threading
import traceback
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field
from pathlib import Path
from types import ModuleType
from typing import Any

from distdiag.errors import ConfigError, DistDiagError, exc_line

__all__ = ["HOOKS", "Target", "MissingHook", "load_target"]

HOOKS: dict[str, tuple[str, ...]] = {
    "build_model": (),
    "make_batch": ("step",),
    "loss_fn": ("model", "batch"),
    "parallelize": ("model", "mesh"),
    "shard_batch": ("batch", "rank", "world_size"),
    "train_step": ("model", "batch", "optimizer"),
    "build_optimizer": ("params",),
    "split_sequence": ("batch", "rank", "world_size"),
    "parallelize_sp": ("model", "mesh"),
    "route": ("tokens",),
    "batches": ("rank", "world_size", "epoch"),
}
"""Every hook a target may define, with the arguments distdiag passes (positionally)."""


class MissingHook(DistDiagError):
    """A probe needs a hook the target does not define (the probe skips with this reason)."""


@dataclass
class Target:
    spec: str
    module: ModuleType
    hooks: dict[str, Any] = field(default_factory=dict)

    def has(self, name: str) -> bool:
        return name in self.hooks

    def get(self, name: str) -> Any | None:
        return self.hooks.get(name)

    def require(self, *names: str, probe: str = "") -> None:
        missing = [n for n in names if n not in self.hooks]
        if missing:
            who = f"probe '{probe}' " if probe else ""
            raise MissingHook(f"{who}needs hook(s) {', '.join(missing)}() in target {self.spec}")

    def __getattr__(self, name: str) -> Any:
        hooks = self.__dict__.get("hooks", {})
        if name in hooks:
            return hooks[name]
        raise AttributeError(name)


def _check_signature(spec: str, name: str, fn: object) -> None:
    if not callable(fn):
        raise ConfigError(f"target {spec}: {name} must be a function, got {type(fn).__name__}")
    expected = HOOKS[name]
    try:
        sig = inspect.signature(fn)
    except (TypeError, ValueError):
        return  # builtins and C functions: trust them
    try:
        sig.bind(*expected)
    except TypeError:
        shown = ", ".join(sig.parameters)
        raise ConfigError(
            f"target {spec}: hook {name} must accept ({', '.join(expected)}), but its signature is ({shown})"
        ) from None


def _import_file(path: Path) -> ModuleType:
    name = "distdiag_target_" + hashlib.sha1(str(path.resolve()).encode()).hexdigest()[:10]
    spec = importlib.util.spec_from_file_location(name, path)
    if spec is None or spec.loader is None:
        raise ConfigError(f"target {path}: not a Python file")
    module = importlib.util.module_from_spec(spec)
    sys.modules[name] = module
    # The target's own folder on sys.path, so it can import its neighbours.
    folder = str(path.resolve().parent)
    if folder not in sys.path:
        sys.path.insert(0, folder)
    spec.loader.exec_module(module)
    return module


def _where(exc: BaseException) -> str:
    frames = traceback.extract_tb(exc.__traceback__)
    user = [f for f in frames if "importlib" not in f.filename and "/distdiag/check/target.py" not in f.filename]
    if not user:
        return ""
    last = user[-1]
    return f" (at {last.filename}:{last.lineno})"


class _ExitAtImport(BaseException):
    """The target called os._exit while it was being imported (args[0]: the code)."""


@contextmanager
def _exit_refused_while_importing() -> Iterator[None]:
    """os._exit called by the importing thread raises _ExitAtImport instead of ending the rank.

    A rank that vanished while importing the target never posts whether it loaded: its peers
    learnt of it from their deadline (90 s in issue 24), and with os._exit(0) torchrun saw a
    clean exit and the run waited until killed (seen here: 200 s, then SIGTERM). Caught, it
    is bad input said in one line on every rank within seconds. Other threads (the sentinel
    ends a hung rank with os._exit) still get the real one.
    """
    real, importer = os._exit, threading.get_ident()

    def guarded(code: int) -> None:
        if threading.get_ident() == importer:
            raise _ExitAtImport(code)
        real(code)

    os._exit = guarded  # type: ignore[assignment]
    try:
        yield
    finally:
        os._exit = real


def load_target(spec: str) -> Target:
    """Import the target and validate its hooks; every problem is a one-line ConfigError."""
    is_file = spec.endswith(".py") or "/" in spec
    try:
        with _exit_refused_while_importing():
            if is_file:
                path = Path(spec)
                if not path.is_file():
                    raise ConfigError(f"target file {spec} does not exist")
                module = _import_file(path)
            else:
                module = importlib.import_module(spec)
    except ConfigError:
        raise
    except _ExitAtImport as exc:
        raise ConfigError(
            f"target {spec} called os._exit({exc.args[0]}) while being imported{_where(exc)}; "
            "a target must only define hooks"
        ) from None
    except ModuleNotFoundError as exc:
        if not is_file and exc.name and spec.startswith(exc.name):
            raise ConfigError(f"target module {spec!r} not found (is it installed or on PYTHONPATH?)") from None
        raise ConfigError(f"target {spec} failed to import: ModuleNotFoundError: {exc}{_where(exc)}") from None
    except BaseException as exc:  # noqa: BLE001 - any import failure of user code is bad input
        if isinstance(exc, KeyboardInterrupt):
            raise
        raise ConfigError(f"target {spec} failed to import: {exc_line(exc)}{_where(exc)}") from None
    hooks = {}
    for name in HOOKS:
        fn = getattr(module, name, None)
        if fn is not None:
            _check_signature(spec, name, fn)
            hooks[name] = fn
    if not hooks:
        raise ConfigError(f"target {spec} defines none of the hooks {', '.join(HOOKS)}")
    return Target(spec=spec, module=module, hooks=hooks)
