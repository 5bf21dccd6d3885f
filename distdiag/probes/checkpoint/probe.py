"""`checkpoint`: DCP round trips that lose tensors, and checkpoints whose keys do not match.

Without `load`: the model (the target's, parallelized by its hook or FSDP2 by default; else
the built-in MLP under FSDP2) and its optimizer state are saved with torch.distributed.
checkpoint into a fresh directory, perturbed, loaded back and compared tensor by tensor
(every local shard, every optimizer state entry). The directory is removed afterwards, also
when a step fails. With `load` (`--checkpoint PATH`): the existing checkpoint's keys are
compared with the target model's (DCP ignores unread keys silently), wrapper names
normalised and a rename map suggested, then the matching tensors are loaded and checked.
"""

from __future__ import annotations

import os
import shutil
import tempfile
from collections.abc import Callable
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, TypeGuard

import torch

from distdiag.errors import ConfigError, exc_line
from distdiag.probes.base import DCP_IMPORTS, SHARDING_IMPORTS, ConsolidationView, LocalFinding, Probe, local_finding
from distdiag.probes.checkpoint.findings import key_findings, merge, unsaved_findings
from distdiag.probes.training import (
    HookError,
    Hooks,
    agree,
    call_hook,
    call_loss,
    default_parallelize,
    local_tensor,
    make_mesh,
    resolve_hooks,
    run_step,
)
from distdiag.report.model import ProbeResult

if TYPE_CHECKING:
    from distdiag.runtime.context import RankContext

__all__ = ["CheckpointProbe", "CheckpointConfig"]

_PATH_BYTES = 4096


@dataclass
class CheckpointConfig:
    """Options of the checkpoint probe, the `[probes.checkpoint]` table."""

    dir: str = ""
    """Where the round trip writes its temporary checkpoint; on a multi-node job a directory
    every node shares (empty: the system temp dir, single node only)."""
    load: str = ""
    """An existing DCP checkpoint to load into the target model (also `--checkpoint PATH`)."""
    trust_pickle: bool = False
    """Read the checkpoint's `.metadata` and non-tensor entries with plain pickle, as DCP does
    (unpickling runs code: only for checkpoints you trust). Off: a restricted unpickler that
    admits only what DCP metadata is made of (distdiag.probes.checkpoint.safe_load)."""

    def __post_init__(self) -> None:
        for key in ("dir", "load"):
            if not isinstance(getattr(self, key), str):
                raise ConfigError(f"probes.checkpoint.{key} must be a path string, got {getattr(self, key)!r}")
        if not isinstance(self.trust_pickle, bool):
            raise ConfigError(f"probes.checkpoint.trust_pickle must be true or false, got {self.trust_pickle!r}")




def _is_tensor(v: object) -> TypeGuard[torch.Tensor]:
    return isinstance(v, torch.Tensor)


def _perturb(t: torch.Tensor) -> None:
    """Change every element in place, in the tensor's own dtype (an integer buffer such as
    BatchNorm's num_batches_tracked cannot take a float add: the probe's own edit must not be
    what fails)."""
    if t.dtype == torch.bool:
        t.logical_not_()
    elif t.is_floating_point() or t.is_complex():
        t.add_(1.0)
    else:
        t.add_(1)


def _manual_adam_state(opt: torch.optim.Optimizer) -> None:
    """Non-trivial Adam state without a step (the first step imports torch._dynamo: seconds).

    Only for parameters a step would give state to: a frozen parameter has none in training,
    and made-up state for it must not be what a round trip trips on."""
    for group in opt.param_groups:
        for i, p in enumerate(group["params"]):
            if not p.requires_grad:
                continue
            base = local_tensor(p.detach())
            opt.state[p] = {"step": torch.tensor(3.0), "exp_avg": _shaped_like(p, base * 0.5 + 0.25 + i),
                            "exp_avg_sq": _shaped_like(p, base * base + 0.125)}


