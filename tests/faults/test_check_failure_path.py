"""The failure path is the product: each injected fault ends in a report naming the rank.

Every run has a hard timeout in the harness; elapsed-time bounds are wide (loaded 2-core box)
but prove that the run ends near the probe deadline instead of hanging.
"""

from __future__ import annotations

import pytest

from tests.harness import run_check

pytestmark = pytest.mark.timeout(120)

T = 3.0  # --timeout-s of the runs below
ARGS = ["--probes", "env,collectives", "--timeout-s", str(T)]


def _crit(report):
    return [f for _, f in report.findings("critical")]


def test_probe_raises_on_one_rank(workdir):
    """A raise on rank 1 is the lead finding, with its exception; the stranded rank is named as waiting."""
    result = run_check(2, ARGS, workdir, inject="raise:collectives:1", timeout=60)
    assert result.codes == [3, 3], result.stderr
    report = result.report()
    (lead,) = _crit(report)
    assert lead.ranks == [1]
    assert "RuntimeError: injected fault: raise in collectives on rank 1" in lead.issue
    assert "rank 0 was left waiting in all_reduce" in lead.issue
    assert "Traceback" in lead.evidence
    assert result.elapsed < T + 15


def test_probe_raises_on_every_rank_is_a_failed_probe_not_a_hang(workdir):
    """When every rank raises, nobody is stranded: exit 1 and the run goes on to the next probe."""
    spec = "raise:env:0;raise:env:1"
    result = run_check(2, ARGS, workdir, inject=spec, timeout=60)
    assert result.codes == [1, 1], result.stderr
    report = result.report()
    assert report.probe("env").status == "error"
    assert report.probe("collectives").status == "pass"
    findings = report.probe("env").findings
    assert sorted(r for f in findings for r in f.ranks) == [0, 1]
    assert all("injected fault" in f.issue and f.severity == "error" for f in findings)


def test_rank_hangs_outside_collective(workdir):
    """Rank 1 sleeps forever in the probe: exit 3, named with the line it is at."""
    result = run_check(3, ARGS, workdir, inject="hang:collectives:1", timeout=60)
    assert result.codes == [3, 3, 3], result.stderr
    report = result.report()
    (f,) = _crit(report)
    assert f.ranks == [1] and "never entered all_reduce(sum)" in f.issue
    assert "faults.py" in f.issue and "time.sleep" in f.evidence
    rows = report.probe("collectives").details["table:ranks at the end"]
    assert [r["state"] for r in rows] == ["collective", "computing", "collective"]
    assert result.elapsed < T + 15


def test_hang_ends_the_run_and_lists_probes_not_run(workdir):
    """Once a rank hung, the group is unusable: later probes are listed as not run."""
    result = run_check(2, ARGS, workdir, inject="hang:env:0", timeout=60)
    assert result.codes == [3, 3], result.stderr
    report = result.report()
    assert report.not_run == ["collectives"]
    assert report.outcome == "hang"
    assert _crit(report)[0].ranks == [0]


def test_rank0_hangs_another_rank_writes(workdir):
    """Rank 0 is the stuck one: a rank that was only waiting writes the report and names rank 0."""
    result = run_check(3, ARGS, workdir, inject="hang:collectives:0", timeout=60)
    assert result.codes == [3, 3, 3], result.stderr
    report = result.report()
    assert report.written_by != 0
    assert _crit(report)[0].ranks == [0]
    assert "verdict: FAIL (exit 3)" in result.outcomes[report.written_by].stdout


def test_rank_killed_mid_probe(workdir):
    """SIGKILL of rank 2 mid-probe: the survivors exit 3 and the report names the lost rank."""
    result = run_check(3, ARGS, workdir, inject="kill:collectives:2:after=3", timeout=60)
    assert result.codes[2] == -9
    assert result.codes[:2] == [3, 3], result.stderr
    report = result.report()
    assert report.outcome == "lost_rank"
    lead = _crit(report)[0]
    assert lead.ranks == [2] and "is gone" in lead.issue
    # the lost rank's row carries the host and pid it checked in with, not '?'
    row = report.probe("collectives").details["table:ranks at the end"][2]
    assert (row["state"], row["host"], row["pid"]) == ("lost", report.ranks[2].host, report.ranks[2].pid), row
    assert report.ranks[2].pid > 0
    assert result.elapsed < T + 15


