"""Wrap torch.distributed's collectives (and the functional ones DTensor uses) while armed.

Each wrapper records the call in distdiag.watchdog.progress (op, group, shape, dtype, the
user's call site) and calls the original. The wrappers replace module attributes of
torch.distributed, torch.distributed.distributed_c10d (so internal calls such as
all_gather_object -> all_gather are seen once: nested calls pass straight through) and
torch.distributed._functional_collectives; `restore()` puts the originals back.
Code that bound a collective by name before arming (`from torch.distributed import
all_reduce`) keeps the original: the flight recorder and the stacks still cover it.
Only the thread that armed the watchdog is tracked; other threads pass straight through.
"""

from __future__ import annotations

import functools
import inspect
import logging
import os
import sys
import threading
from collections.abc import Callable
from types import FrameType
from typing import Any

from distdiag.hang.groupid import GroupId
from distdiag.hang.recorder import group_label, groups_made
from distdiag.watchdog.progress import P2P_GROUP, Progress

_WORLD = GroupId(world=True).label
_UNNAMED = GroupId().label
"""The labels of the default group and of a group this wrapper cannot name ('world', 'group?')."""

__all__ = ["Interceptor", "C10D_OPS", "FUNCOL_OPS"]

log = logging.getLogger("distdiag.watchdog")

C10D_OPS = (
    "all_reduce", "broadcast", "all_gather", "all_gather_into_tensor", "all_gather_single", "_all_gather_base",
    "reduce_scatter", "reduce_scatter_tensor", "reduce_scatter_single", "_reduce_scatter_base",
    "all_to_all", "all_to_all_single", "barrier", "monitored_barrier", "reduce", "gather", "scatter",
    "all_reduce_coalesced", "all_gather_coalesced", "all_gather_object", "broadcast_object_list",
    "gather_object", "scatter_object_list", "send", "recv", "isend", "irecv", "batch_isend_irecv",
)
P2P_OPS = frozenset({"send", "recv", "isend", "irecv", "batch_isend_irecv"})
_P2P_ASYNC = frozenset({"isend", "irecv", "batch_isend_irecv"})
FUNCOL_OPS = (
    "broadcast", "all_reduce", "all_gather_single", "reduce_scatter_single", "all_gather_tensor",
    "reduce_scatter_tensor", "all_to_all_single", "all_reduce_coalesced", "all_gather_single_coalesced",
    "reduce_scatter_single_coalesced", "all_gather_into_tensor_coalesced", "reduce_scatter_tensor_coalesced",
    "all_gather_tensor_autograd", "all_gather_single_autograd", "reduce_scatter_tensor_autograd",
    "reduce_scatter_single_autograd", "all_to_all_single_autograd", "permute_tensor",
)
_TENSOR_PARAMS = (
    "tensor", "input_tensor", "input", "self", "input_list", "input_tensor_list", "inputs", "tensors",
    "tensor_list", "object_list", "obj", "scatter_object_input_list", "p2p_op_list",
)

_MARK = "__distdiag_wrapped__"


def _skip_prefixes() -> tuple[tuple[str, ...], str]:
    import torch

    torch_dir = os.path.dirname(torch.__file__) + os.sep
    own = os.path.dirname(os.path.dirname(os.path.abspath(__file__))) + os.sep  # distdiag/
    stdlib = os.path.dirname(os.__file__) + os.sep
    return (torch_dir, own + "watchdog" + os.sep, own + "watch.py", stdlib), os.sep + "site-packages" + os.sep


def _compiling_check() -> Callable[[], bool]:
    """torch.compiler.is_compiling where it exists (torch >= 2.3), else always False."""
    try:
        import torch

        return torch.compiler.is_compiling
    except AttributeError:  # pragma: no cover - older torch
        return lambda: False


class _Spec:
    """Where a collective's tensor, group and async flag sit in its positional arguments."""

    __slots__ = ("tensor_name", "tensor_index", "group_index", "async_index")

    def __init__(self, fn: Callable[..., Any]) -> None:
        try:
            params = list(inspect.signature(fn).parameters.values())
        except (TypeError, ValueError):
            params = []
        names = [p.name for p in params]
        self.tensor_name = next((n for n in _TENSOR_PARAMS if n in names), names[0] if names else "")
        self.tensor_index = names.index(self.tensor_name) if self.tensor_name in names else 0
        self.group_index = names.index("group") if "group" in names else -1
        self.async_index = names.index("async_op") if "async_op" in names else -1

    def get(self, args: tuple[Any, ...], kwargs: dict[str, Any], index: int, name: str) -> Any:
        if name in kwargs:
            return kwargs[name]
        if 0 <= index < len(args):
            return args[index]
        return None