def _shaped_like(param: torch.Tensor, local: torch.Tensor) -> torch.Tensor:
    """`local` (computed on this rank's shard) laid out like `param` (a DTensor under FSDP2).

    The state is computed on local shards: the same arithmetic on DTensors runs DTensor's
    sharding propagation once per op and shape (a FakeTensorMode each time, ~5 ms apiece on
    2 busy cores), 24 times for the built-in MLP, for values that need no communication.
    """
    if not hasattr(param, "to_local"):
        return local
    from torch.distributed.tensor import DTensor

    return DTensor.from_local(local, param.device_mesh, param.placements, run_check=False,  # type: ignore[attr-defined]  # a DTensor
                              shape=param.shape, stride=param.stride())


def _adamw(model: torch.nn.Module) -> torch.optim.Optimizer:
    """AdamW over the model, with the manual state above (what the round trip saves and compares)."""
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
    _manual_adam_state(opt)
    return opt


class CheckpointProbe(Probe):
    name = "checkpoint"
    checks_a_model = True
    summary = "DCP checkpoints that do not round-trip, and checkpoints whose keys no longer match the model (renames, wrappers)"
    Config = CheckpointConfig
    private_apis = ("torch.distributed.checkpoint._nested_dict:flatten_state_dict",)
    preload = SHARDING_IMPORTS + DCP_IMPORTS

    def skip_reason(self, ctx: RankContext) -> str | None:
        opts = self.options(ctx)
        if ctx.target is not None and not ctx.target.has("build_model"):
            return f"probe 'checkpoint' needs hook build_model() in target {ctx.target.spec}"
        if not opts.load and not opts.dir and ctx.info.local_world_size < ctx.world_size:
            return "a multi-node round trip needs a directory every node shares: set probes.checkpoint.dir"
        return None

    def run(self, ctx: RankContext) -> dict[str, Any]:
        opts: CheckpointConfig = self.options(ctx)
        findings: list[LocalFinding] = []
        model: torch.nn.Module | None = None
        opt: torch.optim.Optimizer | None = None
        try:
            model, opt, source = self._setup(ctx)
        except HookError as exc:
            findings.append(local_finding("error", f"checkpoint probe could not build the model: {exc}"))
        if agree(ctx, model is None):
            return {"findings": findings}
        assert model is not None and opt is not None  # built on this rank too: agree() says none failed
        from torch.distributed.checkpoint.state_dict import get_state_dict

        msd, osd = get_state_dict(model, opt)
        if opts.load:
            return self._load_existing(ctx, opts, model, opt, msd, osd, findings, source)
        return {**self._round_trip(ctx, opts, model, opt, msd, osd, findings, source), "unsaved": self.unsaved}

    def _setup(self, ctx: RankContext) -> tuple[torch.nn.Module, torch.optim.Optimizer, str]:
        target = ctx.target
        self.unsaved: list[str] = []
        if target is None or target.has("make_batch"):
            hooks = resolve_hooks(ctx, "mlp")
            model = hooks.wrap(hooks.model(ctx.seed), make_mesh(ctx))
            shard = hooks.shard(hooks.batch(1), ctx.rank, ctx.world_size)
            if target is not None and target.has("build_optimizer"):
                opt = hooks.optimizer(model)
                self.unsaved = _unsaved_changing(model, lambda: run_step(hooks, model, opt, shard))
                return model, opt, hooks.source
            if target is not None:
                self.unsaved = _unsaved_changing(model, lambda: _forward(hooks, model, shard))
            return model, _adamw(model), hooks.source
        ctx.seed()
        model = call_hook("build_model", target.build_model)
        wrap = target.get("parallelize") or default_parallelize
        model = call_hook("parallelize", wrap, model, make_mesh(ctx)) or model
        return model, _adamw(model), f"target {target.spec}"

    def _shared_dir(self, ctx: RankContext, base: str, cleanups: list[int]) -> str:
        """Rank 0 creates the directory; every rank learns its path (one broadcast).

        Each local rank 0 (the ranks that remove it) registers its removal with the sentinel
        (`at_abort`) before anything can hang: a run ended by a hang leaves through os._exit,
        where no `finally` runs. The tokens go to `cleanups`, cancelled once it is removed.
        """
        from distdiag.runtime.sentinel import at_abort

        buf = torch.zeros(_PATH_BYTES, dtype=torch.uint8, device=ctx.device)
        if ctx.rank == 0:
            path = tempfile.mkdtemp(prefix="distdiag-ckpt-", dir=base or None)
            cleanups.append(at_abort(lambda: shutil.rmtree(path, ignore_errors=True)))
            raw = path.encode()
            if len(raw) >= _PATH_BYTES:
                _remove(path, cleanups)
                raise ConfigError(f"probes.checkpoint.dir: path too long ({len(raw)} bytes)")
            buf[: len(raw)] = torch.tensor(list(raw), dtype=torch.uint8)
        ctx.comm.broadcast(buf, src=0)
        data = bytes(buf.cpu().tolist())
        path = data[: data.index(0)].decode()
        if ctx.rank != 0 and ctx.info.local_rank == 0:
            cleanups.append(at_abort(lambda: shutil.rmtree(path, ignore_errors=True)))
        return path

    def _round_trip(self, ctx: RankContext, opts: CheckpointConfig, model: torch.nn.Module, opt: torch.optim.Optimizer, msd: Any, osd: Any,
                    findings: list[LocalFinding], source: str) -> dict[str, Any]:
        import torch.distributed.checkpoint as dcp
        from torch.distributed.checkpoint._nested_dict import flatten_state_dict
        from torch.distributed.checkpoint.api import CheckpointException
        from torch.distributed.checkpoint.state_dict import get_state_dict, set_state_dict

        if opts.dir and not os.path.isdir(opts.dir):
            findings.append(local_finding("error", f"probes.checkpoint.dir {opts.dir} is not a directory on this rank"))
        if agree(ctx, bool(findings)):
            return {"findings": findings}
        state = {"model": msd, "optim": osd}
        flat, _ = flatten_state_dict(state)
        snapshot = {k: local_tensor(v).detach().clone() for k, v in flat.items() if _is_tensor(v)}
        cleanups: list[int] = []
        path = self._shared_dir(ctx, opts.dir, cleanups)
        result: dict[str, Any] = {"findings": findings, "mode": "round_trip", "source": source, "keys": len(flat),
                                  "tensors": len(snapshot), "bytes": sum(t.numel() * t.element_size() for t in snapshot.values())}
        failed = True
        try:
            # An explicit writer: without one DCP imports fsspec to see whether it could take the
            # path. No fsync: the directory is deleted in a moment, durability is not checked here.
            dcp.save(state, checkpoint_id=path, storage_writer=dcp.FileSystemWriter(path, sync_files=False))
            with torch.no_grad():
                for k in snapshot:
                    _perturb(local_tensor(flat[k]))  # so a load that silently reads nothing shows
            ckpt = _ckpt_shapes(path, opts.trust_pickle)
            expected = {k: (tuple(v.shape) if _is_tensor(v) else ()) for k, v in flat.items()}
            result["key_diff"] = _diff(expected, ckpt)
            _dcp_load({k: v for k, v in flat.items() if _is_tensor(v) and k in ckpt}, path, opts.trust_pickle)
            set_state_dict(model, opt, model_state_dict=msd, optim_state_dict=osd)
            after, _ = flatten_state_dict(dict(zip(("model", "optim"), get_state_dict(model, opt), strict=True)))
            result["unequal"] = _unequal(snapshot, after)
            failed = False
        # CheckpointException (a failure DCP gathered from every rank) is a BaseException.
        except (Exception, CheckpointException) as exc:  # noqa: BLE001 - DCP failing is the finding
            # DCP's save/load run collectives of their own: a rank that raised inside one may have
            # stranded the others there; say so before the agreement below.
            ctx.caught(exc, "DCP round trip")
            findings.append(local_finding("error", f"DCP round trip failed: {exc_line(exc)}",
                                          fix="see the traceback of the same step in your training job; the probe removes "
                                              "its temporary directory once every rank is done with it (a warning says "
                                              "so if it could not)"))
        finally:
            try:
                agree(ctx, failed)  # every rank is done with the directory before it goes
            finally:
                if ctx.info.local_rank == 0:
                    result["removed"] = _remove(path, cleanups)
        result["dir"] = path
        return result

    def _load_existing(self, ctx: RankContext, opts: CheckpointConfig, model: torch.nn.Module, opt: torch.optim.Optimizer, msd: Any, osd: Any,
                       findings: list[LocalFinding], source: str) -> dict[str, Any]:
        from torch.distributed.checkpoint._nested_dict import flatten_state_dict
        from torch.distributed.checkpoint.api import CheckpointException
        from torch.distributed.checkpoint.state_dict import get_state_dict, set_state_dict

        from distdiag.probes.checkpoint.safe_load import RefusedPickle

        load = opts.load
        try:
            ckpt = _ckpt_shapes(load, opts.trust_pickle)
        except RefusedPickle as exc:
            ctx.caught(exc, f"reading the metadata of {load}")  # local read, but agree() follows
            ckpt = None
            findings.append(_refused(load, exc))
        except Exception as exc:  # noqa: BLE001 - a path that is no DCP checkpoint is bad input
            ctx.caught(exc, f"reading the metadata of {load}")  # local read, but agree() follows
            ckpt = None
            findings.append(local_finding("error", f"--checkpoint {load}: not a readable DCP checkpoint on this rank: "
                                          f"{exc_line(exc)}",
                                          fix="pass the directory that holds the checkpoint's .metadata file"))
        if agree(ctx, ckpt is None):
            return {"findings": findings}
        assert ckpt is not None  # agree() is True when any rank's is None
        nested = any(k.startswith("model.") for k in ckpt)
        state: dict[str, Any] = {"model": msd, "optim": osd} if nested else dict(msd)
        flat, _ = flatten_state_dict(state)
        if nested and not any(k.startswith("optim.") for k in ckpt):
            flat = {k: v for k, v in flat.items() if not k.startswith("optim.")}
        expected = {k: (tuple(v.shape) if _is_tensor(v) else ()) for k, v in flat.items()}
        diff = _diff(expected, ckpt)
        result: dict[str, Any] = {"findings": findings, "mode": "load", "source": source, "path": load, "key_diff": diff,
                                  "layout": "{model, optim}" if nested else "flat model keys", "keys": len(ckpt)}
        to_ckpt = {k: k for k in expected if k in ckpt}
        to_ckpt.update({m: c for c, m in diff["rename"].items()})
        shapes = {m: (expected[m], ckpt[c]) for m, c in to_ckpt.items() if expected[m] != ckpt[c]}
        result["shape_mismatch"] = {m: [list(a), list(b)] for m, (a, b) in shapes.items()}
        to_load = {c: flat[m] for m, c in to_ckpt.items() if _is_tensor(flat[m]) and m not in shapes}
        failed = None
        try:
            _dcp_load(to_load, load, opts.trust_pickle)
        except (Exception, CheckpointException) as exc:  # noqa: BLE001 - a load DCP (or we) refuse is the finding
            ctx.caught(exc, f"dcp.load of {load}")  # DCP's load is collective: peers may be left in it
            failed = _refused(load, exc) if "refuses to unpickle" in str(exc) else local_finding(
                "error", f"--checkpoint {load}: dcp.load raised {exc_line(exc)}",
                fix="see the traceback of the same load in your training job")
            findings.append(failed)
        if agree(ctx, failed is not None):
            result["findings"] = findings
            return result
        loaded = {m: local_tensor(flat[m]).detach().clone() for m, c in to_ckpt.items() if c in to_load}
        set_state_dict(model, opt, model_state_dict=msd, optim_state_dict=osd)
        now = get_state_dict(model, opt)
        after, _ = flatten_state_dict({"model": now[0], "optim": now[1]} if nested else now[0])
        result["loaded"] = len(loaded)
        result["unequal"] = _unequal(loaded, after)
        return result

    def consolidate(self, payloads: dict[int, dict[str, Any]], view: ConsolidationView) -> ProbeResult:
        findings = merge(payloads)
        first = payloads.get(0, {})
        findings += unsaved_findings(payloads)
        if first.get("key_diff"):
            findings += key_findings(first)
        metrics = {k: first[k] for k in ("mode", "keys", "tensors", "bytes", "loaded") if k in first}
        return ProbeResult.from_findings(self.name, findings, metrics=metrics)


