"""A plain timed loop of each collective, independent of distdiag (imports nothing from it).

    torchrun --nproc-per-node 4 benchmarks/bandwidth_plain.py --sizes 262144 4194304 --iters 20 --repeats 3

The reference the `bandwidth` probe is checked against (bench_bandwidth_agreement.py). For
each op and size: warm-up calls, then `repeats` times: a barrier, `iters` back-to-back
calls, one device sync. A loop's time per call is averaged over ranks (as nccl-tests does);
the median loop is the time; algbw = bytes / time, busbw = algbw x (2(n-1)/n all_reduce;
(n-1)/n all_gather, reduce_scatter, all_to_all; 1 broadcast). Rank 0 prints one JSON
object per line.
"""

from __future__ import annotations

import argparse
import json
import statistics
import time

import torch
import torch.distributed as dist

ALL_GATHER = getattr(dist, "all_gather_single", None) or dist.all_gather_into_tensor
REDUCE_SCATTER = getattr(dist, "reduce_scatter_single", None) or dist.reduce_scatter_tensor


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--sizes", type=int, nargs="+", required=True, help="bytes (nccl-tests' size column)")
    parser.add_argument("--iters", type=int, default=20)
    parser.add_argument("--warmup", type=int, default=2)
    parser.add_argument("--repeats", type=int, default=1)
    args = parser.parse_args()
    cuda = torch.cuda.is_available()
    dist.init_process_group("nccl" if cuda else "gloo")
    n, rank = dist.get_world_size(), dist.get_rank()
    dev = torch.device("cuda", rank % torch.cuda.device_count()) if cuda else torch.device("cpu")
    factors = {"all_reduce": 2 * (n - 1) / n, "all_gather": (n - 1) / n, "reduce_scatter": (n - 1) / n,
               "all_to_all": (n - 1) / n, "broadcast": 1.0}
    for op in factors:
        for size in args.sizes:
            whole = size // 4  # float32 elements of the whole buffer
            part = whole // n
            if op in ("all_reduce", "broadcast"):
                buf = torch.ones(whole, device=dev)
                nbytes = whole * 4
                call = (lambda b=buf: dist.all_reduce(b)) if op == "all_reduce" else (lambda b=buf: dist.broadcast(b, 0))
            else:
                inp = torch.ones(part * (n if op != "all_gather" else 1), device=dev)
                out = torch.empty(part * (1 if op == "reduce_scatter" else n), device=dev)
                nbytes = part * n * 4
                call = {
                    "all_gather": lambda o=out, i=inp: ALL_GATHER(o, i),
                    "reduce_scatter": lambda o=out, i=inp: REDUCE_SCATTER(o, i),
                    "all_to_all": lambda o=out, i=inp: dist.all_to_all_single(o, i),
                }[op]
            for _ in range(args.warmup):
                call()
            loops = []
            for _ in range(args.repeats):
                if cuda:
                    torch.cuda.synchronize()
                dist.barrier()
                t0 = time.perf_counter()
                for _ in range(args.iters):
                    call()
                if cuda:
                    torch.cuda.synchronize()
                loops.append((time.perf_counter() - t0) / args.iters)
            per_loop = torch.tensor(loops, dtype=torch.float64, device=dev)
            dist.all_reduce(per_loop)
            mean = statistics.median((per_loop / n).tolist())
            if rank == 0:
                algbw = nbytes / mean / 1e9
                print(json.dumps({"op": op, "bytes": nbytes, "size": size, "time_us": mean * 1e6,
                                  "algbw_GBps": algbw, "busbw_GBps": algbw * factors[op]}), flush=True)
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
