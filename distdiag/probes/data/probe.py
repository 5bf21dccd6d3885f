"""`data_shards`: ranks that see identical or overlapping data, and an order that repeats each epoch.

Each rank takes its first `batches` batches of epochs 0 and 1 from the target's `batches(rank,
world_size, epoch)` hook (the user's own loader: sampler, shuffling and all), or, without it,
its `shard_batch(make_batch(step), rank, world_size)` for steps 1..batches (the contract's own
split). It hashes each row (fingerprint.row_hashes) and sends the hashes in its payload;
consolidation compares them. No collective, no tensor leaves a rank.
"""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass
from itertools import islice
from typing import TYPE_CHECKING, Any

from distdiag.errors import ConfigError
from distdiag.probes import training as tr
from distdiag.probes.base import ConsolidationView, Probe
from distdiag.probes.causes import ProbeCause
from distdiag.probes.data.fingerprint import OVERLAP_ERROR, OVERLAP_SHARE, identical_groups, overlap_summary, row_hashes
from distdiag.report.model import Finding, ProbeResult
from distdiag.report.render import format_ranks

if TYPE_CHECKING:
    from distdiag.runtime.context import RankContext

__all__ = ["DataShardsProbe", "DataShardsConfig"]


@dataclass
class DataShardsConfig:
    """Options of the data_shards probe, the `[probes.data_shards]` table."""

    batches: int = 8
    """Batches per epoch each rank fingerprints (the first ones of epochs 0 and 1)."""
    workload: str = "transformer"
    """Built-in workload used without a target: mlp or transformer."""

    def __post_init__(self) -> None:
        if isinstance(self.batches, bool) or not isinstance(self.batches, int) or not 1 <= self.batches <= 1000:
            raise ConfigError(f"probes.data_shards.batches must be an integer in [1, 1000], got {self.batches!r}")
        tr.check_workload("probes.data_shards.workload", self.workload)


class DataShardsProbe(Probe):
    name = "data_shards"
    checks_a_model = True
    summary = "ranks that see identical or overlapping samples (no DistributedSampler, one seed for all), an order repeated each epoch"
    Config = DataShardsConfig

    def skip_reason(self, ctx: RankContext) -> str | None:
        target = getattr(ctx, "target", None)
        if target is None or target.has("batches"):
            return None
        if not target.has("make_batch"):
            return f"probe '{self.name}' needs hook batches() or make_batch() in target {target.spec}"
        if tr.layout_reason(ctx, self.name) is not None:
            return (f"probe '{self.name}' needs hook batches() in target {target.spec}: its layout is not data "
                    "parallel, so shard_batch(make_batch()) is not what its ranks train on")
        return None

    def run(self, ctx: RankContext) -> dict[str, Any]:
        opts: DataShardsConfig = self.options(ctx)
        target = getattr(ctx, "target", None)
        info = getattr(ctx, "info", None)
        local = {"local": [getattr(info, "local_rank", 0), getattr(info, "local_world_size", 0)]}
        try:
            if target is not None and target.has("batches"):
                loaders = [tr.call_hook("batches", target.batches, ctx.rank, ctx.world_size, e) for e in (0, 1)]
                epochs = [_take(it, opts.batches) for it in loaders]
                return {"source": f"hook batches() of target {target.spec}", "epochs": epochs, "shuffles": shuffles(loaders[0]),
                        "length": batch_count(loaders[0]), **local}
            hooks = tr.resolve_hooks(ctx, opts.workload)
            rows = [row_hashes(hooks.shard(hooks.batch(s), ctx.rank, ctx.world_size)) for s in range(1, opts.batches + 1)]
            return {"source": f"shard_batch(make_batch(step)) of {hooks.source}", "epochs": [rows], **local}
        except tr.HookError as exc:
            return {"setup_error": str(exc)}

    def consolidate(self, payloads: dict[int, dict[str, Any]], view: ConsolidationView) -> ProbeResult:
        errors: dict[str, list[int]] = {}  # one pass: a message per rank is not N^2 (issue 21)
        for r, p in payloads.items():
            if "setup_error" in p:
                errors.setdefault(p["setup_error"], []).append(r)
        if errors:
            return ProbeResult.from_findings(self.name, [Finding(
                severity="error", issue=msg, ranks=ranks, fix="fix the hook named above (docs/targets.md)",
            ) for msg, ranks in errors.items()])
        ranks = sorted(payloads)
        first = {r: payloads[r]["epochs"][0] for r in ranks}
        findings = _identical(first, {r: payloads[r].get("local") for r in ranks}) if len(ranks) > 1 else []
        same = identical_groups(first)
        findings += _overlapping(first, same)
        findings += _repeated({r: payloads[r]["epochs"] for r in ranks if payloads[r].get("shuffles")})
        findings += _uneven_length({r: payloads[r].get("length") for r in ranks})
        nrows = sum(len(b) for b in first[ranks[0]])
        findings.append(Finding(
            severity="info",
            issue=f"compared the first {len(first[ranks[0]])} batch(es) ({nrows} samples on rank 0) of {len(ranks)} rank(s)",
            evidence=f"from {payloads[ranks[0]]['source']}; samples compared by a hash of their bytes",
        ))
        return ProbeResult.from_findings(self.name, findings)


