"""Does the `bandwidth` probe agree with a plain timed loop of the same collectives?

    python benchmarks/bench_bandwidth_agreement.py [--world 2] [--sizes 4096 262144 4194304]
        [--iters 20] [--repeats 5] [--runs 8] [--pin 0] [--aa]

Runs, interleaved, `torchrun -m distdiag.check --probes bandwidth` and
benchmarks/bandwidth_plain.py (which shares no code with the probe) at the same world size,
sizes, iterations and timed loops per size, and prints busbw per op and size from both with
their ratio (median over the runs; each run's figure is already the median of `--repeats`
timed loops on both sides). Target (issue 6): every ratio within 10% of 1. Exit 1 if one is not.

"run noise" is half the interquartile range of the plain side's runs over their median;
"3 sigma" is three standard errors of the ratio (both sides' noise). A row outside 10% but
inside 3 sigma is "unresolved": consistent with agreement, but this machine's noise is
wider than the target; outside both, the probe DISAGREES. Exit 0 only if every row is within.
`--aa` adds a second plain run per round and prints plain/plain too: the noise floor of
this machine, the disagreement two identical loops show. `--pin CPUS` runs both under
`taskset -c CPUS`: on a 2-core VM, whether gloo's threads of two ranks share a core or not
changes small-message bandwidth 2x from one window to the next; on one pinned core the
scheduling repeats. Both sides are pinned alike, so the comparison stays fair.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import statistics
import subprocess
import sys
import tempfile
from pathlib import Path

HERE = Path(__file__).resolve().parent


def _run(cmd: list[str], cwd: str) -> str:
    env = dict(os.environ, OMP_NUM_THREADS="1")
    env.pop("DISTDIAG_INJECT", None)
    proc = subprocess.run(cmd, cwd=cwd, env=env, capture_output=True, text=True, timeout=1800)
    if proc.returncode != 0:
        raise SystemExit(f"{' '.join(cmd)} failed ({proc.returncode}):\n{proc.stderr[-3000:]}")
    return proc.stdout


def _plain(cmd: list[str], cwd: str, into: dict[tuple[str, int], list[float]]) -> None:
    for line in _run(cmd, cwd).splitlines():
        if line.startswith("{"):
            row = json.loads(line)
            into.setdefault((row["op"], row["bytes"]), []).append(row["busbw_GBps"])


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--world", type=int, default=2)
    parser.add_argument("--sizes", type=int, nargs="+", default=[4096, 262144, 4194304],
                        help="bytes (default: the probe's CPU sweep, 4KiB 256KiB 4MiB)")
    parser.add_argument("--iters", type=int, default=20, help="calls per timed loop")
    parser.add_argument("--warmup", type=int, default=3)
    parser.add_argument("--repeats", type=int, default=5, help="timed loops per (op, size) in each run; median loop")
    parser.add_argument("--runs", type=int, default=8, help="interleaved runs of each side (ABBA order)")
    parser.add_argument("--tolerance", type=float, default=0.10)
    parser.add_argument("--pin", default="", metavar="CPUS", help="run both sides under taskset -c CPUS")
    parser.add_argument("--aa", action="store_true", help="also compare plain with plain: the noise floor")
    parser.add_argument("--json", default="", metavar="PATH", help="also write every run's busbw per side here")
    parser.add_argument("--stat", choices=["median", "best"], default="median",
                        help="median busbw over the runs, or each side's best (least disturbed) run")
    args = parser.parse_args()
    prefix = []
    if args.pin:
        if not shutil.which("taskset"):
            raise SystemExit("--pin needs taskset (util-linux)")
        prefix = ["taskset", "-c", args.pin]
    torchrun = [*prefix, sys.executable, "-m", "torch.distributed.run", f"--nproc-per-node={args.world}"]
    plain_cmd = [*torchrun, str(HERE / "bandwidth_plain.py"), "--sizes", *map(str, args.sizes),
                 "--iters", str(args.iters), "--warmup", str(args.warmup), "--repeats", str(args.repeats)]
    probe: dict[tuple[str, int], list[float]] = {}
    plain: dict[tuple[str, int], list[float]] = {}
    plain2: dict[tuple[str, int], list[float]] = {}
    with tempfile.TemporaryDirectory() as cwd:
        cfg = Path(cwd) / "bw.toml"
        cfg.write_text(
            f"[probes.bandwidth]\nsizes = {args.sizes}\niters = {args.iters}\nwarmup = {args.warmup}\n"
            f"repeats = {args.repeats}\np2p = false\n"
        )
        def run_probe() -> None:
            _run([*torchrun, "-m", "distdiag.check", "--probes", "bandwidth", "--config", str(cfg), "--quiet",
                  "--report", "bw.json"], cwd)
            report = json.loads((Path(cwd) / "bw.json").read_text())
            (result,) = [p for p in report["probes"] if p["name"] == "bandwidth"]
            for row in result["details"]["table:bandwidth"]:
                probe.setdefault((row["op"], row["bytes"]), []).append(row["busbw_GBps"])

        for i in range(args.runs):
            # ABBA: the order alternates, so a machine drifting slower (or faster) over
            # minutes favours no side; with --aa the second plain run alternates too.
            order = [run_probe, lambda: _plain(plain_cmd, cwd, plain)]
            if args.aa:
                order.append(lambda: _plain(plain_cmd, cwd, plain2))
            for step in order[:: 1 if i % 2 == 0 else -1]:
                step()
    pick = statistics.median if args.stat == "median" else max

    def noise(values: list[float]) -> float:
        """Half the interquartile range over the median: how much one run of a side moves."""
        if len(values) < 4:
            return float("nan")
        q = statistics.quantiles(values, n=4)
        return (q[2] - q[0]) / 2 / statistics.median(values)

    print(f"world {args.world}, {args.iters} iterations x {args.repeats} loops, {args.stat} of {args.runs} "
          f"interleaved runs{', pinned to CPUs ' + args.pin if args.pin else ''}")
    print(f"{'op':<15}{'bytes':>10}{'probe GB/s':>12}{'plain GB/s':>12}{'ratio':>8}{'run noise':>11}{'3 sigma':>9}"
          + (f"{'plain/plain':>13}" if args.aa else "") + "  verdict")
    worst = worst_aa = 0.0
    rows = []
    tally = {"within": 0, "unresolved": 0, "DISAGREES": 0, "outside": 0}
    for key in sorted(plain, key=lambda k: (k[0], k[1])):
        a, b = pick(probe[key]), pick(plain[key])
        off = abs(a / b - 1)
        worst = max(worst, off)
        # Three standard errors of the ratio of two medians (relative): per side sigma ~
        # half-IQR / 0.674 and SE(median) ~ 1.2533 sigma / sqrt(runs); the sides add in
        # quadrature. Three, not two: with 20 rows judged at once, 2 sigma would call about
        # one row in twenty a disagreement by chance alone (Bonferroni for 20 rows: ~3).
        # Needs the median statistic and >= 4 runs a side (an IQR); otherwise unknown (nan).
        band = float("nan")
        if args.stat == "median" and len(plain[key]) >= 4:
            band = 3 * 1.2533 * sum((noise(v) / 0.674) ** 2 / len(v) for v in (probe[key], plain[key])) ** 0.5
        if off <= args.tolerance:
            verdict = "within"
        elif band != band:  # nan: no noise estimate
            verdict = "outside"
        elif off <= band:
            verdict = "unresolved"  # consistent with 1, but this run cannot tell 10% from noise
        else:
            verdict = "DISAGREES"
        tally[verdict] += 1
        line = f"{key[0]:<15}{key[1]:>10}{a:>12.4f}{b:>12.4f}{a / b:>8.3f}{noise(plain[key]):>10.0%} {band:>8.0%}"
        row = {"op": key[0], "bytes": key[1], "probe": probe[key], "plain": plain[key], "ratio": a / b,
               "band": band, "verdict": verdict}
        if args.aa:
            aa = pick(plain2[key]) / b
            worst_aa = max(worst_aa, abs(aa - 1))
            line += f"{aa:>13.3f}"
            row.update(plain2=plain2[key], aa_ratio=aa)
        rows.append(row)
        print(f"{line}  {verdict}")
    print(f"largest disagreement probe/plain {worst:.1%}; {tally['within']} of {len(rows)} rows within "
          f"{args.tolerance:.0%}, {tally['unresolved']} unresolved (this machine's run-to-run noise is wider "
          f"than the target there, and the ratio is within it), {tally['DISAGREES']} disagree beyond the noise"
          + (f", {tally['outside']} outside with no noise estimate (use --runs >= 4 and --stat median)"
             if tally["outside"] else ""))
    if args.aa:
        print(f"largest disagreement plain/plain {worst_aa:.1%} (this machine's noise floor for the same settings)")
    if args.json:
        Path(args.json).write_text(json.dumps({"args": vars(args), "rows": rows}, indent=1))
    raise SystemExit(0 if tally["within"] == len(rows) else 1)


if __name__ == "__main__":
    main()
