"""The three probes without a target, at 4 ranks, on their built-in workloads: all pass, nothing above info."""

from __future__ import annotations

import pytest

from tests.harness import run_check

pytestmark = pytest.mark.timeout(150)


def test_builtin_sequence_parallel_moe_and_checkpoint_pass_at_four_ranks(workdir):
    """Splitters (contiguous, zigzag), Ulysses, tiny SP LM; EP MoE vs dense; FSDP2 + Adam DCP round trip."""
    result = run_check(4, ["--probes", "sequence_parallel,moe_routing,checkpoint"], workdir, timeout=120)
    assert result.codes == [0] * 4, result.stderr
    report = result.report()
    assert [f.issue for _, f in report.findings("warning")] == []
    sp = report.probe("sequence_parallel")
    assert sp.metrics["ulysses_max_abs_err"] < 1e-5
    assert [m["variant"] for m in sp.metrics["e2e"]] == ["uneven", "empty-shard", "all-ignored"]
    assert report.probe("checkpoint").metrics["mode"] == "round_trip"