def batch_count(loader: Any) -> int | None:
    """len() of what batches returned when it has one (a DataLoader over a sized dataset: no data is read);
    None for an iterable without a length."""
    try:
        return int(len(loader))
    except Exception:  # noqa: BLE001 - an IterableDataset's loader, a generator: no length to compare
        return None


def _uneven_length(lengths: dict[int, int | None]) -> list[Finding]:
    """Ranks whose epoch holds a different number of batches: the ranks with fewer stop first and the others wait in
    the next collective (a hang at the end of each epoch, or a silently skipped step with join())."""
    known = {r: n for r, n in lengths.items() if n is not None}
    if len(known) < 2 or len(set(known.values())) < 2:
        return []
    by_count: dict[int, list[int]] = {}
    for r, n in sorted(known.items()):
        by_count.setdefault(n, []).append(r)
    shown = "; ".join(f"{format_ranks(rs)}: {n}" for n, rs in sorted(by_count.items()))
    fewest = min(by_count)
    return [Finding(
        severity="error",
        issue=f"the ranks' epochs hold different numbers of batches ({shown}): a rank that runs out first leaves "
              "the others waiting in their next collective",
        evidence=f"len() of what hook batches returned for epoch 0, per rank: {shown}\nthe ranks train in lockstep, so "
                 f"after {fewest} steps the ranks with more batches wait for a gradient reduction the others never "
                 "join (a hang at the end of each epoch)",
        ranks=sorted(r for n, rs in by_count.items() if n != max(by_count) for r in rs),
        fix="give every rank the same number of batches: DistributedSampler (it pads, or drop_last=True drops, to an "
            "equal share), or split by sample index and drop the remainder, instead of whole files or uneven chunks",
        confidence=0.9, cause=ProbeCause.BATCH_COUNT_DIFFERS,
    )]


def _take(it: Iterable[object], n: int) -> list[list[str]]:
    try:
        taken = list(islice(iter(it), n))
    except Exception as exc:  # noqa: BLE001 - the user's loader: any failure is a finding
        raise tr.HookError(f"iterating what hook batches returned raised {type(exc).__name__}: {exc}") from exc
    return [row_hashes(b) for b in taken]


def shuffles(loader: Any) -> bool | None:
    """Whether a torch DataLoader shuffles (by its sampler's type); None when it cannot be told.

    An order repeated every epoch is a bug only where the loader was meant to shuffle: data
    read in a fixed order on purpose (pre-shuffled shards) repeats by design.
    """
    from torch.utils.data import DistributedSampler, RandomSampler, SequentialSampler

    batch_sampler = getattr(loader, "batch_sampler", None)
    sampler = getattr(batch_sampler, "sampler", None) or getattr(loader, "sampler", None)
    if isinstance(sampler, DistributedSampler):
        return bool(sampler.shuffle)
    if isinstance(sampler, RandomSampler):
        return True
    if isinstance(sampler, SequentialSampler):
        return False
    return None


_SAMPLER_FIX = (
    "give each rank its own part of the data: DataLoader(dataset, sampler=DistributedSampler(dataset, "
    "num_replicas=world_size, rank=rank, shuffle=True, seed=seed)) (the same seed on every rank: the sampler "
    "shuffles identically and then takes this rank's slice), and call sampler.set_epoch(epoch) before each epoch; "
    "if you shard yourself, the slice must depend on the rank (indices[rank::world_size])"
)