def _forward(hooks: Hooks, model: torch.nn.Module, shard: Any) -> None:
    with torch.no_grad():
        call_loss(hooks, model, shard)


def _unsaved_changing(model: torch.nn.Module, step: Callable[[], object]) -> list[str]:
    """Buffers left out of the state dict (registered persistent=False) whose value one training step (or forward)
    changes: state a checkpoint cannot restore. Nothing runs when the model has no such buffer."""
    keys = set(model.state_dict().keys())
    unsaved = {n: b for n, b in model.named_buffers() if n not in keys}
    if not unsaved:
        return []
    before = {n: local_tensor(b).detach().clone() for n, b in unsaved.items()}
    step()
    after = dict(model.named_buffers())
    return sorted(n for n, t in before.items() if n in after and not torch.equal(local_tensor(after[n]).detach(), t))


def _remove(path: str, cleanups: list[int]) -> bool:
    """Remove the round trip's directory now, and with it the sentinel's cleanup for a hang."""
    from distdiag.runtime.sentinel import cancel_at_abort

    shutil.rmtree(path, ignore_errors=True)
    for token in cleanups:
        cancel_at_abort(token)
    cleanups.clear()
    return not os.path.exists(path)


def _ckpt_shapes(path: str, trust_pickle: bool) -> dict[str, tuple[int, ...]]:
    """{key: shape} of a checkpoint's metadata, read without running code from it (unless trusted)."""
    from distdiag.probes.checkpoint.safe_load import SafeFileSystemReader

    meta = SafeFileSystemReader(path, trust_pickle).read_metadata()
    return {k: tuple(getattr(m, "size", ())) for k, m in meta.state_dict_metadata.items()}


