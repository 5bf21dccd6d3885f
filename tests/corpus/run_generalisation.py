"""Run the generalisation cases black-box and classify every answer; optionally the project's corpus too.

    python tests/corpus/run_generalisation.py                  # the new bug/twin pairs
    python tests/corpus/run_generalisation.py --blind          # the blind cases (written 2026-11-28, run once)
    python tests/corpus/run_generalisation.py --blind2         # the second blind set (written 2026-11-28, run once)
    python tests/corpus/run_generalisation.py --blind3         # the third blind set (outside tester, run once)
    python tests/corpus/run_generalisation.py --corpus         # also tests/corpus's own cases (calibration)
    python tests/corpus/run_generalisation.py --only a,b --json out.json

Each run is `python -m distdiag check --nproc-per-node W --probes P --target FILE` in a fresh
directory, under a hard limit (tests.harness.run_within kills it and everything it started). A bug
is *named* (a finding above info carries a cause of its mechanism), *located* (no such cause, but a
finding above info holds the words that place it: module, tensor, rank or hook) or *missed*; any
cause other than its own at confidence >= 0.8 is a wrong confident cause. A twin is quiet when
nothing above info comes from the probes it ran. --corpus adds every case of
tests/corpus/test_differential_corpus.py and test_setup_corpus.py (their expected cause is the right
one) so that the calibration table covers the whole corpus: per confidence band, how many causes
were named and how many of them were wrong.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import tempfile
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT))

from tests.corpus.generalisation import (  # noqa: E402
    BLIND,
    BLIND2,
    BLIND3,
    BLIND4,
    CASES,
    HELD_OUT,
    NEUTRAL,
    GenCase,
    band,
    classify_bug,
    findings_of,
    twin_loud,
)
from tests.harness import run_within  # noqa: E402

LIMIT_S = 240.0


def run_one(target: Path, probes: str, world: int, healthy: bool, env_extra: dict[str, str] | None = None,
            hosts: int = 1) -> dict[str, Any]:
    """One black-box check run: its exit code and the findings of the probes it ran."""
    with tempfile.TemporaryDirectory(prefix="distdiag-gen-") as cwd:
        env = dict(os.environ, PYTHONUNBUFFERED="1", PYTHONPATH=str(ROOT) + os.pathsep + os.environ.get("PYTHONPATH", ""))
        env.pop("DISTDIAG_TWIN", None)
        if healthy:
            env["DISTDIAG_TWIN"] = "healthy"
        env.update(env_extra or {})
        cmd = [sys.executable, "-m", "distdiag", "check", "--nproc-per-node", str(world), "--probes", probes,
               "--target", str(target), "--report", "report.json"]
        if hosts > 1:
            return {"rc": "skipped", "findings": [], "seconds": 0.0, "note": "needs pretend nodes (test harness only)"}
        rc, seconds = run_within(cmd, cwd, LIMIT_S, env=env)
        report = Path(cwd, "report.json")
        findings = findings_of(json.loads(report.read_text()), probes) if report.exists() else []
        tail = Path(cwd, "output.txt").read_text(errors="replace")[-600:] if not report.exists() else ""
        return {"rc": rc, "findings": findings, "seconds": round(seconds, 1), "tail": tail}


def gen_row(case: GenCase) -> dict[str, Any]:
    target = Path(__file__).resolve().parent / "gen_targets" / f"{case.target}.py"
    bug = run_one(target, case.probes, case.world, healthy=False)
    twin = run_one(target, case.probes, case.world, healthy=True)
    return {"case": case.target, "probes": case.probes, "mechanism": case.mechanism, "bug_rc": bug["rc"],
            "twin_rc": twin["rc"], **classify_bug(case, bug["findings"]), "twin_loud": twin_loud(twin["findings"]),
            "claims": _claims(bug["findings"], case.named + case.also_true) + _claims(twin["findings"], ()),
            "seconds": bug["seconds"] + twin["seconds"], "tail": bug.get("tail") or twin.get("tail")}


def _claims(findings: list[dict[str, Any]], right: tuple[str, ...]) -> list[dict[str, Any]]:
    """Each cause a finding above info names, with its confidence and whether it is the run's mechanism."""
    return [{"cause": f["cause"], "confidence": f.get("confidence"), "right": f["cause"] in right}
            for f in findings if f.get("cause") and f.get("severity") in ("warning", "error", "critical")
            and f["cause"] not in NEUTRAL]


CORPUS_SECONDARY = {
    # Other causes a corpus bug draws that are true of the same bug (not a competing mechanism): counted right.
    "diff:sp_loss_per_rank_mean": ("empty_shard_zero_division", "empty_batch_zero_division"),  # it has an empty shard
    "setup:dtype_one_rank": ("low_precision_master_weights", "mixed_precision_differs_across_ranks"),  # rank 1's head is fp16
}


