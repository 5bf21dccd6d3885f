"""Process groups made in another order, or by their members only, at a world size the suite does
not run (16 ranks by default): the rank that did it is named alone, the twins write no report.

    python benchmarks/bench_group_creation.py [--ranks 16] [--busy 4]

Runs tests/faults/mesh_workers.py's kind=groups job (the watchdog armed, gloo, real processes)
four ways: fault=order (the middle rank makes its two groups in the other order), fault=members
(the last rank skips the group it is not a member of), and the twins fault=none and fault=local
(use_local_synchronization=True). `--busy N` runs N busy loops beside it. Prints one line per
case: the exit codes, seconds, the lead's ranks and confidence, every rank a critical finding
blames. Needs the repository's tests/ on the path (run it from the checkout)."""

from __future__ import annotations

import argparse
import subprocess
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from distdiag.report.model import read_report  # noqa: E402
from tests.harness import run_ranks  # noqa: E402

ENTRY = "tests.faults.mesh_workers:train"


def _case(world: int, words: list[str]) -> str:
    with tempfile.TemporaryDirectory() as d:
        t = time.monotonic()
        r = run_ranks(world, ["kind=groups", *words], Path(d), entry=ENTRY, timeout=60.0 + 10.0 * world)
        took = time.monotonic() - t
        rep = Path(d) / "hang-report" / "hang-report.json"
        if not rep.exists():
            return f"{' '.join(words):<22} codes {sorted(set(r.codes))} {took:5.1f}s  no report"
        crit = [f for p in read_report(rep).probes for f in p.findings if f.severity == "critical"]
        blamed = sorted({x for f in crit for x in f.ranks})
        lead = f"lead ranks {crit[0].ranks} at {crit[0].confidence}" if crit else "no critical finding"
        return f"{' '.join(words):<22} codes {sorted(set(r.codes))} {took:5.1f}s  {lead}; blamed {blamed}"


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--ranks", type=int, default=16)
    ap.add_argument("--busy", type=int, default=0, help="busy loops beside the job")
    args = ap.parse_args()
    busy = [subprocess.Popen([sys.executable, "-c", "while True: pass"]) for _ in range(args.busy)]
    try:
        for words in (["fault=order", f"rank={args.ranks // 2 + 1}"], ["fault=members"], ["fault=none"], ["fault=local"]):
            print(_case(args.ranks, words), flush=True)
    finally:
        for p in busy:
            p.kill()


if __name__ == "__main__":
    main()
