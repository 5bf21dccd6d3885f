#!/usr/bin/env python3
"""The trainer matrix: real trainers (tests/trainers/*.py), one injected fault each, judged on the
hang report the way a user would read it.

    python benchmarks/trainer_matrix.py                      # every case (about an hour on 2 cores)
    python benchmarks/trainer_matrix.py fsdp2 short          # cases whose name holds every word
    python benchmarks/trainer_matrix.py --list hf            # print the chosen cases, run nothing
    python benchmarks/trainer_matrix.py lightning --markdown matrix.md --results matrix.jsonl

Each case runs in a fresh temp dir under `distdiag watch --nproc-per-node N --timeout-s 10 --
SCRIPT --mode M` (or plain torchrun for the callback trainer, whose script arms DistdiagCallback),
one case at a time, with a hard wall limit (the whole process group and every descendant seen is
killed at the limit). A case name is `TRAINER FAULT n=N r=R` (R: the culprit rank, `all`, or `-`
for a healthy twin); the words select cases by substring, all words must match.

A verdict is RIGHT when
- a fault: the lead finding (the report's first critical/error finding) names exactly the truth
  ranks, with cause uneven_data for short data, raised for raise1/raiseall, and any cause but
  uneven_data for branch/stall/iostall/kill;
- a healthy twin (healthy, slowval, slowlog, slowckpt: rank 0 slow ~6 s in a 10 s timeout): the
  job exits 0 and writes no hang report.
Printed per case: trainer, fault, ranks, truth, lead ranks, cause, exit, seconds from the fault
(the earliest `FAULT <time>` line the scripts append to the file named in env STAMPS) to the
report's mtime, RIGHT/WRONG, and how many ranks outside the truth the critical/error findings
name ("stranded blamed"). --results appends one JSON line per case (with the lead's issue text).
"""
from __future__ import annotations

import argparse
import json
import os
import shutil
import sys
import tempfile
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
from tests.harness import run_within  # noqa: E402

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
TRAINERS_DIR = os.path.join(ROOT, "tests", "trainers")
TIMEOUT_S = 10

# trainer -> (script, extra args, launcher). "watch": distdiag watch; "torchrun": the script arms
# the integration callback itself.
TRAINERS = {
    "fsdp2": ("fsdp_train.py", [], "watch"),
    "lightning": ("pl_train.py", [], "watch"),
    "accelerate": ("acc_train.py", [], "watch"),
    "hf": ("hf_train.py", [], "watch"),
    "lightning-cb": ("pl_train.py", ["--callback", "--dd-timeout", str(TIMEOUT_S)], "torchrun"),
    "deepspeed": ("ds_train.py", [], "watch"),
}
NEEDS = {"lightning": "lightning", "lightning-cb": "lightning", "accelerate": "accelerate", "hf": "transformers",
         "deepspeed": "deepspeed"}
"""trainer -> the library its script imports: a trainer whose library is not installed is skipped
with that reason, not counted as a wrong verdict (its script fails at import in seconds)."""
FAULTS = ("branch", "stall", "iostall", "raise1", "raiseall", "kill")
TWINS = ("healthy", "slowval", "slowlog", "slowckpt")
CHEAPEST = "fsdp2"


