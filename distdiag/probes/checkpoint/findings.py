"""Findings of the `checkpoint` probe from every rank's payload (no collectives)."""

from __future__ import annotations

from typing import Any

from distdiag.probes.base import merge_local_findings
from distdiag.probes.causes import ProbeCause
from distdiag.probes.sequence_parallel.checks import positions_text
from distdiag.report.model import Finding
from distdiag.report.render import format_ranks

__all__ = ["merge", "key_findings"]

def merge(payloads: dict[int, dict[str, Any]]) -> list[Finding]:
    """Local findings, tensors unequal after load (per rank), a directory left behind."""
    findings = merge_local_findings(payloads)
    unequal = {r: p["unequal"] for r, p in payloads.items() if p.get("unequal")}
    if unequal:
        ranks = sorted(unequal)
        optim = any(".state." in line or line.startswith("optim.") for v in unequal.values() for line in v)
        findings.append(Finding(
            "error",
            f"{max(len(v) for v in unequal.values())} tensor(s) differ after the DCP load from what was saved, on "
            f"{format_ranks(ranks)}" + (" (including optimizer state)" if optim else ""),
            "\n".join(f"rank {r}: {positions_text(v)}" for r, v in sorted(unequal.items())), ranks,
            "a load that does not restore every tensor resumes from a different state: check state_dict/load hooks "
            "of the named modules and that the optimizer was built over the same parameters",
            0.95,
        ))
    left = sorted(r for r, p in payloads.items() if p.get("removed") is False)
    if left:
        findings.append(Finding(
            "warning", f"the temporary checkpoint directory was not removed on {format_ranks(left)}",
            "\n".join(f"rank {r}: {payloads[r].get('dir')}" for r in left), left, "remove it by hand", 0.9))
    return findings


def key_findings(first: dict[str, Any]) -> list[Finding]:
    """Missing, unread and renamed keys, from rank 0's view of the checkpoint metadata."""
    diff = first["key_diff"]
    where = first.get("path", "the round-trip checkpoint")
    out: list[Finding] = []
    if diff["rename"]:
        pairs = sorted(diff["rename"].items())
        out.append(Finding(
            "error",
            f"{len(pairs)} checkpoint key(s) in {where} differ from the model's only by wrapper names "
            "(_orig_mod, _checkpoint_wrapped_module, module.): a plain load reads none of them",
            "rename map (checkpoint -> model): " + positions_text([f"{c!r}: {m!r}" for c, m in pairs]),
            [],
            "save and load through torch.distributed.checkpoint.state_dict.get_state_dict/set_state_dict (which strip "
            "wrapper names), or rename the keys with the map above before dcp.load",
            0.95,
        ))
    if diff["missing"]:
        guess = {m: c for c, m in diff["by_shape"].items()}
        lines = [f"{k}" + (f" (perhaps checkpoint key {guess[k]!r}: same shape)" if k in guess else "") for k in diff["missing"]]
        out.append(Finding(
            "error", f"{len(diff['missing'])} key(s) of the model are not in the checkpoint {where}: they keep their "
                     "initial values (or dcp.load raises)",
            positions_text(lines), [],
            "the model was renamed since the checkpoint was written: map old names to new ones before loading",
            0.9,
        ))
    if diff["unread"]:
        out.append(Finding(
            "error" if diff["missing"] else "warning",
            f"{len(diff['unread'])} key(s) in the checkpoint {where} are read by nothing (DCP ignores them silently)",
            positions_text(diff["unread"]), [],
            "a key nobody reads is state you meant to restore: find the module it belonged to",
            0.85,
        ))
    shapes = first.get("shape_mismatch") or {}
    if shapes:
        out.append(Finding(
            "error", f"{len(shapes)} key(s) have a different shape in the checkpoint than in the model",
            positions_text([f"{k}: model {a}, checkpoint {b}" for k, (a, b) in sorted(shapes.items())]), [],
            "the architecture changed since the checkpoint was written (sizes, vocab, experts)", 0.9,
        ))
    return out


def unsaved_findings(payloads: dict[int, dict[str, Any]]) -> list[Finding]:
    """Buffers outside the state dict (persistent=False) that a training step changes: a resume resets them."""
    unsaved = {r: p["unsaved"] for r, p in payloads.items() if p.get("unsaved")}
    if not unsaved:
        return []
    names = sorted({n for v in unsaved.values() for n in v})
    ranks = sorted(unsaved)
    return [Finding(
        "warning",
        f"{len(names)} buffer(s) change during training but are not in the state dict (persistent=False): "
        f"{', '.join(names[:6])}; a checkpoint does not hold them, a resumed run restarts them from their initial value",
        f"on {format_ranks(ranks)}: model.state_dict() has no key for them, and their value after one training step (or "
        "forward) of the target differs from the value as built; a non-persistent buffer that never changes (a rotary "
        "table, a causal mask) is not reported",
        ranks,
        "register state that training changes as a persistent buffer (register_buffer(name, t, persistent=True)), or "
        "save it yourself beside the model (get_extra_state / the checkpoint's extra entries); persistent=False is for "
        "caches recomputed from other state",
        0.85, cause=ProbeCause.BUFFER_NOT_SAVED,
    )]