def _dcp_load(state: dict[str, Any], path: str, trust_pickle: bool) -> None:
    """dcp.load through the restricted metadata reader and byte-entry planner (unless trusted)."""
    import torch.distributed.checkpoint as dcp

    from distdiag.probes.checkpoint.safe_load import SafeFileSystemReader, SafeLoadPlanner

    dcp.load(state, checkpoint_id=path, storage_reader=SafeFileSystemReader(path, trust_pickle),
             planner=SafeLoadPlanner(trust_pickle=trust_pickle))


def _refused(load: str, exc: BaseException) -> LocalFinding:
    """The finding for a checkpoint the restricted reader refused (what, where, the trust key)."""
    what = getattr(exc, "what", None)
    where = getattr(exc, "where", None)
    text = f"distdiag refuses to unpickle {what} from {where}" if what else _refusal_line(str(exc))
    return local_finding(
        "error", f"--checkpoint {load}: {text}",
        evidence="unpickling runs code: the restricted reader admits only the classes DCP metadata is made of "
                 "(torch.distributed.checkpoint metadata classes, torch.Size, dtypes, builtin containers) and "
                 "tensors, numbers and strings in non-tensor entries",
        fix="set [probes.checkpoint] trust_pickle = true if you trust the checkpoint (it is then read with plain "
            "pickle, as DCP does); otherwise do not load it anywhere",
    )


