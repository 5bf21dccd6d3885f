"""Who is blamed across groups: the multi-group corpus, precision and latency (issue 22).

    python benchmarks/bench_waitfor.py [--repeats 1] [--timeout-s 3] [--zero-code]

Runs each case of tests/faults/mesh_workers.py (and two 2-rank desyncs of
tests/faults/watchdog_workers.py) for real on gloo under the watchdog (in-code API through
tests/harness.py, or `torchrun -m distdiag.watch` with --zero-code) and reads the report:

- culprit named: the lead (first critical) finding's ranks are exactly the expected culprits;
- stranded blamed: ranks outside the expected culprits that any critical/error/warning
  finding names (the wait-for graph must list them as stranded, never as culprits);
- twins silent: the healthy twin exits 0 with no report;
- latency: the fault's start (the worker's `hang_started` stamp) -> report on disk, minus the
  timeout (for a raise: after the raise itself).
"""

from __future__ import annotations

import argparse
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

MESH = "tests.faults.mesh_workers:train"
PLAIN = "tests.faults.watchdog_workers:train"
CASES = [
    # name, world, entry, words, expected culprits (None: a twin), raised (latency from the raise)
    # (the 2-rank desyncs run with the wrappers: tests/faults/test_multigroup_hangs.py says why)
    ("tp x dp 2x2, rank 3 stalls before the TP all-reduce", 4, MESH, ["kind=tpdp", "fault=stall", "rank=3"], [3], False),
    ("ep x dp 2x2, rank 3 stalls before the expert all_to_all", 4, MESH, ["kind=epdp", "fault=stall", "rank=3"], [3], False),
    ("pp x dp, last stage 1 stalls in its loss (send/recv)", 4, MESH, ["kind=pp", "fault=stall", "rank=1"], [1], False),
    ("tp x pp x dp 2x2x2 (8 ranks), last stage 5 stalls in its loss", 8, MESH, ["kind=3d", "fault=stall", "rank=5"], [5], False),
    ("3 groups issued in opposite order (deadlock)", 3, MESH, ["kind=cycle", "fault=deadlock", "rank=0"], [0, 1, 2], False),
    ("tp x dp, rank 3 raises between its groups", 4, MESH, ["kind=tpdp", "fault=raise", "rank=3"], [3], True),
    # gloo tells its group partners at once (a closed connection): no timeout to wait, like a raise
    ("tp x dp, rank 3 SIGKILLed in its data loader", 4, MESH, ["kind=tpdp", "fault=kill", "rank=3"], [3], True),
    ("2 ranks, rank 1 all_gather where it all-reduced", 2, PLAIN, ["fault=op_mismatch", "rank=1", "step=3", "steps=8", "wrap=1"], [1], False),
    ("2 ranks, rank 1 skips an all_reduce", 2, PLAIN, ["fault=skip", "rank=1", "step=3", "steps=8", "wrap=1"], [1], False),
    ("2 ranks, uneven data, short rank then barriers", 2, MESH, ["kind=uneven", "fault=uneven", "rank=1"], [1], False),
    ("2 ranks, every rank raises", 2, MESH, ["kind=uneven", "fault=raise", "rank=all"], [0, 1], True),
    ("twin: tp x dp 2x2", 4, MESH, ["kind=tpdp", "steps=6"], None, False),
    ("twin: ep x dp 2x2", 4, MESH, ["kind=epdp", "steps=6"], None, False),
    ("twin: pp x dp", 4, MESH, ["kind=pp", "steps=6"], None, False),
    ("twin: tp x pp x dp 2x2x2", 8, MESH, ["kind=3d", "steps=6"], None, False),
    ("twin: 3 groups", 3, MESH, ["kind=cycle", "steps=6"], None, False),
    ("twin: even data", 2, MESH, ["kind=uneven"], None, False),
]


def _run(world: int, entry: str, words: list[str], tmp: Path, timeout_s: float, zero_code: bool) -> list[int | None]:
    words = [*words, f"timeout={timeout_s:g}"]
    if not zero_code:
        from tests.harness import run_ranks

        return run_ranks(world, words, tmp, entry=entry, timeout=90).codes
    script = ROOT / "tests" / "faults" / (entry.split(":")[0].rsplit(".", 1)[1] + ".py")
    cmd = [sys.executable, "-m", "torch.distributed.run", "--nproc-per-node", str(world), "--standalone", "-m",
           "distdiag.watch", "--timeout-s", f"{timeout_s:g}", "--", str(script), *words]
    env = {**os.environ, "PYTHONPATH": str(ROOT)}
    proc = subprocess.run(cmd, cwd=tmp, env=env, capture_output=True, text=True, timeout=120)
    return [proc.returncode]


def _measure(case: tuple, timeout_s: float, zero_code: bool) -> dict:
    from distdiag.report.model import read_report

    name, world, entry, words, expected, raised = case
    with tempfile.TemporaryDirectory() as tmp:
        codes = _run(world, entry, words, Path(tmp), timeout_s, zero_code)
        report = Path(tmp) / "hang-report" / "hang-report.json"
        if expected is None:
            return {"name": name, "silent": not report.exists() and set(codes) == {0}}
        if not report.exists():
            return {"name": name, "named": False, "wrong": "no report", "latency": None}
        probe = read_report(report).probe("watchdog")
        crit = [f for f in probe.findings if f.severity == "critical"]
        lead = crit[0].ranks if crit else []
        blamed = {r for f in probe.findings if f.severity in ("critical", "error", "warning") for r in f.ranks}
        stamp = Path(tmp) / "hang_started"  # watchdog_workers.py stamps only its blocking faults
        latency = None
        if stamp.exists():
            latency = os.path.getmtime(report) - float(stamp.read_text()) - (0 if raised else timeout_s)
        named = sorted(lead) == expected or (raised and set(lead) and set(lead) <= set(expected))
        return {"name": name, "named": bool(named), "wrong": sorted(blamed - set(expected)), "latency": latency}


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--repeats", type=int, default=1)
    parser.add_argument("--timeout-s", type=float, default=3.0)
    parser.add_argument("--zero-code", action="store_true", help="torchrun -m distdiag.watch instead of the in-code API")
    args = parser.parse_args()
    print("| case | culprit named | stranded ranks blamed | report latency (s) |")
    print("|---|---|---|---|")
    twins = []
    started = time.monotonic()
    for case in CASES:
        if args.zero_code and case[2] == PLAIN:
            continue  # watchdog_workers.py has no script form (it is a harness entry only)
        rows = [_measure(case, args.timeout_s, args.zero_code) for _ in range(args.repeats)]
        if case[4] is None:
            twins.append(all(r["silent"] for r in rows))
            print(f"| {case[0]} | - | - | silent: {sum(r['silent'] for r in rows)}/{len(rows)} |")
            continue
        named = sum(r["named"] for r in rows)
        wrong = sorted({w for r in rows for w in (r["wrong"] if isinstance(r["wrong"], list) else [r["wrong"]])}, key=str)
        lat = sorted(r["latency"] for r in rows if r["latency"] is not None)
        after = "after the raise" if case[5] else "after the timeout"
        lat_text = f"{lat[len(lat) // 2]:.2f} {after}" if lat else "-"
        print(f"| {case[0]} | {named}/{len(rows)} | {', '.join(map(str, wrong)) or 'none'} | {lat_text} |")
    print(f"\ntwins silent: {sum(twins)}/{len(twins)}; wall {time.monotonic() - started:.0f}s")
    return 0


if __name__ == "__main__":
    sys.exit(main())
