"""Cost of the numerical probes: time per probe, growth with model size, the reference's memory.

    python benchmarks/bench_numerics.py [--worlds 2 4] [--dims 64 256 512] [--repeats 3]

1. Each of fsdp_plan, loss_parity, param_sync, determinism on the default built-in
   workload at each world size: the probe's time (slowest rank, from the report), median of
   the repeats, cold (first in its process: pays the one-time FSDP2/DTensor/dynamo import)
   and warm, next to the `collectives` probe measured in the same run (ratio = probe /
   collectives, the figure that travels between machines).
2. loss_parity and param_sync at 2 ranks on the built-in transformer (4 layers, vocab 256)
   at growing width: time, and each rank's peak RSS. param_sync builds and trains the same
   parallel model without a reference, so (peak RSS of loss_parity - peak RSS of
   param_sync) / model bytes is the reference's cost in copies of the model per rank.
   The reference holds the model and its gradients: about 2 copies, the gradients being
   part of any training step; target: below 3.

Ranks are forked by tests/harness.py (a forkserver with torch preloaded), so torch's import
is not in the figures. Prints markdown tables (docs/numerics.md holds a run's output).
"""

from __future__ import annotations

import argparse
import json
import os
import resource
import statistics
import sys
import tempfile
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path[:0] = [str(ROOT), str(ROOT / "benchmarks")]

PROBES = ["fsdp_plan", "loss_parity", "param_sync", "determinism"]
TARGET = """
from distdiag.workloads import get_workload
_w = get_workload("transformer", vocab=256, dim={dim}, heads=4, layers=4)
build_model, make_batch, loss_fn, shard_batch = _w.build_model, _w.make_batch, _w.loss_fn, _w.shard_batch
"""


def rank_entry(argv: list[str]) -> int:
    """Run the check in this rank, then leave its peak RSS (KiB) beside the report."""
    from distdiag.check.run import run_check

    code = run_check(argv)
    peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
    Path(f"peak{os.environ['RANK']}.json").write_text(json.dumps({"peak_kib": peak}))
    return code


def _run(world: int, args: list[str]) -> tuple[dict[str, float], list[int], dict]:
    from tests.harness import run_ranks

    workdir = Path(tempfile.mkdtemp(prefix="bench-numerics-"))
    result = run_ranks(world, args, workdir, entry="bench_numerics:rank_entry", timeout=300)
    if result.codes != [0] * world:
        raise SystemExit(f"run {args} failed: codes {result.codes}\n{result.stdout[-2000:]}\n{result.stderr[-2000:]}")
    report = result.report()
    times = {p.name: p.duration_s for p in report.probes}
    peaks = [json.loads((workdir / f"peak{r}.json").read_text())["peak_kib"] for r in range(world)]
    metrics = {p.name: p.metrics for p in report.probes}
    return times, peaks, metrics


def per_probe(worlds: list[int], repeats: int) -> None:
    """cold: the probe first in its process (it pays the one-time import of FSDP2, DTensor
    and torch._dynamo); warm: after another numerics probe. Baseline: collectives, same run."""
    print("| probe | ranks | cold (s) | warm (s) | collectives (s) | warm / collectives |")
    print("| --- | --- | --- | --- | --- | --- |")
    for world in worlds:
        for probe in PROBES:
            before = "param_sync" if probe == "determinism" else "determinism"
            cold, warm, base = [], [], []
            for _ in range(repeats):
                times, _, _ = _run(world, ["--probes", f"collectives,{probe}"])
                cold.append(times[probe])
                base.append(times["collectives"])
                times, _, _ = _run(world, ["--probes", f"{before},{probe}"])
                warm.append(times[probe])
            c, w, b = (statistics.median(x) for x in (cold, warm, base))
            print(f"| {probe} | {world} | {c:.3f} | {w:.3f} | {b:.3f} | {w / b:.2f} |", flush=True)


def by_size(dims: list[int], repeats: int) -> None:
    print("| dim | params (MiB) | loss_parity (s) | param_sync (s) | peak RSS/rank loss_parity (MiB) | param_sync (MiB) | reference copies |")
    print("| --- | --- | --- | --- | --- | --- | --- |")
    folder = Path(tempfile.mkdtemp(prefix="bench-targets-"))
    for dim in dims:
        target = folder / f"t{dim}.py"
        target.write_text(TARGET.format(dim=dim))
        rows = []
        for _ in range(repeats):
            lp_t, lp_peak, metrics = _run(2, ["--probes", "loss_parity", "--target", str(target)])
            ps_t, ps_peak, _ = _run(2, ["--probes", "param_sync", "--target", str(target)])
            size = metrics["loss_parity"]["reference_model_bytes"]
            extra = (max(lp_peak) - max(ps_peak)) * 1024 / size
            rows.append((lp_t["loss_parity"], ps_t["param_sync"], max(lp_peak) / 1024, max(ps_peak) / 1024, extra, size))
        med = [statistics.median(col) for col in zip(*rows, strict=True)]
        print(f"| {dim} | {med[5] / 2**20:.1f} | {med[0]:.3f} | {med[1]:.3f} | {med[2]:.0f} | {med[3]:.0f} | {med[4]:.2f} |", flush=True)


def main() -> None:
    # A fixed mmap threshold: glibc otherwise raises it after the first large free, keeps
    # freed tensors in the heap, and peak RSS stops tracking live tensors. Read when the
    # forkserver starts, and inherited by every rank it forks.
    os.environ.setdefault("MALLOC_MMAP_THRESHOLD_", "131072")
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--worlds", type=int, nargs="+", default=[2, 4])
    parser.add_argument("--dims", type=int, nargs="+", default=[64, 256, 512])
    parser.add_argument("--repeats", type=int, default=3)
    args = parser.parse_args()
    per_probe(args.worlds, args.repeats)
    print()
    by_size(args.dims, args.repeats)


if __name__ == "__main__":
    main()