def _refusal_line(text: str) -> str:
    """The 'distdiag refuses to unpickle X from Y' part of a message DCP wrapped."""
    start = text.find("distdiag refuses to unpickle")
    line = text[start:] if start >= 0 else text
    return line.split(" (unpickling runs code")[0].splitlines()[0]


def _diff(expected: dict[str, tuple[int, ...]], ckpt: dict[str, tuple[int, ...]]) -> dict[str, Any]:
    from distdiag.probes.checkpoint.keys import compare_keys

    d = compare_keys(expected, ckpt)
    return {"missing": d.missing, "unread": d.unread, "rename": d.rename, "by_shape": d.by_shape}


def _unequal(before: dict[str, torch.Tensor], after: dict[str, Any]) -> list[str]:
    bad = []
    for k, t in before.items():
        now = after.get(k)
        if not _is_tensor(now):
            bad.append(f"{k}: missing after load")
            continue
        now = local_tensor(now).detach()
        if now.shape != t.shape or not torch.equal(now.cpu(), t.cpu()):
            diff = float((now.float().cpu() - t.float().cpu()).abs().max()) if now.shape == t.shape else float("nan")
            bad.append(f"{k}: max abs difference {diff:.3g}" if now.shape == t.shape else f"{k}: shape {list(now.shape)} vs {list(t.shape)}")
    return bad
