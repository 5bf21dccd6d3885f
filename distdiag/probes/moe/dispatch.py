"""Recording the all_to_all split sizes of a forward, and checking them pairwise.

`SplitRecorder` replaces `torch.distributed.all_to_all_single` while a user's forward runs
(restored afterwards, also on error). Before each real call it all-gathers every rank's
(input, output) split sizes on the call's group: if rank i would send a different number
of rows to rank j than j expects from i, every rank of the group raises the same
`SplitMismatch` instead of entering a collective that gloo aborts (SIGABRT) and NCCL hangs
or corrupts on.
"""

from __future__ import annotations

from typing import Any

import torch
import torch.distributed as dist
import torch.distributed.distributed_c10d as c10d

from distdiag.errors import DistDiagError
from distdiag.report.model import Finding
from distdiag.report.render import format_ranks
from distdiag.runtime.comm import ALL_GATHER_SINGLE

__all__ = ["SplitRecorder", "SplitMismatch", "split_findings", "pair_mismatches"]


class SplitMismatch(DistDiagError, RuntimeError):
    """Split sizes of one all_to_all_single disagree between ranks (raised on every rank)."""


def pair_mismatches(sends: list[list[int]], recvs: list[list[int]], ranks: list[int]) -> list[str]:
    """Lines naming each (sender, receiver) pair whose sizes disagree; index i = group rank i."""
    out = []
    for i in range(len(sends)):
        for j in range(len(sends)):
            if sends[i][j] != recvs[j][i]:
                out.append(f"rank {ranks[i]} sends {sends[i][j]} rows to rank {ranks[j]}, which expects {recvs[j][i]}")
    return out


class SplitRecorder:
    def __init__(self) -> None:
        self.calls: list[dict[str, Any]] = []
        self._saved: list[tuple[Any, str, Any]] = []

    def __enter__(self) -> SplitRecorder:
        self._original = dist.all_to_all_single
        for module in (dist, c10d):
            self._saved.append((module, "all_to_all_single", module.all_to_all_single))
            module.all_to_all_single = self._wrapped  # type: ignore[attr-defined]  # dist's and c10d's
        return self

    def __exit__(self, *exc: object) -> None:
        for module, name, value in reversed(self._saved):
            setattr(module, name, value)
        self._saved.clear()

    def _wrapped(self, output: torch.Tensor, input: torch.Tensor, output_split_sizes: list[int] | None = None,
                 input_split_sizes: list[int] | None = None, group: dist.ProcessGroup | None = None,
                 async_op: bool = False) -> dist.Work | None:
        world = dist.get_world_size(group)
        ranks = dist.get_process_group_ranks(group) if group is not None else list(range(world))
        ins = [int(s) for s in input_split_sizes] if input_split_sizes else [input.shape[0] // world] * world
        outs = [int(s) for s in output_split_sizes] if output_split_sizes else [output.shape[0] // world] * world
        mine = torch.tensor(ins + outs, dtype=torch.int64, device=input.device)
        table = torch.empty(world * 2 * world, dtype=torch.int64, device=input.device)
        ALL_GATHER_SINGLE(table, mine, group=group)
        rows = table.cpu().view(world, 2, world).tolist()
        sends, recvs = [r[0] for r in rows], [r[1] for r in rows]
        bad = pair_mismatches(sends, recvs, ranks)
        self.calls.append({"call": len(self.calls) + 1, "group": ranks, "send": ins, "recv": outs,
                           "mismatch": bad})
        if bad:
            raise SplitMismatch(f"all_to_all_single call {len(self.calls)}: split sizes disagree: " + "; ".join(bad[:4]))
        return self._original(output, input, output_split_sizes, input_split_sizes, group=group, async_op=async_op)


def split_findings(where: str, calls_by_rank: dict[int, list[dict[str, Any]]]) -> list[Finding]:
    """Pairwise agreement of the recorded split sizes of every call, across ranks."""
    counts = {r: len(c) for r, c in calls_by_rank.items()}
    findings = []
    if len(set(counts.values())) > 1:
        findings.append(Finding(
            "error", f"{where}: ranks issued different numbers of all_to_all_single calls",
            ", ".join(f"rank {r}: {n}" for r, n in sorted(counts.items())), sorted(counts),
            "every rank of an expert-parallel group must dispatch and combine the same number of times", 0.9))
    seen: set[tuple[int, tuple[int, ...]]] = set()  # a call of each group (expert-parallel groups call apart)
    for r in sorted(calls_by_rank):
        for call in calls_by_rank[r]:
            if call.get("mismatch") and (call["call"], tuple(call["group"])) not in seen:
                seen.add((call["call"], tuple(call["group"])))
                ranks = call["group"]
                sends = {rr: calls_by_rank[rr][call["call"] - 1]["send"] for rr in ranks if rr in calls_by_rank
                         and len(calls_by_rank[rr]) >= call["call"]}
                caps = ", ".join(f"rank {rr} sends {s}" for rr, s in sorted(sends.items()))
                findings.append(Finding(
                    "error",
                    f"{where}: all_to_all_single call {call['call']} split sizes disagree between {format_ranks(ranks)}: "
                    f"tokens would be lost or misread",
                    "\n".join(call["mismatch"][:8]) + f"\nsplit sizes: {caps}", ranks,
                    "compute the capacity (or exchange counts) identically on every rank: a capacity from the local "
                    "token count differs between ranks; all-reduce it or exchange counts with an all_to_all first", 0.95))
    return findings
