#!/usr/bin/env python3
"""Production-shaped hangs the project was not written against, each with a healthy twin, run
black-box under `distdiag watch --timeout-s 5` (the distdiag of PYTHONPATH / the venv).

    PYTHONPATH=/path/to/checkout python tests/faults/prodhangs/run_corpus.py [WORD ...] [--keep DIR]

A fault case is RIGHT when the lead finding (first critical/error finding of hang-report.json)
names exactly the culprit ranks, with a cause in the expected family where one is given, within
the wall limit; a healthy twin is RIGHT when the job exits 0 and writes no report. One case at a
time (2 shared cores); each case gets a fresh temp dir and a hard 150 s wall limit, after which
the whole process tree (torchrun runs in a session of its own) is SIGKILLed.
"""
from __future__ import annotations

import json
import os
import shutil
import sys
import tempfile

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "..", ".."))
from tests.harness import run_within  # noqa: E402

HERE = os.path.dirname(os.path.abspath(__file__))
TIMEOUT_S = 5
LIMIT_S = 150

# cause families (None: any)
STALL = ("rank_behind", "stalled", "collective_stall")  # a rank stuck where it is
ODD = ("desync", "skipped_collective", "rank_behind", "left_early")  # a rank that issued an extra/missing op
LOST = ("lost", "process_gone")
RAISED = ("raised",)

# name, nproc, argv, truth (culprit ranks; None = healthy twin), causes accepted (None = any)
CASES = [
    ("pp hand-written send/recv, middle stage 1 of 3 stalls in compute", 3, ["pp_stall.py", "--mode", "fault"], [1], STALL),
    ("pp hand-written send/recv, last stage 3 of 4 stalls in compute", 4, ["pp_stall.py", "--mode", "fault", "--rank", "3"], [3], STALL),
    ("pp hand-written send/recv healthy", 3, ["pp_stall.py", "--mode", "healthy"], None, None),
    ("pp pipelining ScheduleGPipe, stage 1 of 3 stalls in forward", 3, ["pp_sched.py", "--mode", "fault"], [1], STALL),
    ("pp pipelining Schedule1F1B, stage 2 of 4 stalls in forward", 4, ["pp_sched.py", "--mode", "fault", "--sched", "1f1b", "--rank", "2"], [2], STALL),
    ("pp pipelining ScheduleGPipe healthy", 3, ["pp_sched.py", "--mode", "healthy"], None, None),
    ("pp isend/irecv, last stage 2 of 3 skips one grad send", 3, ["pp_skip_send.py", "--mode", "fault"], [2], ODD + ("deadlock",)),
    ("pp isend/irecv healthy", 3, ["pp_skip_send.py", "--mode", "healthy"], None, None),
    ("2-D mesh dp2 x tp2: tp-rank 3 alone all_reduces on its dp group", 4, ["mesh2d_extra.py", "--mode", "fault"], [3], ODD),
    ("2-D mesh dp2 x tp2: tp-rank 3 alone all_reduces a large flat copy on its dp group", 4, ["mesh2d_extra.py", "--mode", "fault_big"], [3], ODD),
    ("2-D mesh dp2 x tp2 healthy", 4, ["mesh2d_extra.py", "--mode", "healthy"], None, None),
    ("3-D mesh pp2 x dp1 x tp2: rank 2 stalls before its tp all_reduce", 4, ["mesh3d_stall.py", "--mode", "fault"], [2], STALL),
    ("3-D mesh pp2 x dp1 x tp2 healthy", 4, ["mesh3d_stall.py", "--mode", "healthy"], None, None),
    ("all_gather_object: only rank 0 of 3 logs metrics", 3, ["obj_coll.py", "--mode", "fault"], [0], ODD),
    ("broadcast_object_list: rank 2 of 3 skips the config broadcast", 3, ["obj_coll.py", "--mode", "fault_bcast"], [2], ODD),
    ("object collectives healthy", 3, ["obj_coll.py", "--mode", "healthy"], None, None),
    # members-only new_group: [0,1] on ranks 0-1 and [2,3] on ranks 2-3 get the same group name;
    # on torch 2.13 gloo the job sometimes finishes (then silence is right), sometimes hangs in
    # ProcessGroupGloo's rendezvous: then ranks 2-3, which skipped new_group([0,1]), are to blame
    ("new_group called only by ranks 0-1 of 4 (members only)", 4, ["newgroup.py", "--mode", "fault"], [2, 3], ODD, "quiet_ok"),
    ("new_group: last rank 3 of 4 creates overlapping groups in another order", 4, ["newgroup.py", "--mode", "fault_order"], [3], ODD),
    ("new_group healthy", 4, ["newgroup.py", "--mode", "healthy"], None, None),
    ("async all_reduce: rank 1 of 3 issues one fewer async op", 3, ["async_ops.py", "--mode", "fault"], [1], ODD),
    ("isend/irecv ring: last rank 2 of 3 skips its isend", 3, ["async_ops.py", "--mode", "fault_ring"], [2], ODD + ("deadlock",)),
    ("async ops healthy", 3, ["async_ops.py", "--mode", "healthy"], None, None),
    ("val loss by dist.reduce: only rank 0 of 4 takes `if val < best: save()` (save gathers)", 4, ["val_branch.py", "--mode", "fault"], [0], ("desync", "skipped_collective")),
    ("val loss all_reduced: every rank saves (healthy)", 4, ["val_branch.py", "--mode", "healthy"], None, None),
    ("DCP: only rank 0 of 2 calls dcp.save", 2, ["dcp_save.py", "--mode", "fault"], [0], ODD),
    ("DCP: rank 2 of 3 stalls in its storage writer", 3, ["dcp_save.py", "--mode", "fault_io"], [2], STALL),
    ("DCP save healthy", 3, ["dcp_save.py", "--mode", "healthy"], None, None),
    ("metric gather: rank 1 of 3 computed no metric and skips the sync", 3, ["metric_gather.py", "--mode", "fault"], [1], ODD),
    ("metric gather healthy", 3, ["metric_gather.py", "--mode", "healthy"], None, None),
    ("straggler: rank 2 of 3 is 3 s slower each step (no hang)", 3, ["straggler.py", "--mode", "healthy"], None, None),
    ("rank 2 of 4 SIGKILLed mid-training", 4, ["sigkill.py", "--mode", "fault"], [2], LOST),
    ("SIGKILL twin healthy", 4, ["sigkill.py", "--mode", "healthy"], None, None),
    ("every rank of 3 raises in a nested helper", 3, ["raise_nested.py", "--mode", "fault_all"], [0, 1, 2], RAISED),
    ("rank 1 of 3 raises in a nested helper", 3, ["raise_nested.py", "--mode", "fault", "--rank", "1"], [1], RAISED),
    ("raise twin healthy", 3, ["raise_nested.py", "--mode", "healthy"], None, None),
]