def local_index_size(groups: list[list[int]], local: dict[int, Any], world: int) -> int | None:
    """The local world size L when the collisions are those of a shard index that is the local rank:
    every rank is in a group, each group is r, r + L, r + 2L, ... (one local rank on every node) and
    holds all the ranks of that local rank; None otherwise."""
    sizes = {tuple(v)[1] if v else 0 for v in local.values()}
    if not groups or len(local) != world or len(sizes) != 1:
        return None
    size = sizes.pop()
    if not 1 <= size < world or world % size or len(groups) != size:
        return None
    for g in groups:
        if len(g) != world // size or any(b - a != size for a, b in zip(g, g[1:], strict=False)):
            return None
        if len({local[r][0] for r in g}) != 1:
            return None
    return size


def _local_index_finding(groups: list[list[int]], first: dict[int, list[list[str]]], size: int, world: int) -> Finding:
    n = sum(len(b) for b in first[groups[0][0]])
    shown = "; ".join(format_ranks(g, world) for g in groups[:4]) + ("; ..." if len(groups) > 4 else "")
    return Finding(
        severity="error",
        issue=f"ranks r and r + {size} (the local world size) see identical data ({shown}): the data is sharded by the "
              "local rank (LOCAL_RANK used where RANK is needed)",
        evidence=f"row hashes of the first {len(first[groups[0][0]])} batches ({n} samples) equal within each group; "
                 f"every group is one local rank on each of the {world // size} nodes and every rank is in one: the "
                 f"shard index repeats on every node, so the job trains on 1/{world // size} of the data it should",
        ranks=sorted(r for g in groups for r in g), confidence=0.9, cause=ProbeCause.DATA_SHARDED_BY_LOCAL_RANK,
        fix="shard by the global rank and world size: DistributedSampler(dataset, num_replicas=dist.get_world_size(), "
            "rank=dist.get_rank()) (RANK and WORLD_SIZE), not LOCAL_RANK and LOCAL_WORLD_SIZE, which number the "
            "ranks of one node only",
    )


def _identical(first: dict[int, list[list[str]]], local: dict[int, Any] | None = None) -> list[Finding]:
    out = []
    groups = identical_groups(first)
    size = local_index_size(groups, local or {}, len(first))
    if size is not None:
        return [_local_index_finding(groups, first, size, len(first))]
    for group in groups:
        n = sum(len(b) for b in first[group[0]])
        out.append(Finding(
            severity="error",
            issue=f"{format_ranks(group)} see identical data: the same {n} samples in the same order in their first "
                  f"{len(first[group[0]])} batches",
            evidence=f"row hashes of every batch equal on {format_ranks(group)}: the world trains on 1/{len(group)} "
                     "of the data it should, each gradient repeated",
            ranks=group, fix=_SAMPLER_FIX, confidence=0.95, cause=ProbeCause.IDENTICAL_DATA,
        ))
    return out


def _overlapping(first: dict[int, list[list[str]]], same: list[list[int]]) -> list[Finding]:
    bad = overlap_summary(first, same, OVERLAP_SHARE, 8)
    if not bad.ranks:
        return []
    ranks, worst = bad.ranks, bad.worst
    lines = [f"ranks {a},{b}: {n} shared samples, {share:.0%} of the smaller set" for a, b, share, n in bad.first]
    return [Finding(
        severity="error" if worst >= OVERLAP_ERROR else "warning",
        issue=f"{format_ranks(ranks)} see overlapping data: up to {worst:.0%} of one rank's samples are also another's "
              "in the first batches",
        evidence="\n".join(lines) + f"\n(correctly sharded data shares only duplicate samples; flagged above {OVERLAP_SHARE:.0%})",
        ranks=ranks, fix=_SAMPLER_FIX, confidence=0.85, cause=ProbeCause.OVERLAPPING_DATA,
    )]


def _repeated(epochs: dict[int, list[list[list[str]]]]) -> list[Finding]:
    ranks = sorted(r for r, e in epochs.items() if len(e) > 1 and len(e[0]) > 1 and any(e[0]) and e[0] == e[1])
    if not ranks:
        return []
    return [Finding(
        severity="warning",
        issue=f"{format_ranks(ranks)} see their data in the same order in epoch 1 as in epoch 0, though their loader shuffles",
        evidence=f"the first {len(epochs[ranks[0]][0])} batches of epochs 0 and 1 have equal row hashes, in order",
        ranks=ranks,
        fix=("call sampler.set_epoch(epoch) at the start of every epoch: a DistributedSampler shuffles with "
             "seed + epoch, so without it every epoch repeats the first one's order; a RandomSampler's generator "
             "must not be re-seeded with the same seed each epoch"),
        confidence=0.7, cause=ProbeCause.SAME_ORDER_EVERY_EPOCH,
    )]
