"""The setup/dtype/device/data corpus (issue 23 items 3, 5 and 6): bug and twin per mechanism.

Each case is a target in tests/corpus/setup_targets/ run as a user would run it,
`distdiag check --target FILE --probes PROBE` on real gloo ranks (tests/harness.py, hard
timeout). The bug must be named by its `cause` with a fix that fits the mechanism; the
twin (DISTDIAG_TWIN=healthy, the same file without the bug) must draw no warning or error
from the probe. The table in docs/diagnosis-corpus.md lists the same cases.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

import pytest

from tests.harness import run_check

pytestmark = pytest.mark.timeout(120)

TARGETS = Path(__file__).resolve().parent / "setup_targets"


@dataclass(frozen=True)
class Case:
    target: str
    probe: str
    cause: str
    fix: tuple[str, ...]
    """Words the fix must contain: the action that undoes this mechanism."""
    severity: str = "error"
    world: int = 2
    ranks: tuple[int, ...] | None = None
    """The ranks the finding must name, where the evidence can tell them."""
    also: str = ""
    """Probes run with it (the twin must keep those quiet too)."""
    evidence: str = ""
    """Words the deciding evidence must contain."""
    hosts: int = 1
    """Pretend nodes the ranks are split over (LOCAL_RANK, LOCAL_WORLD_SIZE, GROUP_RANK)."""

    @property
    def probes(self) -> list[str]:
        return [p for p in (self.also, self.probe) if p]


CASES = [
    Case("loaded_on_rank0", "setup_sync", "setup_divergence_loaded_on_one_rank", ("load the weights on every rank", "broadcast"),
         world=3, ranks=(0,), evidence="each rank kept its slice of its own copy"),
    Case("rank_seeded", "setup_sync", "setup_divergence_rank_seeded", ("torch.manual_seed(seed), not seed + rank",)),
    Case("buffer_per_rank", "setup_sync", "setup_divergence_buffer_per_rank", ("compute the buffer identically", "broadcast")),
    Case("dtype_one_rank", "setup_sync", "dtype_differs_across_ranks", ("cast on every rank",)),
    Case("half_master_weights", "setup_sync", "low_precision_master_weights", ("keep the parameters in float32", "autocast"), severity="warning"),
    Case("loss_outside_autocast", "setup_sync", "loss_in_low_precision", ("logits.float()", "inside the autocast"), severity="warning"),
    Case("left_on_meta", "setup_sync", "left_on_meta", ("to_empty", "on the root")),
    Case("hsdp_one_replica_loaded", "param_sync", "setup_divergence_replicas_differ", ("every rank must read its own shard",),
         world=4, also="setup_sync"),
    Case("reduce_dtype_one_rank", "setup_sync", "mixed_precision_differs_across_ranks", ("same MixedPrecisionPolicy",)),
    Case("no_sampler", "data_shards", "identical_data", ("DistributedSampler",)),
    Case("same_seed_sampler", "data_shards", "identical_data", ("DistributedSampler", "same seed")),
    Case("overlapping_shards", "data_shards", "overlapping_data", ("indices[rank::world_size]",)),
    Case("no_set_epoch", "data_shards", "same_order_every_epoch", ("set_epoch(epoch)",), severity="warning"),
    Case("shard_ignores_rank", "data_shards", "identical_data", ("must depend on the rank",)),
    Case("local_rank_sampler", "data_shards", "data_sharded_by_local_rank", ("rank=dist.get_rank()", "not LOCAL_RANK"),
         world=4, hosts=2, ranks=(0, 1, 2, 3), evidence="one local rank on each of the 2 nodes"),
]


def _run(workdir: Path, case: Case, healthy: bool, twin: str = "healthy"):
    env = {"DISTDIAG_TWIN": twin} if healthy else {}
    args = ["--probes", ",".join(case.probes), "--target", str(TARGETS / f"{case.target}.py")]
    return run_check(case.world, args, workdir, timeout=90, env=env, hosts=case.hosts)


@pytest.mark.parametrize("case", CASES, ids=[c.target for c in CASES])
def test_bug_is_named_by_its_cause(workdir, case):
    """The bug's finding carries its cause, severity, a fix that undoes it and the ranks it can tell."""
    result = _run(workdir, case, healthy=False)
    expected = 1 if case.severity == "error" else 0
    assert result.codes == [expected] * case.world, result.stdout + result.stderr
    found = [f for f in result.report().probe(case.probe).findings if f.cause == case.cause]
    assert found, [(f.severity, f.cause, f.issue) for f in result.report().probe(case.probe).findings]
    finding = found[0]
    assert finding.severity == case.severity, finding
    for words in case.fix:
        assert words in finding.fix, (words, finding.fix)
    if case.ranks is not None:
        assert tuple(finding.ranks) == case.ranks, finding.ranks
    assert case.evidence in finding.evidence, finding.evidence


@pytest.mark.parametrize("case", CASES, ids=[c.target for c in CASES])
def test_twin_is_quiet(workdir, case):
    """The same target without its bug draws nothing above info from the probes it ran with."""
    result = _run(workdir, case, healthy=True)
    assert result.codes == [0] * case.world, result.stdout + result.stderr
    report = result.report()
    loud = [(f.severity, f.cause, f.issue) for p in case.probes for f in report.probe(p).findings if f.severity != "info"]
    assert loud == []


@pytest.mark.parametrize("twin,world", [("broadcast", 3), ("ddp", 2)])
def test_load_on_rank0_made_whole_by_parallelize_is_quiet(workdir, twin, world):
    """Rank 0 loads, then parallelize broadcasts its state before fully_shard, or wraps in DDP (which
    broadcasts at construction): the build-time difference never reaches training, an info only."""
    case = Case("loaded_on_rank0", "setup_sync", "", (), world=world)
    result = _run(workdir, case, healthy=True, twin=twin)
    assert result.codes == [0] * world, result.stdout + result.stderr
    findings = result.report().probe("setup_sync").findings
    assert [f for f in findings if f.severity != "info"] == []
    (healed,) = [f for f in findings if f.cause == "setup_divergence_healed_by_parallelize"]
    assert "frozen.bias, frozen.weight" in healed.issue