def run(cmd: list[str], cwd: str, limit: float) -> tuple[object, float]:
    return run_within(cmd, cwd, limit)


def findings(report: dict) -> list[dict]:
    return [f for p in report.get("probes", []) for f in p.get("findings", [])
            if f.get("severity") in ("critical", "error")]


def case(name, nproc, argv, truth, causes, *flags, keep=None) -> tuple[bool, str]:
    cwd = tempfile.mkdtemp(prefix="dd-prod-")
    cmd = [sys.executable, "-m", "distdiag", "watch", "--nproc-per-node", str(nproc), "--timeout-s", str(TIMEOUT_S),
           "--", os.path.join(HERE, argv[0])] + argv[1:]
    rc, secs = run(cmd, cwd, LIMIT_S)
    reports = [os.path.join(root, f) for root, _, fs in os.walk(cwd) for f in fs if f == "hang-report.json"]
    if keep:
        dst = os.path.join(keep, "".join(c if c.isalnum() else "_" for c in name)[:80])
        shutil.rmtree(dst, ignore_errors=True)
        shutil.copytree(cwd, dst)
    report = json.load(open(reports[0])) if reports else None
    shutil.rmtree(cwd, ignore_errors=True)
    if truth is None:
        ok = rc == 0 and not reports
        return ok, f"truth healthy | exit {rc} | {len(reports)} report(s) | {secs:.0f} s"
    if not reports:
        ok = "quiet_ok" in flags and rc == 0
        quiet = " (or quiet)" if "quiet_ok" in flags else ""
        return ok, f"truth {truth}{quiet} | no hang report | exit {rc} | {secs:.0f} s"
    lead = (findings(report) or [{}])[0]
    ranks = sorted(lead.get("ranks") or [])
    cause = lead.get("cause")
    ok = ranks == sorted(truth) and (causes is None or cause in causes) and rc != "timeout"
    return ok, f"truth {truth} | lead {ranks} {cause!r} | exit {rc} | {secs:.0f} s"


def main(argv: list[str]) -> int:
    keep = None
    if "--keep" in argv:
        i = argv.index("--keep")
        keep = argv[i + 1]
        argv = argv[:i] + argv[i + 2:]
        os.makedirs(keep, exist_ok=True)
    rows = []
    for c in CASES:
        if argv and not any(w.lower() in c[0].lower() or w == c[2][0] for w in argv):
            continue
        ok, what = case(*c, keep=keep)
        rows.append(ok)
        print(f"{'RIGHT' if ok else 'WRONG'}  {c[0]} ({c[1]} ranks): {what}", flush=True)
    print(f"prodhangs: {sum(rows)}/{len(rows)} right")
    return 0 if all(rows) else 1


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