def test_rank_stopped_is_named_and_ended(workdir):
    """SIGSTOP of rank 1: it cannot answer; it is named as stopped and ended by pid."""
    result = run_check(2, ARGS, workdir, inject="stop:collectives:1:after=2", timeout=60)
    assert not result.timed_out, "the stopped rank should have been killed by distdiag"
    assert result.codes == [3, -9]
    lead = _crit(result.report())[0]
    assert lead.ranks == [1] and "stopped" in lead.issue


def test_skipped_collective_is_a_desync(workdir):
    """Rank 1 skips its 4th collective: the ranks end in different collectives; both are shown."""
    result = run_check(2, ARGS, workdir, inject="skip:collectives:1:after=4", timeout=60)
    assert result.codes == [3, 3]
    lead = _crit(result.report())[0]
    assert "desync" in lead.issue and "first divergence" in lead.evidence


def test_corrupted_result_names_rank_op_dtype(workdir):
    """A wrong all_reduce result on rank 1 is a failed probe (exit 1) naming rank, op, dtype, error."""
    result = run_check(2, ARGS, workdir, inject="corrupt:collectives:1:after=2", timeout=60)
    assert result.codes == [1, 1]
    report = result.report()
    (f,) = report.probe("collectives").findings
    assert f.ranks == [1] and f.issue == "all_reduce(max) on float32 returned wrong values on rank 1"
    assert "max abs error 1" in f.evidence and "got" in f.evidence


def test_whole_check_deadline(workdir):
    """--deadline-s bounds the whole check even when each probe is within its own deadline."""
    result = run_check(2, ["--probes", "env,collectives", "--timeout-s", "30", "--deadline-s", "2"], workdir,
                       inject="sleep:collectives:0:seconds=20", timeout=60)
    assert result.codes == [3, 3]
    assert result.report().outcome == "deadline"
    assert result.elapsed < 15


def test_target_fails_on_one_rank_only_every_rank_exits_2(workdir):
    """A target that fails to import on rank 1 only: every rank exits 2 with that line, no hang."""
    target = workdir / "t.py"
    target.write_text(
        "import os\n"
        "if os.environ['RANK'] == '1':\n"
        "    raise ImportError('no module named fancy_kernels on this node')\n"
        "def build_model():\n    pass\n"
    )
    result = run_check(2, ["--probes", "env", "--target", str(target)], workdir, timeout=60)
    assert result.codes == [2, 2]
    for outcome in result.outcomes:
        (line,) = outcome.stderr.strip().splitlines()
        assert "fancy_kernels" in line and "(on rank 1)" in line
    assert result.report().outcome == "bad_input"


def test_world_too_small_for_named_probe(workdir):
    """collectives asked by name in a world of 1: one line, exit 2."""
    result = run_check(1, ["--probes", "collectives"], workdir, timeout=60)
    assert result.codes == [2]
    assert "WORLD_SIZE must be >= 2 for probe 'collectives', got 1" in result.stderr
    assert "Traceback" not in result.stderr


def test_setup_failure_on_one_rank_is_reported_not_a_traceback(workdir):
    """Rank 1 fails while setting up its process group (an NCCL/device error on a real box):
    the others, blocked in init, end with a report naming rank 1 and its exception."""
    result = run_check(2, ARGS, workdir, inject="raise:setup:1", timeout=90)
    assert result.codes == [3, 3], result.stderr
    report = result.report()
    lead = _crit(report)[0] if _crit(report) else report.findings("error")[0][1]
    assert lead.ranks == [1] and "injected fault: raise in setup" in lead.issue
    assert report.not_run == ["env", "collectives"]


def test_rank_stopped_during_setup_is_reported_within_the_probe_deadline(workdir):
    """SIGSTOP just before the process group: setup is bounded by --timeout-s, not by a minute."""
    result = run_check(2, ARGS, workdir, inject="stop:setup:1", timeout=60)
    assert result.codes[0] == 3 and result.codes[1] == -9, (result.codes, result.stderr[-2000:])
    lead = _crit(result.report())[0]
    assert lead.ranks == [1] and "stopped" in lead.issue and "setup" in lead.issue
    assert result.elapsed < T + 15


