"""What a program reads of a report: the versions that wrote it, structured fields beside the
sentences, host lists a scheduler reads, and the published JSON Schema."""

from __future__ import annotations

import json
import subprocess
import sys

from distdiag.report.model import Finding, ProbeResult, Report, read_report, write_report


def _report() -> Report:
    return Report(world_size=2, probes=[ProbeResult.from_findings("p", [Finding("warning", "x", ranks=[1])])])


def test_versions_at_the_top_level(tmp_path) -> None:
    import torch

    import distdiag

    data = _report().to_dict()
    assert data["distdiag_version"] == distdiag.__version__
    assert data["torch_version"] == torch.__version__
    path = write_report(_report(), tmp_path / "r.json")
    back = read_report(path)
    assert (back.distdiag_version, back.torch_version) == (distdiag.__version__, torch.__version__)


def test_an_old_report_reads_back_without_versions(tmp_path) -> None:
    data = _report().to_dict()
    del data["distdiag_version"], data["torch_version"]
    (tmp_path / "old.json").write_text(json.dumps(data))
    back = read_report(tmp_path / "old.json")
    assert back.to_dict()["distdiag_version"] == "" and back.to_dict()["torch_version"] == ""


def test_torch_version_without_importing_torch() -> None:
    code = ("import sys; from distdiag.report.model import Report; "
            "v = Report(world_size=1).torch_version; print(v, 'torch' in sys.modules)")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=60, check=True).stdout
    version, imported = out.split()
    assert version and imported == "False"


def _expand(hostlist: str) -> list[str]:
    """What `scontrol show hostnames` prints for a hostlist (its grammar as we write it)."""
    import re

    names = []
    for item in re.findall(r"[^,\[]+(?:\[[^\]]*\])?|\[[^\]]*\]", hostlist):
        item = item.lstrip(",")
        m = re.fullmatch(r"(.*)\[(.*)\]", item)
        if m is None:
            names.append(item)
            continue
        for part in m.group(2).split(","):
            lo, _, hi = part.partition("-")
            for n in range(int(lo), int(hi or lo) + 1):
                names.append(f"{m.group(1)}{n:0{len(lo)}d}")
    return names


def test_slurm_hostlist_on_tricky_names() -> None:
    from distdiag.report.render import slurm_hostlist

    assert slurm_hostlist(["node0005", "node0006", "node0007", "node0127"]) == "node[0005-0007,0127]"
    assert slurm_hostlist(["node0003"]) == "node0003"
    assert slurm_hostlist([]) == ""
    # zero padding: a padded and an unpadded number of another width never share a range
    assert slurm_hostlist(["node08", "node9", "node10", "node11"]) == "node9,node[08,10-11]"
    assert slurm_hostlist(["n1", "n01", "n001", "n2"]) == "n[1-2],n01,n001"
    # mixed prefixes, non-numeric names, a digit inside the name, duplicates
    hosts = ["gpu-a100-03", "gpu-a100-04", "cpu7", "login", "node0001", "node0001", "a1b2", "a1b3"]
    assert slurm_hostlist(hosts) == "a1b[2-3],cpu7,gpu-a100-[03-04],login,node0001"
    # a name a hostlist would misread is written as it is
    assert slurm_hostlist(["x[1]"]) == "x[1]"
    regular = [f"node{i:04d}" for i in range(4, 2048, 4)]
    for case in (["node0005", "node0006", "node0007", "node0127"], ["node08", "node9", "node10", "node11"],
                 ["n1", "n01", "n001", "n2"], hosts[:-2], regular):
        assert sorted(_expand(slurm_hostlist(case))) == sorted(set(case)), case