def _p2p_label(op: str, args: tuple[Any, ...], kwargs: dict[str, Any]) -> str:
    """'recv(src=1)', 'send(dst=0)': the peer (a global rank) says whom a send/recv waits for."""
    name = "src" if "recv" in op else "dst"
    peer = kwargs.get(name, args[1] if len(args) > 1 else None)
    if peer is None and isinstance(kwargs.get("group_" + name), int):
        # torch.distributed.pipelining passes the peer as a group rank (group_src / group_dst)
        group, local = kwargs.get("group"), kwargs["group_" + name]
        try:
            import torch.distributed as dist

            peer = local if group is None else dist.get_global_rank(group, local)
        except Exception:  # noqa: BLE001 - the label goes without its peer
            peer = None
    if op == "batch_isend_irecv" and args and isinstance(args[0], list | tuple):
        peers = sorted({q for p in args[0] if (q := getattr(p, "peer", None)) is not None})
        return f"{op}(peers={','.join(map(str, peers))})" if peers else op
    return f"{op}({name}={peer})" if isinstance(peer, int) else op


class Interceptor:
    """Installs and removes the wrappers for one Progress."""

    def __init__(self, progress: Progress) -> None:
        self.progress = progress
        self.enabled = False
        self._saved: list[tuple[Any, str, Any]] = []
        self._sites: dict[tuple[Any, int], str] = {}
        self._labels: dict[tuple[Any, int], str] = {}
        self._skip, self._site_pkgs = _skip_prefixes()
        self._skip_torch_own = self._skip[:3]
        """Torch and distdiag's own files: skipped even inside site-packages (user libraries there are not)."""
        self._resolve_group_name: Callable[[Any], Any] | None = None
        self._dtype_names: dict[Any, str] = {}
        import torch.distributed as dist

        self._pg_type = dist.ProcessGroup

    # -- naming --------------------------------------------------------------------------
    def call_site(self) -> str:
        frame: FrameType | None = sys._getframe(2)
        skip, site_pkgs, torch_own = self._skip, self._site_pkgs, self._skip_torch_own
        while frame is not None:
            name = frame.f_code.co_filename
            if not name.startswith(skip) or (site_pkgs in name and not name.startswith(torch_own)):
                key = (frame.f_code, frame.f_lineno)
                site = self._sites.get(key)
                if site is None:
                    site = self._sites[key] = f"{name}:{frame.f_lineno} in {frame.f_code.co_name}"
                return site
            frame = frame.f_back
        return "?"

    def group_label(self, group: Any, funcol: bool = False) -> str:
        if group is None:
            return _WORLD
        try:
            if funcol and not isinstance(group, self._pg_type):
                resolve = self._resolve_group_name
                if resolve is None:
                    from torch.distributed import _functional_collectives as fc

                    resolve = self._resolve_group_name = fc._resolve_group_name
                key: Any = str(resolve(group))
            else:
                key = group.group_name
        except Exception:  # noqa: BLE001 - a label only
            return _UNNAMED
        cached = (key, groups_made())  # a twin made later changes the label (group_label)
        label = self._labels.get(cached)
        if label is None:
            label = self._labels[cached] = group_label(key)
        return label

    def describe(self, value: Any) -> tuple[Any, str]:
        if isinstance(value, list | tuple):
            if not value:
                return (), "-"
            first_shape, dtype = self.describe(value[0])
            return (len(value), *first_shape) if isinstance(first_shape, tuple) else (len(value),), dtype
        shape = getattr(value, "shape", None)
        if shape is None:
            return (), type(value).__name__
        dtype = value.dtype
        name = self._dtype_names.get(dtype)
        if name is None:
            name = self._dtype_names[dtype] = str(dtype).replace("torch.", "")
        return tuple(shape), name

    # -- wrapping ------------------------------------------------------------------------
    def _wrap(self, op: str, fn: Callable[..., Any], funcol: bool) -> Callable[..., Any]:
        spec = _Spec(fn)
        prog = self.progress
        me = self
        p2p = op in P2P_OPS
        label = f"funcol:{op}" if funcol else op
        get_ident = threading.get_ident
        compiling = _compiling_check()

        @functools.wraps(fn)
        def wrapper(*args: Any, **kwargs: Any) -> Any:
            if compiling():
                # torch.compile traces through us: stay out of the graph (no side effects, no
                # graph break); the flight recorder sees the collective when the graph runs.
                return fn(*args, **kwargs)
            if prog.depth or not me.enabled or get_ident() != prog.thread_ident:
                return fn(*args, **kwargs)
            try:
                if p2p:
                    group = P2P_GROUP
                    rec_op = _p2p_label(label, args, kwargs)
                else:
                    group = me.group_label(spec.get(args, kwargs, spec.group_index, "group"), funcol)
                    rec_op = label
                shape, dtype = me.describe(spec.get(args, kwargs, spec.tensor_index, spec.tensor_name))
                # isend/irecv/batch_isend_irecv return Work the caller waits on later: async
                is_async = funcol or op in _P2P_ASYNC or bool(spec.get(args, kwargs, spec.async_index, "async_op"))
                rec = prog.begin(rec_op, group, shape, dtype, me.call_site(), is_async)
            except Exception as exc:  # noqa: BLE001 - never break the user's collective
                log.debug("could not record %s: %s", op, exc)
                return fn(*args, **kwargs)
            prog.depth += 1
            try:
                result = fn(*args, **kwargs)
            finally:
                prog.depth -= 1
                if not is_async:
                    prog.end(rec)
            if is_async:
                me._watch_async(rec, result, funcol)
            return result

        setattr(wrapper, _MARK, fn)
        return wrapper

    def _watch_async(self, rec: Any, work: Any, funcol: bool) -> None:
        prog = self.progress
        if funcol or work is None:
            # A functional collective completes when its tensor is waited on; issuing it is
            # the progress we can see.
            prog.async_done(rec)
            return
        works = list(work) if isinstance(work, list | tuple) else [work]
        try:
            if len(works) != 1:
                raise RuntimeError("several works")
            works[0].get_future().add_done_callback(lambda _fut: prog.async_done(rec))
        except Exception:  # noqa: BLE001 - gloo's send/recv Work has no future: the tick polls it
            if all(hasattr(w, "is_completed") for w in works):
                prog.poll_works[id(rec)] = (rec, works)
            else:
                prog.async_done(rec)

    def install(self, only_p2p: bool = False) -> None:
        """Wrap every collective, or (`only_p2p`) only send/recv: torch's recorder gives each
        collective's position and call site, but not a send's or recv's peer."""
        import torch.distributed as dist
        from torch.distributed import distributed_c10d as c10d

        modules: list[tuple[Any, tuple[str, ...], bool]] = [(dist, C10D_OPS, False), (c10d, C10D_OPS, False)]
        try:
            from torch.distributed import _functional_collectives as fc

            modules.append((fc, FUNCOL_OPS, True))
        except ImportError:
            pass
        wrapped: dict[int, Callable[..., Any]] = {}
        for module, ops, funcol in modules:
            for op in ops:
                if only_p2p and (funcol or op not in P2P_OPS):
                    continue
                fn = getattr(module, op, None)
                if fn is None or not callable(fn) or hasattr(fn, _MARK):
                    continue
                key = id(fn) if not funcol else -id(fn)
                if key not in wrapped:
                    wrapped[key] = self._wrap(op, fn, funcol)
                self._saved.append((module, op, fn))
                setattr(module, op, wrapped[key])
        self.enabled = True

    def restore(self) -> None:
        """Put the originals back (unless someone wrapped ours since; then just go quiet)."""
        self.enabled = False
        for module, op, fn in reversed(self._saved):
            current = getattr(module, op, None)
            if current is not None and getattr(current, _MARK, None) is fn:
                setattr(module, op, fn)
            else:
                log.warning("torch.distributed.%s was replaced after the watchdog armed; leaving it", op)
        self._saved.clear()