def test_rank_that_dies_importing_the_target_is_reported_within_the_probe_deadline(workdir):
    """A target whose import kills rank 1 (SIGKILL, as a native crash): rank 0 reports it after --timeout-s."""
    target = str(__import__("pathlib").Path(__file__).parent / "targets" / "exit_at_import_on_rank1.py")
    result = run_check(2, [*ARGS, "--target", target], workdir, timeout=60)
    assert result.codes == [3, -9], (result.codes, result.stderr[-2000:])
    lead = _crit(result.report())[0]
    assert lead.ranks == [1] and "gone" in lead.issue
    assert result.elapsed < T + 15


@pytest.mark.parametrize("signum", [15, 2], ids=["SIGTERM", "SIGINT"])
def test_cancelled_run_is_reported_as_cancelled_blaming_nobody(workdir, signum):
    """Every rank gets the launcher's signal mid-probe (a cancelled job): no rank is blamed."""
    spec = "sleep:collectives:0:seconds=60;sleep:collectives:1:seconds=60"
    result = run_check(2, ["--probes", "env,collectives", "--timeout-s", "30"], workdir, inject=spec, timeout=60,
                       signal_after=(2.0, signum))
    assert result.codes == [130, 130], (result.codes, result.stderr[-2000:])  # EXIT_CANCELLED
    report = result.report()
    assert report.outcome == "cancelled" and report.exit_code == 130
    (lead,) = _crit(report)
    assert "cancelled" in lead.issue and lead.ranks == [] and "SIG" in lead.issue
    assert result.elapsed < 20


@pytest.mark.parametrize("action,word", [("stop", "stopped"), ("kill", "gone")])
def test_rank_stopped_or_killed_after_the_verdict_fails_the_report_and_leaves(workdir, action, word):
    """A rank stopped (or killed) as the verdict is written: the job still ends within seconds,
    a stopped rank is ended by pid, and the report does not pass."""
    result = run_check(2, ARGS, workdir, inject=f"{action}:final:1", timeout=60)
    assert not result.timed_out and result.codes == [3, -9], (result.codes, result.stderr[-2000:])
    report = result.report()
    assert report.exit_code == 3 and report.outcome == "lost_rank"
    lead = _crit(report)[0]
    assert lead.ranks == [1] and "did not leave after the verdict" in lead.issue and word in lead.issue
    assert report.probe("collectives").status == "pass"
    assert result.elapsed < 25


def test_library_exception_caught_on_one_rank_leads_and_names_the_stranded_ranks(workdir):
    """DCP's save raises inside torch's object collectives on rank 0 only; the probe catches it
    and goes on to its next collective while ranks 1-2 wait in DCP's scatter. The report leads
    with rank 0's exception, where in the library it was raised, and the ranks it stranded."""
    target = str(__import__("pathlib").Path(__file__).parent / "targets" / "object_decoding_fails_on_rank0.py")
    # 15 s: the probe's first import of DCP, FSDP2 and DTensor takes seconds on a loaded box.
    result = run_check(3, ["--probes", "checkpoint", "--timeout-s", "15", "--target", target], workdir, timeout=90)
    assert result.codes == [3, 3, 3], (result.codes, result.stderr[-2000:])
    report = result.report()
    lead = _crit(report)[0]
    assert lead.ranks == [0], lead.issue
    assert "RuntimeError: Numpy is not available" in lead.issue and "caught" in lead.issue
    assert "gather_object" in lead.issue or "gather_object" in lead.evidence
    assert "ranks 1,2 were left waiting in" in lead.issue or "ranks 1-2 were left waiting in" in lead.issue
    assert "numpy" in lead.fix
    assert result.elapsed < 15 + 25



def test_sys_exit_0_from_inside_the_run_is_not_a_passing_rank(cli_env, tmp_path):
    """sys.exit(0) raised inside the run (a user hook mid-probe; bare torchrun has no launcher to
    notice): the rank leaves with 3 and says why, never with the 0 that would pass for a verdict."""
    import subprocess
    import sys

    code = ("import distdiag.check.run as r\n"
            "def run_check(argv):\n    raise SystemExit(0)\n"
            "r.run_check = run_check\nr.main([])\n")
    out = subprocess.run([sys.executable, "-c", code], env=cli_env, cwd=tmp_path, capture_output=True, text=True,
                         timeout=60)
    assert out.returncode == 3, out.stderr[-2000:]
    assert "ended by sys.exit(0) from inside (the target?) before its verdict; exiting 3" in out.stderr