def test_host_sets_shown_beside_the_short_form() -> None:
    from distdiag.report.model import RankInfo
    from distdiag.report.render import hosts_text, render_report

    assert hosts_text(["node0004", "node0005"]) == "node[0004-0005]"
    assert hosts_text([f"node{i:04d}" for i in range(4, 40, 4)]) == (
        "node[0004-0036 step 4] (Slurm hostlist: node[0004,0008,0012,0016,0020,0024,0028,0032,0036])")
    ranks = [RankInfo(r, f"node{4 * (r // 2):04d}", r // 2, r % 2, "cpu", 100 + r) for r in range(16)]
    finding = Finding("error", "x", ranks=[1, 3, 5, 7, 9, 11])
    report = Report(world_size=16, ranks=ranks, probes=[ProbeResult.from_findings("p", [finding])])
    text = render_report(report)
    assert "      on 6 hosts: node[0000-0020 step 4] (Slurm hostlist: node[0000,0004,0008,0012,0016,0020])" in text, text
    assert report.to_dict()["hostlist"] == "node[0000,0004,0008,0012,0016,0020,0024,0028]"


def test_text_fits_the_width_and_no_line_ends_in_a_space(monkeypatch):
    from distdiag.report.model import RankInfo
    from distdiag.report.render import render_report, terminal_width

    monkeypatch.delenv("COLUMNS", raising=False)
    assert terminal_width() == 100  # not a terminal: the fallback
    monkeypatch.setenv("COLUMNS", "72")
    assert terminal_width() == 72
    long = "a very long sentence " * 12
    probe = ProbeResult.from_findings("env", [Finding("error", long, evidence=long + "\n" + long, ranks=[1], fix=long)],
                                      details={"table:t": [{"rank": 1, "what": long, "where": "/x/" * 40}]},
                                      reason=long)
    report = Report(world_size=2, probes=[probe], ranks=[RankInfo(r, "h", 0, r, "cpu", 1) for r in range(2)],
                    exit_code=1, verdict="fail", summary=long, notes=[long])
    for width in (60, 72, 100, 140):
        text = render_report(report, width=width)
        lines = text.splitlines()
        assert all(len(ln) <= width for ln in lines), [ln for ln in lines if len(ln) > width]
        assert all(ln == ln.rstrip() for ln in lines)
        assert lines[-1].startswith("verdict: FAIL (exit 1) - a very long") and lines[-1].endswith("...")
    assert len(render_report(report).splitlines()[0]) <= 72  # COLUMNS
    narrow = render_report(report, width=40, exit_code=0).splitlines()[-1]
    assert narrow.startswith("verdict: FAIL (exit 0 with --exit-zero; the verdict's code is 1) - a very")


def test_text_stacks_leave_out_distdiag_and_runpy_frames_json_keeps_them():
    from distdiag.hang.views import _runner
    from distdiag.report.render import render_report, runner_frame

    stack = [
        "rank 1 main-thread stack (innermost last):",
        "<frozen runpy>:198 in _run_module_as_main",
        "/usr/lib/python3.12/runpy.py:88 in _run_code: exec(code, run_globals)",
        "/venv/lib/python3.12/site-packages/distdiag/watch.py:290 in main: runpy.run_path(script)",
        "/job/train.py:40 in <module>: main()",
        "/venv/lib/python3.12/site-packages/distdiag/probes/cluster/collectives.py:168 in run: x = make(1)",
        "/job/data.py:58 in next_batch: return next(self.iterator)",
        "Traceback (most recent call last):",
        '  File "/venv/lib/python3.12/site-packages/distdiag/watch.py", line 290, in main',
        "    runpy.run_path(script)",
        '  File "/job/train.py", line 40, in <module>',
        "    main()",
    ]
    finding = Finding("critical", "rank 1 is at /job/data.py:58", evidence="\n".join(stack), ranks=[1])
    report = Report(world_size=2, probes=[ProbeResult.from_findings("watchdog", [finding])], exit_code=3, verdict="fail")
    text = render_report(report, width=200)
    assert "runpy.py" not in text and "<frozen runpy>" not in text and "run_path" not in text, text
    assert "distdiag/watch.py" not in text, text
    assert "/job/train.py:40 in <module>" in text and "/job/data.py:58 in next_batch" in text
    assert "collectives.py:168" in text  # a check's probe: where a rank is, kept
    assert '  File "/job/train.py", line 40, in <module>' in text and "    main()" in text
    assert "(4 frame(s) of distdiag's runner and runpy left out; the JSON report has them)" in text
    assert report.to_dict()["probes"][0]["findings"][0]["evidence"] == "\n".join(stack)
    for path in ("/x/site-packages/distdiag/watch.py", "/usr/lib/python3.12/runpy.py", "/job/train.py",
                 "/x/distdiag/probes/cluster/env.py", "/x/distdiag/runtime/comm.py", "/x/distdiag/runtime/sentinel.py"):
        assert runner_frame(path) == _runner(path), path  # the same frames as the hang analysis leaves out
