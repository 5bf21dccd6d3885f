"""setup_sync's device and dtype checks: where each tensor of the model lives, what the optimizer
steps, and the precision of the loss.

Each rank lists its tensors (parameters and buffers, local shards of DTensors) as rows
[fqn, kind, device, dtype, trainable, numel]; `device_problems` judges one rank's rows
(a pure function, tested with CUDA device names on CPU), `placement_findings` merges the
ranks and adds what only the job sees: two ranks of one host on one GPU.
"""

from __future__ import annotations

from typing import Any

from torch import nn

from distdiag.probes import training as tr
from distdiag.probes.base import alike, group_alike, minority_ranks
from distdiag.probes.causes import ProbeCause
from distdiag.probes.numerics.setup_digest import outermost_modules
from distdiag.report.model import Finding
from distdiag.report.render import format_ranks

__all__ = ["placement_rows", "device_problems", "placement_findings", "loss_findings", "precision_rows", "precision_findings"]

LOW = ("float16", "bfloat16")


def placement_rows(model: nn.Module) -> list[list[Any]]:
    rows = []
    for name, p in model.named_parameters():
        t = tr.local_tensor(p)
        rows.append([tr.canonical_name(name), "param", _dev(t.device), str(t.dtype)[6:], bool(p.requires_grad), t.numel()])
    for name, b in model.named_buffers():
        t = tr.local_tensor(b)
        rows.append([tr.canonical_name(name), "buffer", _dev(t.device), str(t.dtype)[6:], False, t.numel()])
    return rows


def _dev(d: Any) -> str:
    return d.type if d.index is None else f"{d.type}:{d.index}"


def device_problems(rows: list[list[Any]], rank_device: str, meta_is_wrong: bool) -> list[tuple[ProbeCause, str, str]]:
    """(cause, modules, detail) for one rank's tensors.

    meta tensors after parallelize were never materialised (`left_on_meta`); tensors on a
    device other than where most of the model's elements are, or, on a GPU rank, on another
    GPU than the rank's own (`module_on_wrong_device`).
    """
    every = [r[0] for r in rows]
    out: list[tuple[ProbeCause, str, str]] = []
    meta = [r[0] for r in rows if r[2] == "meta"]
    if meta and meta_is_wrong:
        out.append((ProbeCause.LEFT_ON_META, ", ".join(outermost_modules(meta, every)[:6]),
                    f"{len(meta)} tensor(s) still on meta (no storage)"))
    placed = [r for r in rows if r[2] != "meta"]
    weight: dict[str, int] = {}
    for r in placed:
        weight[r[2]] = weight.get(r[2], 0) + max(int(r[5]), 1)
    if not weight:
        return out
    main = max(weight, key=lambda d: (weight[d], d == rank_device))
    if rank_device.startswith("cuda") and main.startswith("cuda") and main != rank_device:
        out.append((ProbeCause.MODULE_ON_WRONG_DEVICE, "the whole model", f"on {main}, but this rank's device is {rank_device}"))
    for dev in sorted(d for d in weight if d != main):
        names = [r[0] for r in placed if r[2] == dev]
        out.append((ProbeCause.MODULE_ON_WRONG_DEVICE, ", ".join(outermost_modules(names, every)[:6]),
                    f"{len(names)} tensor(s) on {dev}, the rest of the model ({weight[main]} elements) on {main}"))
    return out


_FIX = {
    ProbeCause.LEFT_ON_META: (
        "materialise every module after fully_shard: model.to_empty(device=...) on the root (not only on some blocks), "
        "then re-initialise parameters and recompute buffers (to_empty leaves them uninitialised), or load a "
        "checkpoint that covers them; a load with assign=True leaves keys missing from the checkpoint on meta"
    ),
    ProbeCause.MODULE_ON_WRONG_DEVICE: (
        "move the whole model to the rank's device once, after building it: model.to(torch.device('cuda', "
        "local_rank)) (not 'cuda' or 'cuda:0', which on every rank is GPU 0); a sub-module created or moved after that "
        "call (a buffer made with device=..., a module assigned later) needs the same device"
    ),
    ProbeCause.RANKS_SHARE_A_DEVICE: (
        "each rank must use its own GPU: torch.cuda.set_device(local_rank) and device=f'cuda:{local_rank}' "
        "(LOCAL_RANK from torchrun), before building the model"
    ),
}