def corpus_rows() -> list[dict[str, Any]]:
    """The project's own corpus cases: the expected cause is right, any other cause named is wrong."""
    from tests.corpus import test_differential_corpus as diff
    from tests.corpus import test_setup_corpus as setup

    jobs = []
    for c in diff.CASES:
        jobs.append((f"diff:{c.id}", diff.TARGETS / f"{c.target}.py", c.probe, c.world, c.cause, 1))
    for c in setup.CASES:
        jobs.append((f"setup:{c.target}", setup.TARGETS / f"{c.target}.py", ",".join(c.probes), c.world, c.cause, c.hosts))
    rows = []
    for name, target, probes, world, cause, hosts in jobs:
        if hosts > 1:
            continue  # pretend nodes exist only in the test harness
        bug = run_one(target, probes, world, healthy=False)
        twin = run_one(target, probes, world, healthy=True)
        rows.append({"case": name, "bug_rc": bug["rc"], "twin_rc": twin["rc"],
                     "claims": _claims(bug["findings"], (cause, *CORPUS_SECONDARY.get(name, ()))) + _claims(twin["findings"], ()),
                     "named": any(f.get("cause") == cause for f in bug["findings"]),
                     "twin_loud": twin_loud(twin["findings"]), "seconds": bug["seconds"] + twin["seconds"]})
    return rows


def calibration(rows: list[dict[str, Any]]) -> dict[str, dict[str, int]]:
    out: dict[str, dict[str, int]] = {}
    for row in rows:
        for claim in row["claims"]:
            b = out.setdefault(band(claim["confidence"]), {"claims": 0, "wrong": 0})
            b["claims"] += 1
            b["wrong"] += 0 if claim["right"] else 1
    return out


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--only", default="", help="comma-separated case names")
    ap.add_argument("--corpus", action="store_true", help="also run tests/corpus's own cases (for the calibration table)")
    ap.add_argument("--held-out", action="store_true", help="run the held-out cases (written after the rules) instead")
    ap.add_argument("--blind", action="store_true", help="run the blind cases (written 2026-11-28, run once) instead")
    ap.add_argument("--blind2", action="store_true", help="run the second blind set (written 2026-11-28, run once) instead")
    ap.add_argument("--blind3", action="store_true", help="run the third blind set (outside tester, run once) instead")
    ap.add_argument("--blind4", action="store_true", help="run the fourth blind set (second outside tester, run once) instead")
    ap.add_argument("--corpus-only", action="store_true", help="only tests/corpus's own cases")
    ap.add_argument("--jobs", "-j", type=int, default=1, help="cases run at once (each runs its bug, then its twin)")
    ap.add_argument("--json", default="", help="write every row here (atomically)")
    args = ap.parse_args(argv)
    only = {s for s in args.only.split(",") if s}
    pool_cases = BLIND4 if args.blind4 else BLIND3 if args.blind3 else BLIND2 if args.blind2 else BLIND if args.blind else HELD_OUT if args.held_out else CASES
    unknown = only - {c.target for c in pool_cases}
    if unknown:
        print(f"run_generalisation: unknown case(s) {', '.join(sorted(unknown))}", file=sys.stderr)
        return 2
    cases = [] if args.corpus_only else [c for c in pool_cases if not only or c.target in only]
    args.corpus = args.corpus or args.corpus_only
    with ThreadPoolExecutor(max(1, args.jobs)) as pool:
        rows = list(pool.map(gen_row, cases))
    for r in rows:
        twin = "quiet" if not r["twin_loud"] and r["twin_rc"] == 0 else f"WARNS {r['twin_loud']} rc={r['twin_rc']}"
        wrong = f" WRONG-HIGH {r['wrong_high']}" if r["wrong_high"] else ""
        print(f"{r['case']:28s} {r['outcome']:8s} rc={r['bug_rc']}{wrong}  twin {twin}  ({r['seconds']:.0f}s)")
        print(f"{'':28s} causes: {r['causes']}")
        if r.get("tail"):
            print(f"{'':28s} output: {r['tail'][-300:]!r}")
    n = len(rows) or 1
    named = sum(r["outcome"] == "named" for r in rows)
    located = sum(r["located"] or r["named"] for r in rows)
    missed = sum(r["outcome"] == "missed" for r in rows)
    wrong = sum(bool(r["wrong_high"]) for r in rows)
    loud = sum(bool(r["twin_loud"]) or r["twin_rc"] != 0 for r in rows)
    if rows:
        print(f"\n{n} cases: named {named}, located {located} (named or located), missed {missed}, "
              f"wrong cause at high confidence {wrong}; twins warning {loud}")
    all_rows = list(rows)
    if args.corpus:
        corpus = corpus_rows()
        for r in corpus:
            print(f"{r['case']:40s} named={r['named']} claims={[(c['cause'], c['confidence'], c['right']) for c in r['claims']]}"
                  f" twin={'quiet' if not r['twin_loud'] else r['twin_loud']}")
        all_rows += corpus
    print("\ncalibration (causes named above info, bug and twin runs):")
    for b, v in sorted(calibration(all_rows).items()):
        print(f"  {b:18s} {v['wrong']} wrong of {v['claims']} ({v['wrong'] / v['claims']:.0%})")
    if args.json:
        tmp = Path(args.json + ".tmp")
        tmp.write_text(json.dumps({"generalisation": rows, "corpus": all_rows[len(rows):],
                                   "calibration": calibration(all_rows)}, indent=1, default=str))
        os.replace(tmp, args.json)
    return 0


if __name__ == "__main__":
    sys.exit(main())
