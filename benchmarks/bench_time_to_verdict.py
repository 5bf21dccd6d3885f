"""Time-to-verdict of `torchrun -m distdiag.check` against a bare torchrun + init + barrier.

Both are measured in the same run, interleaved, at each world size; the ratio of medians is
what the targets speak of (issue 2: env + collectives <= 1.5x at 4 ranks on a 2-core box).
torch's import dominates both on small machines, so the ratio is the honest figure.

    python benchmarks/bench_time_to_verdict.py --worlds 2 4 8 16 --repeats 3 --suites quick gate

On a loaded machine wall-clock times say little; `--cpu` measures what the run costs
instead: the CPU seconds (user + sys) of the whole torchrun process tree, and, for the
distdiag suites, each rank's CPU seconds per probe (time.process_time around Probe.run, this
file acting as the ranks' entry point), plus what each rank spent before the first probe
(Python, torch's import, distdiag's import, setup). On 2 cores with more ranks than cores,
wall time is roughly total CPU / 2, so these add up to the wall-clock ratio.

    python benchmarks/bench_time_to_verdict.py --cpu --worlds 4 8 --repeats 3 --suites default

`--launcher` also times each suite through `distdiag check --nproc-per-node N` (its default
`--launch fork`: torch and the planned probes' modules imported once, the ranks forked by
torchrun's own agent; distdiag.launcher.forkrun), the command docs/gate.md puts in front of jobs:

    python benchmarks/bench_time_to_verdict.py --worlds 4 8 --repeats 3 --suites quick default --launcher
"""

from __future__ import annotations

import argparse
import json
import os
import resource
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


def precompile() -> None:
    """Write distdiag's bytecode once, as `pip install` of a wheel does.

    With PYTHONDONTWRITEBYTECODE=1 (set on some machines and containers, this one included) an
    editable install compiles every distdiag module from source in every rank of every run
    (0.35 CPU s per rank here), while torch's bytecode was written when its wheel was installed;
    the comparison would charge distdiag for the environment. Python still reads bytecode that
    exists under that setting, so writing it once here is enough.
    """
    import compileall

    import distdiag

    compileall.compile_dir(str(Path(distdiag.__file__).parent), quiet=1)


def torchrun(nproc: int, *rest: str) -> list[str]:
    return [sys.executable, "-m", "torch.distributed.run", f"--nproc-per-node={nproc}", *rest]


def distdiag_check(nproc: int, *rest: str) -> list[str]:
    return [sys.executable, "-m", "distdiag", "check", f"--nproc-per-node={nproc}", *rest]


AS_FLOOR = "--as-floor"
FLOOR_IMPORTS = ("torch.distributed.fsdp", "torch._dynamo", "torch.distributed.checkpoint",
                 "torch.distributed.checkpoint.state_dict")
"""What the default suite's FSDP2/DTensor/DCP probes import whatever they share: DTensor's first
op imports torch._dynamo (FakeTensorMode imports torch._dynamo.config), FSDP2 builds DTensors."""


def as_floor() -> None:
    """A rank of the `floor` case: bare (init + barrier) plus the imports above, nothing else."""
    import importlib

    import torch.distributed as dist

    dist.init_process_group("gloo")
    dist.barrier()
    for name in FLOOR_IMPORTS:
        importlib.import_module(name)
    dist.barrier()
    dist.destroy_process_group()
    # Leave as the check's ranks do (os._exit after flushing, distdiag.check.run.main): a normal
    # exit with these modules loaded costs 0.7-1 CPU s a rank here in interpreter teardown, which
    # no check rank pays, and made this "floor" cost more than the default suite it bounds.
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(0)


AS_RANK = "--as-rank"
CPU_OUT = "DISTDIAG_BENCH_CPU_OUT"


def as_rank(argv: list[str]) -> None:
    """A rank's entry point for --cpu: distdiag.check with CPU seconds recorded per probe."""
    import time

    started = time.process_time()  # the interpreter's start-up, up to here
    import torch  # noqa: F401 - timed: torch's own import

    after_torch = time.process_time()
    import distdiag.check.run as check
    from distdiag.probes import PROBES

    rank = os.environ.get("RANK", "0")
    record = {"startup": started, "torch_import": after_torch - started,
              "distdiag_import": time.process_time() - after_torch, "probes": {}}

    def dump() -> None:
        with open(f"{os.environ[CPU_OUT]}.{rank}.json", "w") as f:
            json.dump(record, f)

    for name, cls in PROBES.items():
        def run(self, ctx, _orig=cls.run, _name=name):  # noqa: ANN001, ANN202 - a thin timer
            begin = time.process_time()
            try:
                return _orig(self, ctx)
            finally:
                record["probes"][_name] = time.process_time() - begin

        cls.run = run
    finish = check.CheckRun._finish

    def timed_finish(self):  # noqa: ANN001, ANN202
        record["before_verdict"] = time.process_time()
        dump()
        return finish(self)

    check.CheckRun._finish = timed_finish
    check.main(argv)


