"""Time-to-verdict of `torchrun -m distdiag.check` against a bare torchrun + init + barrier.

Both are measured in the same run, interleaved, at each world size; the ratio of medians is
what the targets speak of (issue 2: env + collectives <= 1.5x at 4 ranks on a 2-core box).
torch's import dominates both on small machines, so the ratio is the honest figure.

    python benchmarks/bench_time_to_verdict.py --worlds 2 4 8 16 --repeats 3 --suites quick gate
"""

from __future__ import annotations

import argparse
import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

HERE = Path(__file__).resolve().parent


def timed(cmd: list[str], cwd: str) -> float:
    env = dict(os.environ, OMP_NUM_THREADS="1")
    env.pop("DISTDIAG_INJECT", None)
    start = time.perf_counter()
    proc = subprocess.run(cmd, cwd=cwd, env=env, capture_output=True, text=True, timeout=600)
    elapsed = time.perf_counter() - start
    if proc.returncode != 0:
        raise SystemExit(f"{' '.join(cmd)} failed ({proc.returncode}):\n{proc.stderr[-2000:]}")
    return elapsed


def torchrun(nproc: int, *rest: str) -> list[str]:
    return [sys.executable, "-m", "torch.distributed.run", f"--nproc-per-node={nproc}", *rest]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--worlds", type=int, nargs="+", default=[2, 4, 8, 16])
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--suites", nargs="+", default=["quick", "default"],
                        help="profiles to time (default = every probe that applies)")
    args = parser.parse_args()
    cases = {"bare": lambda n: torchrun(n, str(HERE / "bare_barrier.py"))}
    for suite in args.suites:
        cases[suite] = lambda n, s=suite: torchrun(n, "-m", "distdiag.check", "--profile", s, "--quiet")
    with tempfile.TemporaryDirectory() as cwd:
        timed(cases["bare"](2), cwd)  # warm the file cache once
        rows = []
        for world in args.worlds:
            times: dict[str, list[float]] = {name: [] for name in cases}
            for _ in range(args.repeats):
                for name, make in cases.items():  # interleaved: drift hits every case alike
                    times[name].append(timed(make(world), cwd))
            med = {name: statistics.median(v) for name, v in times.items()}
            rows.append((world, med, times))
    print(f"{'ranks':>5}  " + "  ".join(f"{n:>16}" for n in cases) + "  " + "  ".join(f"{n + '/bare':>13}" for n in cases if n != "bare"))
    for world, med, times in rows:
        cells = "  ".join(f"{med[n]:6.2f}s ({min(times[n]):.1f}-{max(times[n]):.1f})" for n in cases)
        ratios = "  ".join(f"{med[n] / med['bare']:13.2f}" for n in cases if n != "bare")
        print(f"{world:>5}  {cells}  {ratios}")


if __name__ == "__main__":
    main()
