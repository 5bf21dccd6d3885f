"""Hang analysis at scale: synthetic incidents of 1k-16k ranks (issue 22 item 4, issue 21 item 6).

    python benchmarks/bench_hang_scale.py [--ranks 1024 4096 16384] [--kind stall|stage|host|all] [--json]

A TP=8 x PP=4 x DP job, 8 ranks per host (tests/unit/hang_incident.py builds every rank's
snapshot in the shape the watchdog writer gathers them): `stall` - rank 3 computes in
load_next_microbatch outside any collective; `stage` - rank 27, in the last pipeline stage,
does; `host` - host node0001 (ranks 8-15) is lost. For each N it runs the writer's path
(distdiag/watchdog/writer.py: analyse, the details, the report, its JSON and its text) and
prints:
  analysis s  - analyze_hang alone (best of --repeats), the target is <= 2 s at 16k; in
                parentheses the process's CPU time (what counts on a shared, loaded machine);
  writer s    - the whole path above once (and its CPU time): the snapshots typed once, the
                contradiction check, the excuse, the analysis, the details, the report's JSON
                and its text, the collector held off as the writer does (gather_and_write);
  peak MB     - tracemalloc's peak over the writer's path (a second run: tracemalloc slows it);
  report KB   - the JSON report's size; lines - the text report's lines; culprit - the lead
  critical finding's ranks; shapes - lines of the stranded finding.
Pure Python, no processes, no torch.
"""

from __future__ import annotations

import argparse
import json
import sys
import time
import tracemalloc
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

KINDS = {"stall": ("stall", 0), "stage": ("stall", 3), "host": ("host", 1)}


def _writer_path(snaps: dict, lost: dict, world: int) -> tuple[object, str, str]:
    """What gather_and_write does once the snapshots are in (distdiag/watchdog/writer.py):
    type them once, look for contradicting ones, the excuse, the analysis and the details,
    the report, its JSON (once) and its text, with Python's cyclic collector held off as the
    writer holds it; (findings, the JSON, the text)."""
    from distdiag.hang import ensure_critical
    from distdiag.report.model import EXIT_HANG, ProbeResult, RankInfo, Report, verdict_for
    from distdiag.runtime.gcpause import collector_paused
    from distdiag.watchdog.writer import (
        _outcome,
        _summary,
        analyse_and_detail,
        excused,
        inconsistent_ranks,
        render_hang_report,
        typed_snapshots,
    )

    event = {"kind": "timeout", "rank": 0, "detail": "no progress for 60s"}
    with collector_paused():  # as gather_and_write holds the collector off
        records = typed_snapshots(snaps)
        assert not inconsistent_ranks(records) and excused(event, records) is None
        findings, details = analyse_and_detail(event, snaps, lost, {}, world, 60.0, records=records)
        ensure_critical(findings, "no progress", "-", "-")
        result = ProbeResult.from_findings("watchdog", findings, details=details, duration_s=0.0)
        ranks = [RankInfo(r, f"node{r // 8:04d}", r // 8, r % 8, f"cuda:{r % 8}", 10000 + r % 8) for r in range(world)]
        report = Report(world_size=world, probes=[result], ranks=ranks, exit_code=EXIT_HANG,
                        verdict=verdict_for(EXIT_HANG, [result]), outcome=_outcome(event, lost),
                        summary=_summary(findings), written_by=0)
        return findings, report.to_json(), render_hang_report(report)


def measure(world: int, kind: str, repeats: int) -> dict:
    from distdiag.hang import analyze_hang
    from tests.unit.hang_incident import incident

    what, stage = KINDS[kind]
    snaps, lost = incident(world, what, stage)
    best = cpu = float("inf")
    for _ in range(repeats):
        t0, c0 = time.perf_counter(), time.process_time()
        analyze_hang(snaps, lost, {}, world, what="step 42", timeout_s=60.0)
        best, cpu = min(best, time.perf_counter() - t0), min(cpu, time.process_time() - c0)
    t0, c0 = time.perf_counter(), time.process_time()
    findings, text_json, text = _writer_path(snaps, lost, world)
    writer_s, writer_cpu = time.perf_counter() - t0, time.process_time() - c0
    tracemalloc.start()
    _writer_path(snaps, lost, world)
    _cur, peak = tracemalloc.get_traced_memory()
    tracemalloc.stop()
    lead = next((f for f in findings if f.severity == "critical"), None)
    stranded = next((f for f in findings if "stranded, not at fault" in f.issue), None)
    return {
        "ranks": world, "kind": kind, "analysis_s": round(best, 3), "analysis_cpu_s": round(cpu, 3),
        "writer_s": round(writer_s, 3), "writer_cpu_s": round(writer_cpu, 3),
        "peak_mb": round(peak / 2**20, 1), "report_kb": round(len(text_json.encode()) / 1024, 1),
        "lines": len(text.splitlines()), "culprit": lead.ranks if lead else None,
        "shapes": len(stranded.evidence.splitlines()) if stranded else 0,
    }


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--ranks", type=int, nargs="+", default=[1024, 4096, 16384])
    parser.add_argument("--kind", choices=[*KINDS, "all"], default="all")
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--json", action="store_true", help="one JSON object per line instead of the table")
    args = parser.parse_args()
    kinds = list(KINDS) if args.kind == "all" else [args.kind]
    if not args.json:
        print("| N | incident | analysis s (CPU s) | writer s (CPU s) | peak MB | report KB | text lines | culprit | shape lines |")
        print("|---|---|---|---|---|---|---|---|---|")
    for world in args.ranks:
        for kind in kinds:
            row = measure(world, kind, args.repeats)
            if args.json:
                print(json.dumps(row), flush=True)
                continue
            culprit = "-" if row["culprit"] is None else (f"{row['culprit'][0]}-{row['culprit'][-1]}"
                                                          if len(row["culprit"]) > 1 else str(row["culprit"][0]))
            print(f"| {world} | {kind} | {row['analysis_s']:.3f} ({row['analysis_cpu_s']:.3f}) | "
                  f"{row['writer_s']:.2f} ({row['writer_cpu_s']:.2f}) | {row['peak_mb']:.0f} | "
                  f"{row['report_kb']:.0f} | {row['lines']} | {culprit} | {row['shapes']} |", flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