def cpu_run(cmd: list[str], cwd: str, out: str | None = None) -> tuple[float, float, list[dict]]:
    """(CPU seconds of the process tree, wall seconds, per-rank records) of one run."""
    env = dict(os.environ, OMP_NUM_THREADS="1")
    env.pop("DISTDIAG_INJECT", None)
    if out:
        env[CPU_OUT] = out
    before = resource.getrusage(resource.RUSAGE_CHILDREN)
    start = time.perf_counter()
    proc = subprocess.run(cmd, cwd=cwd, env=env, capture_output=True, text=True, timeout=600)
    wall = time.perf_counter() - start
    after = resource.getrusage(resource.RUSAGE_CHILDREN)
    if proc.returncode != 0:
        raise SystemExit(f"{' '.join(cmd)} failed ({proc.returncode}):\n{proc.stderr[-2000:]}")
    records = []
    if out:
        for path in sorted(Path(out).parent.glob(Path(out).name + ".*.json")):
            records.append(json.loads(path.read_text()))
            path.unlink()
    cpu = (after.ru_utime - before.ru_utime) + (after.ru_stime - before.ru_stime)
    return cpu, wall, records


def cpu_main(args: argparse.Namespace) -> None:
    """--cpu: CPU seconds of bare and each suite, interleaved, and per probe per rank."""
    with tempfile.TemporaryDirectory() as cwd:
        out = os.path.join(cwd, "cpu")
        cases = {"bare": lambda n: (torchrun(n, str(HERE / "bare_barrier.py")), None)}
        if args.floor:
            cases["floor"] = lambda n: (torchrun(n, str(Path(__file__).resolve()), AS_FLOOR), None)
        for suite in args.suites:
            cases[suite] = lambda n, s=suite: (torchrun(n, str(Path(__file__).resolve()), AS_RANK, "--profile", s, "--quiet"), out)
        cpu_run(cases["bare"](2)[0], cwd)  # warm the file cache once
        for world in args.worlds:
            totals: dict[str, list[tuple[float, float]]] = {name: [] for name in cases}
            per_probe: dict[str, dict[str, list[float]]] = {name: {} for name in cases}
            for _ in range(args.repeats):
                for name, make in cases.items():  # interleaved: drift hits every case alike
                    cmd, dest = make(world)
                    cpu, wall, records = cpu_run(cmd, cwd, dest)
                    totals[name].append((cpu, wall))
                    for key, value in _per_rank(records).items():
                        per_probe[name].setdefault(key, []).append(value)
            bare_cpu = statistics.median(c for c, _ in totals["bare"])
            bare_wall = statistics.median(w for _, w in totals["bare"])
            print(f"\n{world} ranks (median of {args.repeats}; CPU s = user+sys of the torchrun tree)")
            for name, runs in totals.items():
                cpu, wall = statistics.median(c for c, _ in runs), statistics.median(w for _, w in runs)
                print(f"  {name:8s} CPU {cpu:7.2f} s ({cpu / bare_cpu:4.2f}x bare)   wall {wall:6.2f} s ({wall / bare_wall:4.2f}x bare)")
            for name, table in per_probe.items():
                if table:
                    print(f"  {name}: CPU s per rank (mean over ranks, median over runs)")
                    for key, values in table.items():
                        print(f"    {key:22s} {statistics.median(values):6.3f}")


def _per_rank(records: list[dict]) -> dict[str, float]:
    """Mean over ranks of each phase's CPU seconds."""
    if not records:
        return {}
    def mean(values: list[float]) -> float:
        return sum(values) / len(values)
    out = {
        "python start-up": mean([r["startup"] for r in records]),
        "import torch": mean([r["torch_import"] for r in records]),
        "import distdiag": mean([r["distdiag_import"] for r in records]),
    }
    probes = list(records[0]["probes"])
    before = [r["before_verdict"] - r["startup"] - r["torch_import"] - r["distdiag_import"] - sum(r["probes"].values())
              for r in records]
    out["setup, exchange, rest"] = mean(before)
    for p in probes:
        out[f"probe {p}"] = mean([r["probes"].get(p, 0.0) for r in records])
    out["total before verdict"] = mean([r["before_verdict"] for r in records])
    return out


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--worlds", type=int, nargs="+", default=[2, 4, 8, 16])
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--suites", nargs="+", default=["quick", "default"],
                        help="profiles to time (default = every probe that applies)")
    parser.add_argument("--cpu", action="store_true", help="CPU seconds (tree and per probe per rank) instead of wall time")
    parser.add_argument("--floor", action="store_true",
                        help="also time bare + the imports of the FSDP2/DTensor/DCP probes (the default suite's floor)")
    parser.add_argument("--launcher", action="store_true",
                        help="also time each suite through `distdiag check --nproc-per-node N` (ranks forked)")
    args = parser.parse_args()
    precompile()
    if args.cpu:
        cpu_main(args)
        return
    cases = {"bare": lambda n: torchrun(n, str(HERE / "bare_barrier.py"))}
    if args.floor:
        cases["floor"] = lambda n: torchrun(n, str(Path(__file__).resolve()), AS_FLOOR)
    for suite in args.suites:
        cases[suite] = lambda n, s=suite: torchrun(n, "-m", "distdiag.check", "--profile", s, "--quiet")
        if args.launcher:
            cases[f"{suite}/check"] = lambda n, s=suite: distdiag_check(n, "--profile", s, "--quiet")
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
    if len(sys.argv) > 1 and sys.argv[1] == AS_RANK:
        as_rank(sys.argv[2:])
    elif len(sys.argv) > 1 and sys.argv[1] == AS_FLOOR:
        as_floor()
    else:
        main()