def _judged_rows(rows: list[list[Any]], device: str, meta_is_wrong: bool) -> tuple[list[Any], set[str], list[tuple[str, str]]]:
    """One rank's rows judged: (its device problems, the GPUs it holds tensors on, its
    low-precision trainable (dtype, fqn))."""
    return (device_problems(rows, device, meta_is_wrong), {r[2] for r in rows if r[2].startswith("cuda")},
            [(r[3], r[0]) for r in rows if r[4] and r[3] in LOW])


def placement_findings(payloads: dict[int, dict[str, Any]], view: Any) -> list[Finding]:
    merged: dict[tuple[ProbeCause, str, str], list[int]] = {}
    shared: dict[tuple[str, str], list[int]] = {}
    half: dict[str, dict[str, list[int]]] = {}
    judged: dict[tuple[int, str, bool], tuple[list[Any], set[str], list[tuple[str, str]]]] = {}
    for rank, p in sorted(payloads.items()):
        rows = p.get("parallel") or p.get("built") or []
        # Rows posted alike are one object (shared_fields): judged once per object, device and phase.
        key = (id(rows), p.get("device", "cpu"), "parallel" in p)
        if key not in judged:
            judged[key] = _judged_rows(rows, key[1], key[2])
        problems, devs, low = judged[key]
        for problem in problems:
            merged.setdefault(problem, []).append(rank)
        if len(devs) == 1:
            shared.setdefault((view.host_of(rank), next(iter(devs))), []).append(rank)
        for dtype, fqn in low:
            half.setdefault(dtype, {}).setdefault(fqn, []).append(rank)
    out = [Finding(
        severity="error", issue=f"{modules}: {detail} ({format_ranks(ranks)})", ranks=ranks,
        evidence="after parallelize" if "parallel" in payloads[ranks[0]] else "the model as built", fix=_FIX[cause],
        confidence=0.9, cause=cause,
    ) for (cause, modules, detail), ranks in merged.items()]
    for (host, dev), ranks in shared.items():
        if len(ranks) > 1:
            out.append(Finding(severity="error", issue=f"{format_ranks(ranks)} on host {host} all hold their model on {dev}",
                               ranks=ranks, fix=_FIX[ProbeCause.RANKS_SHARE_A_DEVICE], confidence=0.9, cause=ProbeCause.RANKS_SHARE_A_DEVICE))
    out += _half_findings(half)
    return out


def _half_findings(half: dict[str, dict[str, list[int]]]) -> list[Finding]:
    out = []
    for dtype, names in half.items():
        ranks = sorted({r for rs in names.values() for r in rs})
        fp16 = dtype == "float16"
        out.append(Finding(
            severity="warning" if fp16 else "info",
            issue=f"{len(names)} trainable parameter(s) are stored in {dtype}, so the optimizer updates {dtype} weights "
                  f"with no float32 master copy: {', '.join(sorted(names)[:6])}",
            evidence=("an update smaller than 2^-11 of a weight rounds away in float16, and Adam's eps=1e-8 is below "
                      "float16's smallest normal (6.1e-5)" if fp16 else
                      "an update smaller than 2^-8 of a weight rounds away in bfloat16 (pure bf16 training; fine if meant)"),
            ranks=ranks,
            fix=("keep the parameters in float32 and compute in low precision: torch.autocast (with GradScaler for "
                 "float16), or FSDP2 MixedPrecisionPolicy(param_dtype=...); do not call model.half()/.to(dtype) on the "
                 "model the optimizer steps"),
            confidence=0.8 if fp16 else 0.5, cause=ProbeCause.LOW_PRECISION_MASTER_WEIGHTS,
        ))
    return out


