"""The end-to-end part of `sequence_parallel`: the SP model against the unsplit reference.

Contract (docs/sequence_moe_checkpoint.md): `loss_fn(model, batch)` on the unsplit batch
is the reference; on a split batch (it has `shift_labels`) it returns the loss this rank
backpropagates, such that the mean over the SP ranks is the full batch's loss and the
gradients averaged over the ranks are the full batch's gradients (the convention of
distdiag.workloads, what FSDP/DDP averaging expects).
"""

from __future__ import annotations

import math
from collections.abc import Callable
from typing import TYPE_CHECKING, Any

import torch
from torch import nn

from distdiag.errors import exc_line
from distdiag.probes import training as tr
from distdiag.probes.base import LocalFinding, local_finding
from distdiag.probes.checkpoint.keys import normalize_key
from distdiag.probes.sequence_parallel.checks import IGNORE, output_shape_problem, positions_text
from distdiag.workloads import sequence as seqw
from distdiag.workloads.base import to_device

if TYPE_CHECKING:
    from torch.distributed.device_mesh import DeviceMesh

    from distdiag.runtime.context import RankContext

__all__ = ["run_end_to_end", "variants", "VARIANT_TEXT"]

VARIANT_TEXT = {
    "uneven": "the targets of the last half-shard are ignored",
    "empty-shard": "the targets of the last shard are all ignored",
    "all-ignored": "every target is ignored",
}
"""What each batch variant of `variants` ignores (for findings: the probe made these batches)."""


def variants(batch: dict[str, Any], world: int) -> list[tuple[str, dict[str, Any]]]:
    """The batch with uneven valid targets, with the last shard empty, and with none at all."""
    seq = batch["labels"].shape[1]
    out = []
    for name, cut in (("uneven", math.ceil(seq / (2 * world))), ("empty-shard", math.ceil(seq / world)), ("all-ignored", seq)):
        b = dict(batch)
        labels = batch["labels"].clone()
        labels[:, seq - cut :] = IGNORE
        b["labels"] = labels
        out.append((name, b))
    return out


def _output_tensor(out: object) -> torch.Tensor | None:
    if isinstance(out, torch.Tensor):
        return out
    if isinstance(out, tuple | list) and out and isinstance(out[0], torch.Tensor):
        return out[0]
    logits = getattr(out, "logits", None)
    return logits if isinstance(logits, torch.Tensor) else None


def _forward_backward(loss_fn: Callable[[nn.Module, object], object], model: nn.Module, batch: object,
                      captured: list[object]) -> tuple[float, torch.Tensor | None]:
    handle = model.register_forward_hook(lambda _m, _i, o: captured.append(o) if not captured else None)
    try:
        loss = loss_fn(model, batch)
    finally:
        handle.remove()
    if not isinstance(loss, torch.Tensor) or loss.numel() != 1:
        raise TypeError(f"loss_fn must return a scalar tensor, got {type(loss).__name__}")
    if loss.requires_grad:
        loss.backward()
    return float(loss.detach()), _captured(captured)


def _captured(captured: list[object]) -> torch.Tensor | None:
    out = _output_tensor(captured[0]) if captured else None
    return out.detach().cpu() if out is not None else None


def _grads(model: nn.Module) -> dict[str, torch.Tensor]:
    out = {}
    for name, p in model.named_parameters():
        g = p.grad
        if g is not None and hasattr(g, "full_tensor"):
            g = g.full_tensor()
        out[normalize_key(name)] = (g if g is not None else torch.zeros(p.shape)).detach().cpu().float()
    return out


