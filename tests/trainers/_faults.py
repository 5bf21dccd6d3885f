"""The faults the trainer scripts in this folder inject, one place for all of them.

Every script here takes the same `--mode` (see MODES) and calls into this module at the point of
its own loop where the fault belongs; benchmarks/trainer_matrix.py runs them and judges the hang
report. When env STAMPS names a file, the rank that injects a fault appends one line
`FAULT <unix time> rank<R> <what>` to it (and `SLOW ...` for the healthy twins, `DONE ...` at the
end), so the runner can time the report from the fault.

These scripts are not tests pytest collects (no test_ prefix): they are the workloads.
"""
from __future__ import annotations

import argparse
import os
import signal
import time

MODES = {
    "healthy": "nothing wrong",
    "short": "rank --short-rank has fewer batches than its peers (uneven data)",
    "branch": "rank --fault-rank alone makes an extra collective at --fault-step",
    "stall": "rank --fault-rank sleeps forever inside its compute at --fault-step",
    "iostall": "rank --fault-rank blocks reading a FIFO nobody writes, at --fault-step",
    "raise1": "rank --fault-rank raises at --fault-step",
    "raiseall": "every rank raises the same error at --fault-step",
    "kill": "rank --fault-rank SIGKILLs itself at --fault-step",
    "slowval": "healthy twin: rank 0's validation is --slow-s seconds slow, once",
    "slowlog": "healthy twin: rank 0's logging is --slow-s seconds slow, once",
    "slowckpt": "healthy twin: rank 0's checkpoint write is --slow-s seconds slow, once",
}

RANK = int(os.environ.get("RANK", 0))
WORLD = int(os.environ.get("WORLD_SIZE", 1))


def parser(doc: str = "") -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(description=doc, formatter_class=argparse.RawDescriptionHelpFormatter,
                                epilog="modes:\n" + "\n".join(f"  {k:9s} {v}" for k, v in MODES.items()))
    p.add_argument("--mode", default="healthy", choices=sorted(MODES))
    p.add_argument("--short-rank", type=int, default=-1, help="default: the last rank")
    p.add_argument("--fault-rank", type=int, default=-1, help="default: the last rank")
    p.add_argument("--fault-step", type=int, default=4)
    p.add_argument("--slow-s", type=float, default=6.0)
    p.add_argument("--batches", type=int, default=12, help="training batches per rank and epoch")
    p.add_argument("--short-batches", type=int, default=6)
    p.add_argument("--epochs", type=int, default=2)
    return p


def parse(p: argparse.ArgumentParser) -> argparse.Namespace:
    args, _ = p.parse_known_args()  # launchers may add their own (--local_rank)
    if args.short_rank < 0:
        args.short_rank = WORLD - 1
    if args.fault_rank < 0:
        args.fault_rank = WORLD - 1
    return args


def stamp(kind: str, msg: str = "") -> None:
    path = os.environ.get("STAMPS")
    if path:
        with open(path, "a") as f:
            f.write(f"{kind} {time.time():.3f} rank{RANK} {msg}\n")


def n_batches(args: argparse.Namespace) -> int:
    """This rank's batches per epoch."""
    if args.mode == "short" and RANK == args.short_rank:
        return args.short_batches
    return args.batches


class Injector:
    """Call `compute(step)` inside the rank's forward/loss and `branch(step)` where a rank-dependent
    collective would sit (after the step); each fires once."""

    def __init__(self, args: argparse.Namespace) -> None:
        self.args = args
        self.fired = False
        self.slow_done: set[str] = set()

    def _due(self, step: int) -> bool:
        return not self.fired and step >= self.args.fault_step

    def compute(self, step: int) -> None:
        a = self.args
        if not self._due(step) or a.mode not in ("stall", "iostall", "raise1", "raiseall", "kill"):
            return
        if a.mode != "raiseall" and RANK != a.fault_rank:
            return
        self.fired = True
        if a.mode == "stall":
            stamp("FAULT", f"rank {RANK} sleeps forever in compute at step {step}")
            while True:
                time.sleep(3600)
        if a.mode == "iostall":
            fifo = os.path.abspath(f"stall-rank{RANK}.fifo")
            if not os.path.exists(fifo):
                os.mkfifo(fifo)
            stamp("FAULT", f"rank {RANK} blocks reading FIFO {fifo} at step {step}")
            with open(fifo, "rb") as f:  # blocks in open(): no writer ever comes
                f.read()
            return
        if a.mode in ("raise1", "raiseall"):
            stamp("FAULT", f"rank {RANK} raises at step {step}")
            raise RuntimeError(f"injected failure: bad batch at step {step}")
        if a.mode == "kill":
            stamp("FAULT", f"rank {RANK} SIGKILLs itself at step {step}")
            os.kill(os.getpid(), signal.SIGKILL)

    def branch(self, step: int, collective=None) -> None:
        """The rank-dependent extra collective; `collective` is the trainer's own (a barrier,
        a gather), else a torch.distributed all_reduce."""
        a = self.args
        if a.mode != "branch" or not self._due(step) or RANK != a.fault_rank:
            return
        self.fired = True
        stamp("FAULT", f"rank {RANK} alone makes an extra collective at step {step}")
        if collective is not None:
            collective()
        else:
            import torch
            import torch.distributed as dist

            t = torch.ones(1)
            dist.all_reduce(t)

    def slow(self, where: str) -> None:
        """The healthy twins: rank 0 slow once in `where` (val | log | ckpt)."""
        a = self.args
        if a.mode != "slow" + where or RANK != 0 or where in self.slow_done:
            return
        self.slow_done.add(where)
        stamp("SLOW", f"rank 0 slow {where} {a.slow_s}s")
        time.sleep(a.slow_s)


def short_done(args: argparse.Namespace, batches_seen: int) -> None:
    """The short rank's data ran out: the fault of mode short happens here (stamped once)."""
    if args.mode == "short" and RANK == args.short_rank and not getattr(short_done, "seen", False):
        short_done.seen = True  # type: ignore[attr-defined]
        stamp("FAULT", f"rank {RANK}'s data ran out after {batches_seen} batches")