def loss_findings(payloads: dict[int, dict[str, Any]]) -> list[Finding]:
    low: dict[str, list[int]] = {}
    failed: dict[str, list[int]] = {}
    for rank, p in sorted(payloads.items()):
        loss = p.get("loss") or {}
        if loss.get("dtype") in LOW:
            low.setdefault(loss["dtype"], []).append(rank)
        if loss.get("error"):
            failed.setdefault(loss["error"], []).append(rank)
    out = [Finding(
        severity="error", issue=f"{msg} (the forward that reads the loss's dtype, on {format_ranks(ranks)})", ranks=ranks,
        fix="fix the hook named above (docs/targets.md gives each hook's signature and what it must return)",
    ) for msg, ranks in failed.items()]
    return out + [Finding(
        severity="warning",
        issue=f"the loss comes out in {dtype} on {format_ranks(ranks)}: it was computed from low-precision outputs "
              "outside autocast's float32 ops",
        evidence=f"loss_fn on each rank's part of step 1 returned a {dtype} scalar (a float32 loss is expected: under "
                 "autocast, cross_entropy/log_softmax/the reductions run in float32); bfloat16 keeps 8 bits of mantissa, "
                 "so a loss near 2 is resolved to 0.008",
        ranks=ranks,
        fix=("compute the loss in float32: logits.float() before the loss, or compute the loss inside the autocast "
             "region (autocast runs cross_entropy in float32); with FSDP2 MixedPrecisionPolicy(param_dtype=...), "
             "set output_dtype=torch.float32"),
        confidence=0.75, cause=ProbeCause.LOSS_IN_LOW_PRECISION,
    ) for dtype, ranks in low.items()]


def precision_rows(model: nn.Module, world: int) -> dict[str, list[Any]]:
    """fqn -> [stored dtype, FSDP2 param_dtype, reduce_dtype] on this rank, after parallelize."""
    from distdiag.probes.numerics.fsdp_plan import describe_plan

    try:
        rows = describe_plan(model, world)
    except Exception:  # noqa: BLE001 - FSDP2 internals read defensively: no table, no finding
        return {}
    return {r["fqn"]: [r["dtype"], r.get("param_dtype"), r.get("reduce_dtype")] for r in rows}


def precision_findings(payloads: dict[int, dict[str, Any]]) -> list[Finding]:
    """Parameters whose stored, compute or reduce dtype differs across ranks after parallelize.

    FSDP2 issues no collective in fully_shard, so this is seen before the first all-gather,
    which would exchange buffers of different dtypes and sizes (a hang or a garbled reduction).
    """
    ranks = [r for r in sorted(payloads) if payloads[r].get("precision")]
    # Each distinct precision table once (ranks that posted it alike hold one object: shared_fields).
    classes = alike(ranks, [payloads[r]["precision"] for r in ranks])
    keys = sorted({k for table, _ in classes for k in table})
    differ: dict[str, dict[str, list[int]]] = {}
    for key in keys:
        labels = []
        for table, rs in classes:
            if key in table:
                stored, param, reduce = table[key]
                labels.append((f"stored {stored}, compute {param or stored}, reduce {reduce or param or stored}", rs))
        groups = group_alike(labels)
        if len(groups) > 1:
            differ[key] = groups
    if not differ:
        return []
    odd = sorted({r for g in differ.values() for r in minority_ranks(g)})
    lines = [f"{k}: " + "; ".join(f"{format_ranks(m)}: {v}" for v, m in g.items()) for k, g in list(differ.items())[:8]]
    return [Finding(
        severity="error",
        issue=f"{len(differ)} parameter(s) have a different precision across ranks after parallelize: "
              f"{', '.join(list(differ)[:6])}; {format_ranks(odd)} differ",
        evidence="\n".join(lines), ranks=odd,
        fix=("build the same MixedPrecisionPolicy (and cast the model the same way) on every rank: a policy read from "
             "per-rank config or chosen in a rank-dependent branch makes FSDP2's all-gathers and reduce-scatters "
             "exchange buffers of different dtypes and sizes, which hangs or garbles the reduction"),
        confidence=0.9, cause=ProbeCause.MIXED_PRECISION_DIFFERS_ACROSS_RANKS,
    )]