def run_end_to_end(ctx: RankContext, target: Any, batch: dict[str, Any], splitters: dict[str, Any], findings: list[LocalFinding]) -> list[dict[str, Any]]:
    """Every batch variant's comparison; `target` None means the built-in tiny LM."""
    if target is None:
        length = max(256, int(batch["input_ids"].shape[1]))
        hooks = {"build_model": lambda: seqw.TinyCausalLM(vocab=64, max_len=length), "loss_fn": seqw.sp_loss,
                 "parallelize_sp": seqw.parallelize_tiny_lm}
    else:
        needed = ("build_model", "make_batch", "loss_fn", "parallelize_sp")
        missing = [h for h in needed if not target.has(h)]
        if missing:
            if target.has("parallelize_sp") or target.has("split_sequence"):
                findings.append(local_finding(
                    "info", f"end-to-end SP check skipped: the target has no {', '.join(missing)}()",
                    fix="define build_model, make_batch, loss_fn and parallelize_sp to compare the SP model with the unsplit one"))
            return []
        hooks = {h: target.get(h) for h in needed}
    mesh = tr.make_mesh(ctx, "sp")
    split = next(iter(splitters.values()))
    return [_one(ctx, hooks, split, mesh, name, b) for name, b in variants(batch, ctx.world_size)]


def _one(ctx: RankContext, hooks: dict[str, Any], split: Callable[[dict[str, Any], int, int], object], mesh: DeviceMesh,
         variant: str, batch: dict[str, Any]) -> dict[str, Any]:
    rank, world, device = ctx.rank, ctx.world_size, ctx.device
    res: dict[str, Any] = {"variant": variant}
    ctx.seed()
    ref = hooks["build_model"]().to(device)
    ref_loss, ref_out = _forward_backward(hooks["loss_fn"], ref, to_device(batch, device), [])
    res["ref_loss"] = ref_loss
    ref_grads = _grads(ref)
    error, local = None, None
    captured: list[object] = []
    try:
        ctx.seed()
        sp = hooks["parallelize_sp"](hooks["build_model"]().to(device), mesh)
        local = split(batch, rank, world)
        res["sp_loss"], _ = _forward_backward(hooks["loss_fn"], sp, to_device(local, device), captured)
    except Exception as exc:  # noqa: BLE001 - the user's SP step failing is a finding
        ctx.caught(exc, f"SP step on the {variant} batch")  # before agree: the step may have stranded peers
        error = f"{exc_line(exc)}"
    sp_out = _captured(captured)
    any_failed = tr.agree(ctx, error is not None)
    full_targets = seqw.shift_labels(batch["labels"])
    if isinstance(local, dict) and isinstance(local.get("input_ids"), torch.Tensor):
        ids = local["input_ids"]
        pos = local.get("position_ids")
        if pos is None:
            pos = seqw.contiguous_indices(batch["labels"].shape[1], rank, world).expand_as(ids)
        tgts = full_targets.gather(1, pos.clamp(0, full_targets.shape[1] - 1).cpu())
        res["valid"] = int((tgts != IGNORE).sum())
        if ref_out is not None and ref_out.dim() == 3 and ref_out.shape[:2] == batch["labels"].shape:
            rows = ref_out.gather(1, pos.cpu().clamp(0, ref_out.shape[1] - 1)[..., None].expand(-1, -1, ref_out.shape[2]))
            res["ref_shard_sum"] = float(torch.nn.functional.cross_entropy(
                rows.reshape(-1, rows.shape[-1]).float(), tgts.reshape(-1), ignore_index=IGNORE, reduction="sum"))
            if sp_out is not None:
                _compare_output(res, sp_out, ref_out, rows, pos.cpu(), world)
    if error:
        res["error"] = error
        return res
    if any_failed:
        res["skipped"] = "another rank's SP step failed"
        return res
    res["grad"] = _compare_grads(ctx, ref_grads, _grads(sp))
    if variant == "uneven" and _has_padding(batch):
        try:
            res["unmasked_mismatch"] = _unmasked_mismatch(hooks, ref, sp, split(_unmasked(batch), rank, world),
                                                          _unmasked(batch), device, (rank, world))
        except Exception as exc:  # noqa: BLE001 - a side check: its failure leaves the diagnosis undecided
            ctx.caught(exc, "SP step on the batch with its attention mask set to ones")
    return res


