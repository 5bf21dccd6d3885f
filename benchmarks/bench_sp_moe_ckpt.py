"""Cost of sequence_parallel, moe_routing and checkpoint at 2 and 4 ranks.

    python benchmarks/bench_sp_moe_ckpt.py [--worlds 2 4] [--repeats 1]

For each world size, each probe on its built-in workload (no target):
- cold: run as `--probes collectives,PROBE` (the probe pays any one-time import in its
  process: DCP, FSDP2/DTensor, torch._dynamo on the first optimizer call);
- suite: its time inside the default suite (`torchrun -m distdiag.check` with no
  --probes), where earlier probes have already paid those imports.
Each time is the slowest rank's (from the report), the median over repeats, and is also
given as a ratio to the `collectives` probe of the same run (the figure that travels
between machines). Ranks are forked by tests/harness.py with torch preloaded, so torch's
own import is not in the figures. Prints a markdown table (docs/sequence_moe_checkpoint.md
holds a run's output).
"""

from __future__ import annotations

import argparse
import statistics
import sys
import tempfile
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

PROBES = ["sequence_parallel", "moe_routing", "checkpoint"]


def _durations(world: int, args: list[str]) -> dict[str, float]:
    from tests.harness import run_check

    with tempfile.TemporaryDirectory() as tmp:
        result = run_check(world, args, tmp, timeout=300)
        if result.timed_out or any(c not in (0,) for c in result.codes):
            raise SystemExit(f"run {args} at {world} ranks failed: codes {result.codes}\n{result.stderr[-2000:]}")
        return {p.name: p.duration_s for p in result.report().probes}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--worlds", type=int, nargs="+", default=[2, 4])
    parser.add_argument("--repeats", type=int, default=1)
    opts = parser.parse_args()
    rows = []
    for world in opts.worlds:
        cold: dict[str, list[tuple[float, float]]] = {p: [] for p in PROBES}
        suite: dict[str, list[tuple[float, float]]] = {p: [] for p in PROBES}
        for _ in range(opts.repeats):
            for probe in PROBES:
                d = _durations(world, ["--probes", f"collectives,{probe}"])
                cold[probe].append((d[probe], d[probe] / d["collectives"]))
            d = _durations(world, [])
            for probe in PROBES:
                suite[probe].append((d[probe], d[probe] / d["collectives"]))
        for probe in PROBES:
            rows.append((world, probe,
                         statistics.median(t for t, _ in cold[probe]), statistics.median(r for _, r in cold[probe]),
                         statistics.median(t for t, _ in suite[probe]), statistics.median(r for _, r in suite[probe])))
    print("| ranks | probe | cold s | cold / collectives | in default suite s | suite / collectives |")
    print("|---|---|---|---|---|---|")
    for world, probe, ct, cr, st, sr in rows:
        print(f"| {world} | {probe} | {ct:.2f} | {cr:.1f} | {st:.2f} | {sr:.1f} |")


if __name__ == "__main__":
    main()