def short_positions(n: int) -> list[int]:
    """First, middle and last rank (deduplicated)."""
    return sorted({0, n // 2, n - 1})


def fault_rank(fault: str, n: int) -> int:
    if fault == "branch" and n == 2:
        return 0  # the classic: only the main process takes the branch
    return n // 2


def cases() -> list[dict]:
    out = []

    def add(trainer, fault, n, truth, argv):
        script, extra, how = TRAINERS[trainer]
        r = "-" if truth is None else ("all" if fault == "raiseall" else ",".join(map(str, truth)))
        out.append({"name": f"{trainer} {fault} n={n} r={r}", "trainer": trainer, "fault": fault, "n": n,
                    "truth": truth, "how": how, "argv": [os.path.join(TRAINERS_DIR, script), "--mode", fault] + argv + extra})

    for trainer in TRAINERS:
        cb = trainer.endswith("-cb")
        for n in ((2, 4) if cb else (2, 3, 4, 8) if trainer == CHEAPEST else (2, 3, 4)):
            for r in ([n - 1] if cb else short_positions(n)):
                add(trainer, "short", n, [r], ["--short-rank", str(r)])
        for fault in (("stall", "branch") if cb else FAULTS):
            for n in ((2,) if cb else (2, 4)):
                truth = list(range(n)) if fault == "raiseall" else [fault_rank(fault, n)]
                add(trainer, fault, n, truth, ["--fault-rank", str(truth[0])])
        for twin in TWINS:
            add(trainer, twin, 2, None, [])
    return out


def run(cmd: list[str], cwd: str, env: dict, limit: float) -> tuple[object, float]:
    """Run cmd in its own session in cwd; at the limit kill its group and every descendant seen."""
    return run_within(cmd, cwd, limit, env=env, over="limit")


def lead_and_blamed(report: dict) -> tuple[dict, set[int]]:
    bad = [f for p in report.get("probes", []) for f in p.get("findings", []) if f.get("severity") in ("critical", "error")]
    return (bad[0] if bad else {}), {r for f in bad for r in (f.get("ranks") or [])}


def judge(case: dict, rc: object, report: dict | None) -> tuple[bool, dict]:
    truth, fault = case["truth"], case["fault"]
    if truth is None:
        return rc == 0 and report is None, {}
    if report is None:
        return False, {}
    lead, blamed = lead_and_blamed(report)
    ranks, cause = sorted(lead.get("ranks") or []), lead.get("cause") or ""
    if fault == "short":
        cause_ok = cause == "uneven_data"
    elif fault in ("raise1", "raiseall"):
        cause_ok = cause == "raised"
    else:
        cause_ok = cause != "uneven_data"
    return ranks == sorted(truth) and cause_ok, {"lead": lead, "blamed": sorted(blamed)}


def run_case(case: dict, limit: float, keep: bool) -> dict:
    cwd = tempfile.mkdtemp(prefix="dd-matrix-")
    stamps = os.path.join(cwd, "stamps.txt")
    env = dict(os.environ, PYTHONUNBUFFERED="1", STAMPS=stamps, OMP_NUM_THREADS="1",
               PYTHONPATH=ROOT + os.pathsep + os.environ.get("PYTHONPATH", ""))
    env.pop("DISTDIAG_INJECT", None)
    n = str(case["n"])
    if case["how"] == "watch":
        cli = [sys.executable, "-c", "import sys; from distdiag.cli import main; sys.argv[0] = 'distdiag'; sys.exit(main())"]
        cmd = cli + ["watch", "--nproc-per-node", n, "--timeout-s", str(TIMEOUT_S), "--"] + case["argv"]
    else:
        cmd = [sys.executable, "-m", "torch.distributed.run", "--nproc-per-node", n] + case["argv"]
    rc, secs = run(cmd, cwd, env, limit)
    paths = [os.path.join(r, f) for r, _, fs in os.walk(cwd) for f in fs if f == "hang-report.json"]
    report = None
    if paths:
        try:
            report = json.load(open(paths[0]))
        except ValueError:
            report = {}
    ok, got = judge(case, rc, report)
    faults = []
    if os.path.exists(stamps):
        faults = [float(line.split()[1]) for line in open(stamps) if line.startswith("FAULT ")]
    to_report = round(os.path.getmtime(paths[0]) - min(faults), 1) if paths and faults else None
    lead = got.get("lead") or {}
    truth = case["truth"]
    row = {
        "name": case["name"], "trainer": case["trainer"], "fault": case["fault"], "n": case["n"],
        "truth": truth, "lead_ranks": sorted(lead.get("ranks") or []) if report is not None else None,
        "cause": lead.get("cause") or "" if report is not None else None, "exit": rc, "wall_s": round(secs, 1),
        "fault_to_report_s": to_report, "right": ok,
        "stranded_blamed": len(set(got.get("blamed", [])) - set(truth or [])) if report is not None else None,
        "what": lead.get("what") or lead.get("issue") or "", "reports": len(paths), "dir": cwd,
    }
    if not keep and ok:
        shutil.rmtree(cwd, ignore_errors=True)
        row["dir"] = None
    return row


def fmt(v) -> str:
    if v is None:
        return "-"
    if isinstance(v, list):
        return "[" + ",".join(map(str, v)) + "]"
    return str(v)


COLUMNS = ("trainer", "fault", "n", "truth", "lead_ranks", "cause", "exit", "fault_to_report_s", "right", "stranded_blamed")
HEAD = ("trainer", "fault", "N", "truth", "lead ranks", "cause", "exit", "s fault->report", "verdict", "stranded blamed")


def line(row: dict) -> str:
    vals = [fmt(row[c]) if c != "right" else ("RIGHT" if row[c] else "WRONG") for c in COLUMNS]
    if row["truth"] is None:
        vals[3] = "healthy"
    return vals


def markdown(rows: list[dict]) -> str:
    out = ["| " + " | ".join(HEAD) + " |", "|" + "---|" * len(HEAD)]
    out += ["| " + " | ".join(line(r)) + " |" for r in rows]
    right = sum(r["right"] for r in rows)
    out.append("")
    out.append(f"{right}/{len(rows)} right")
    return "\n".join(out) + "\n"


def main(argv: list[str]) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("words", nargs="*", help="run the cases whose name holds every word")
    ap.add_argument("--list", action="store_true", help="print the chosen cases and exit")
    ap.add_argument("--limit-s", type=float, default=150, help="hard wall limit per case")
    ap.add_argument("--markdown", help="write the table as markdown to this file")
    ap.add_argument("--results", help="append one JSON line per case to this file")
    ap.add_argument("--skip-done", action="store_true", help="skip the cases --results already holds")
    ap.add_argument("--keep", action="store_true", help="keep every case's temp dir (else only WRONG ones)")
    a = ap.parse_args(argv)
    chosen = [c for c in cases() if all(w.lower() in c["name"].lower() for w in a.words)]
    done = {}
    if a.results and os.path.exists(a.results):
        for ln in open(a.results):
            if ln.strip():
                r = json.loads(ln)
                done[r["name"]] = r
    if a.list:
        for c in chosen:
            print(c["name"], "(done)" if c["name"] in done else "")
        return 0
    import importlib.util

    missing = {t: lib for t, lib in NEEDS.items() if importlib.util.find_spec(lib) is None}
    skipped = [c for c in chosen if c["trainer"] in missing]
    for trainer in sorted({c["trainer"] for c in skipped}):
        n = sum(c["trainer"] == trainer for c in skipped)
        print(f"skipped: {n} {trainer} case(s): {missing[trainer]} is not installed (pip install {missing[trainer]})", flush=True)
    chosen = [c for c in chosen if c["trainer"] not in missing]
    rows = []
    print("  ".join(HEAD), flush=True)
    for c in chosen:
        if a.skip_done and c["name"] in done:
            rows.append(done[c["name"]])
            continue
        row = run_case(c, a.limit_s, a.keep)
        rows.append(row)
        print("  ".join(line(row)), f"({row['wall_s']} s)", "" if row["right"] else f"dir {row['dir']}", flush=True)
        if a.results:
            with open(a.results, "a") as f:
                f.write(json.dumps(row) + "\n")
        if a.markdown:
            open(a.markdown, "w").write(markdown(rows))
    if a.markdown:
        open(a.markdown, "w").write(markdown(rows))
    print(f"matrix: {sum(r['right'] for r in rows)}/{len(rows)} right"
          + (f" ({len(skipped)} skipped: a trainer's library is not installed)" if skipped else ""), flush=True)
    return 0 if all(r["right"] for r in rows) else 1


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