def _has_padding(batch: dict[str, Any]) -> bool:
    mask = batch.get("attention_mask")
    return isinstance(mask, torch.Tensor) and bool((mask == 0).any())


def _unmasked(batch: dict[str, Any]) -> dict[str, Any]:
    return {**batch, "attention_mask": torch.ones_like(batch["attention_mask"])}


def _unmasked_mismatch(hooks: dict[str, Any], ref: nn.Module, sp: nn.Module, local: object, batch: dict[str, Any],
                       device: torch.device,
                       where: tuple[int, int]) -> bool:
    """Whether the SP output still differs from the reference once the attention mask is all ones.

    Run only when the masked batch has padding, on every rank alike (the batch is the same
    everywhere), after the agreement that no rank failed: the forward's collectives pair up.
    An output that is wrong with the mask and right without it is the mask's handling (the
    diagnosis of the sequence_parallel end-to-end finding reads this).
    """
    captured: list[object] = []
    with torch.no_grad():
        _, ref_out = _forward_backward(hooks["loss_fn"], ref, to_device(batch, device), [])
        _forward_backward(hooks["loss_fn"], sp, to_device(local, device), captured)
    out = _captured(captured)
    if out is None or ref_out is None or not isinstance(local, dict) or not isinstance(local.get("input_ids"), torch.Tensor):
        return False
    rank, world = where
    pos = local.get("position_ids")
    if pos is None:
        pos = seqw.contiguous_indices(batch["labels"].shape[1], rank, world).expand_as(local["input_ids"])
    pos = pos.cpu()
    rows = ref_out.gather(1, pos.clamp(0, ref_out.shape[1] - 1)[..., None].expand(-1, -1, ref_out.shape[2]))
    check: dict[str, Any] = {}
    _compare_output(check, out, ref_out, rows, pos, world)
    return bool(check)


def _compare_output(res: dict[str, Any], out: torch.Tensor, ref: torch.Tensor, rows: torch.Tensor, pos: torch.Tensor, world: int) -> None:
    expected = list(rows.shape)
    problem = output_shape_problem(list(out.shape), expected, list(ref.shape), world)
    if problem:
        res["output_problem"] = problem
        return
    want = rows if list(out.shape) == expected else ref
    where = pos if list(out.shape) == expected else torch.arange(ref.shape[1]).expand(ref.shape[0], -1)
    err = (out.float() - want.float()).abs().amax(dim=-1)
    tol = 1e-4 * max(1.0, float(want.abs().max()))
    bad = (err > tol) | ~torch.isfinite(err)
    if bool(bad.any()):
        positions = sorted({int(p) for p in where[bad]})
        res["output_mismatch"] = f"max abs error {float(err[torch.isfinite(err)].max()) if torch.isfinite(err).any() else float('nan'):.3g} at positions {positions_text(positions)}"


def _compare_grads(ctx: RankContext, ref: dict[str, torch.Tensor], sp: dict[str, torch.Tensor]) -> dict[str, Any]:
    names = [n for n in ref if n in sp and sp[n].shape == ref[n].shape]
    if not names:
        return {"rel_err": 0.0, "worst": "(no parameter names in common)", "finite": True}
    flat = torch.cat([sp[n].reshape(-1) for n in names]).to(ctx.device)
    ctx.comm.all_reduce(flat)
    flat = flat.cpu() / ctx.world_size
    worst, worst_err, finite, offset = "", 0.0, True, 0
    for n in names:
        g = flat[offset : offset + ref[n].numel()].reshape(ref[n].shape)
        offset += ref[n].numel()
        if not bool(torch.isfinite(g).all()):
            finite, worst = False, f"{n} has non-finite gradient values"
            break
        scale = max(float(ref[n].abs().max()), 1e-3)
        err = float((g - ref[n]).abs().max()) / scale
        if err > worst_err:
            worst, worst_err = n, err
    return {"rel_err": worst_err, "worst": worst, "finite": finite}
