"""Worker entry points for the watchdog's fault tests: a small training loop with one bug.

`train(argv)` takes key=value words: fault=NAME rank=K step=S steps=N timeout=T
action=abort|raise|report pg_timeout=SECONDS nowd=1 (no in-code watchdog: the zero-code
wrapper arms one) wrap=1|0 (the watchdog's wrappers on or off; unset: its default). Each fault is one line below so tests can assert on it by its marker
comment. Step length is `step_s` so a desync is caught while the job still runs.
"""

from __future__ import annotations

import os
import signal
import sys
import threading
import time
from contextlib import nullcontext
from datetime import timedelta
from typing import Any

import torch
import torch.distributed as dist

__all__ = ["train", "handlers_kept"]


class _NoWatchdog:
    """Stands in for HangWatchdog when the zero-code wrapper (or nothing) watches."""

    def __enter__(self) -> _NoWatchdog:
        return self

    def __exit__(self, *exc: Any) -> None:
        return None

    def step(self, step: Any = None) -> None:
        return None

    def phase(self, name: str, timeout: Any = None) -> Any:
        return nullcontext()


def _opts(argv: list[str]) -> dict[str, str]:
    out = {"fault": "none", "rank": "1", "step": "2", "steps": "8", "timeout": "3", "action": "abort", "step_s": "0.2"}
    for word in argv:
        key, _, value = word.partition("=")
        out[key] = value
    return out


def load_batch(step: int, opts: dict[str, str], me: int) -> torch.Tensor:
    if opts["fault"] == "sleep_data" and me == int(opts["rank"]) and step == int(opts["step"]):
        time.sleep(3600)  # FAULT:sleep_data
    return torch.full((16,), float(step))


def train(argv: list[str]) -> int:
    opts = _opts(argv)
    dist.init_process_group("gloo", timeout=timedelta(seconds=float(opts.get("pg_timeout", "120"))))
    me, fault, k, s = dist.get_rank(), opts["fault"], int(opts["rank"]), int(opts["step"])
    bad = me == k
    t = torch.ones(16)
    if opts.get("nowd") == "1":
        wd: Any = _NoWatchdog()
    else:
        from distdiag import HangWatchdog

        wrap = {"1": True, "0": False}.get(opts.get("wrap", ""))  # unset: the default (auto)
        wd = HangWatchdog(timeout=timedelta(seconds=float(opts["timeout"])), action=opts["action"], dump_dir="hang-report",
                          wrap=wrap)
    with wd:
        for step in range(int(opts["steps"])):
            wd.step(step)
            batch = load_batch(step, opts, me)
            here = bad and step == s
            if here and fault == "block":
                with open("hang_started", "w") as handle:  # for the detection-latency benchmark
                    handle.write(repr(time.time()))
                threading.Event().wait()  # FAULT:block
            if here and fault == "kill":
                os.kill(os.getpid(), signal.SIGKILL)
            if here and fault == "stop":
                os.kill(os.getpid(), signal.SIGSTOP)
            if here and fault == "spin":
                while True:  # FAULT:spin (a Python-level wait loop: action=raise can interrupt it)
                    time.sleep(0.05)
            if here and fault == "stall":
                time.sleep(float(opts["timeout"]) * 1.7)  # FAULT:stall (over the timeout, then carries on)
            if here and fault == "slow_step":
                time.sleep(float(opts["timeout"]) * 0.6)  # healthy: slower than usual, within the timeout
            t.copy_(batch)
            dist.all_reduce(t)  # SITE:A
            if here and fault == "skip":
                pass  # FAULT:skip (a rank-dependent branch leaves out the next all_reduce)
            elif here and fault == "op_mismatch":
                dist.all_gather([torch.empty(16) for _ in range(dist.get_world_size())], t)  # FAULT:op_mismatch
            elif bad and fault == "branch":
                dist.all_reduce(t)  # healthy: this rank issues the next all_reduce (same op, shape) from another line
            else:
                dist.all_reduce(t)  # SITE:B
            if (here and fault == "lib_barrier") or (step == s and fault == "lib_barrier_all"):
                # a library installed in a site-packages folder of its own syncs on this rank only
                # (as Lightning's self.log(sync_dist=True) inside a rank-0 branch does)
                sys.path.insert(0, opts["libdir"])
                import fakesync  # type: ignore[import-not-found]

                fakesync.sync()  # FAULT:lib_barrier
            if here and fault == "extra":
                dist.all_reduce(t.clone())  # FAULT:extra
            if here and fault == "extra_big":
                dist.all_reduce(torch.ones(4096))  # FAULT:extra_big (its peer's next all_reduce meets a larger message)
            if here and fault == "segv":
                import ctypes

                ctypes.string_at(0)  # FAULT:segv
            dist.all_reduce(t)  # SITE:C
            if step == s and fault == "checkpoint":
                if me == 0:
                    with wd.phase("checkpoint", timeout=timedelta(seconds=float(opts["timeout"]) * 5)):
                        time.sleep(float(opts["timeout"]) * 2)  # healthy: long save on rank 0 only
                dist.barrier()
            if step == s and fault in ("val_short", "val_even", "val_short_list", "val_even_list"):
                # a validation pass from a DataLoader (val_short_list: a plain list), a metric
                # all_reduce per batch (float32[metric], 1 unless said) and the pass's count at its
                # end (int64[1]); with fault val_short* rank K's pass is shorter. gloo aborts the
                # rank that receives the larger message: a peer (metric=1), the short rank (metric=256)
                n = 3 if bad and fault in ("val_short", "val_short_list") else 6  # FAULT:val_short
                batches = list(range(n)) if fault.endswith("_list") else torch.utils.data.DataLoader(list(range(n)), batch_size=1)
                for _ in batches:
                    dist.all_reduce(torch.ones(int(opts.get("metric", "1"))))  # SITE:val_metric
                dist.all_reduce(torch.tensor([n], dtype=torch.int64))  # SITE:val_count
            if step == s and fault == "eval":
                for _ in range(8):  # healthy: long evaluation, each batch ends with a metric all_reduce
                    time.sleep(float(opts["timeout"]) / 3)
                    dist.all_reduce(torch.ones(2))
            time.sleep(float(opts["step_s"]))
    dist.barrier()
    dist.destroy_process_group()
    return 0


def handlers_kept(argv: list[str]) -> int:
    """The watchdog leaves the user's SIGTERM/SIGUSR1 handlers and the wakeup fd alone."""
    def mine(signum: int, frame: Any) -> None:
        return None

    signal.signal(signal.SIGTERM, mine)
    signal.signal(signal.SIGUSR1, mine)
    before_fd = signal.set_wakeup_fd(-1)
    signal.set_wakeup_fd(before_fd)
    dist.init_process_group("gloo")
    from distdiag import HangWatchdog

    original = dist.all_reduce
    # wrap=True: this checks that the wrappers are installed and removed (off by default)
    with HangWatchdog(timeout=timedelta(seconds=5), wrap=True) as wd:
        wrapped = dist.all_reduce is not original
        for step in range(3):
            wd.step(step)
            dist.all_reduce(torch.ones(4))
        threads = [t.name for t in threading.enumerate()]
    restored = dist.all_reduce is original
    gone = "distdiag-watchdog" not in [t.name for t in threading.enumerate()]
    ok = (
        signal.getsignal(signal.SIGTERM) is mine
        and signal.getsignal(signal.SIGUSR1) is mine
        and signal.set_wakeup_fd(-1) == before_fd
        and wrapped and restored and gone and "distdiag-watchdog" in threads
    )
    print(f"handlers_kept ok={ok} wrapped={wrapped} restored={restored} gone={gone}", file=sys.stderr)
    dist.destroy_process_group()
    return 0 if ok else 1


def fsdp_dtensor(argv: list[str]) -> int:
    """FSDP2 and DTensor collectives are fingerprinted while armed (no false desync over steps)."""
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard
    from torch.distributed.tensor import Replicate, Shard, distribute_tensor

    from distdiag import HangWatchdog

    dist.init_process_group("gloo")
    mesh = init_device_mesh("cpu", (dist.get_world_size(),))
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(16, 16), torch.nn.Linear(16, 4))
    for layer in model:
        fully_shard(layer, mesh=mesh)
    fully_shard(model, mesh=mesh)
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    # wrap=True: what is checked is the wrappers' fingerprints of FSDP2's and DTensor's
    # collectives (the step-mark digests); the recorder has no such live comparison
    with HangWatchdog(timeout=timedelta(seconds=10), dump_dir="hang-report", wrap=True) as wd:
        for step in range(4):
            wd.step(step)
            model(torch.randn(4, 16)).sum().backward()
            opt.step()
            opt.zero_grad()
        dt = distribute_tensor(torch.ones(8, 4), mesh, [Shard(0)])
        dt.redistribute(mesh, [Replicate()]).to_local()
        wd.step(99)
        time.sleep(1.0)  # a few watchdog ticks: the step-mark digests are compared
        ops = {r.op for r in wd._progress.records}
    print(f"recorded ops: {sorted(ops)}", file=sys.stderr)
    dist.barrier()
    dist.destroy_process_group()
    fsdp = {"all_gather_single", "reduce_scatter_single"} | {"all_gather_into_tensor", "reduce_scatter_tensor"}
    return 0 if ops & fsdp and any(op.startswith("funcol:") for op in ops) else 1


def p2p(argv: list[str]) -> int:
    """A hand-written pipeline (isend/irecv per microbatch: activations forward, gradients back)
    or a ring (each rank isends to the next, irecvs from the previous), under the watchdog.
    fault=skip_grad: the last stage skips one gradient send at step=S; fault=skip_ring: rank=K
    skips its isend at step=S; fault=none: the healthy twin."""
    opts = _opts(argv)
    dist.init_process_group("gloo", timeout=timedelta(seconds=120))
    from distdiag import HangWatchdog

    me, world, s, fault = dist.get_rank(), dist.get_world_size(), int(opts["step"]), opts["fault"]
    lin = torch.nn.Linear(8, 8)
    opt = torch.optim.SGD(lin.parameters(), lr=0.01)
    with HangWatchdog(timeout=timedelta(seconds=float(opts["timeout"])), dump_dir="hang-report"):
        for step in range(int(opts["steps"])):
            if opts.get("kind") == "ring":
                out, got = torch.full((4,), float(me)), torch.empty(4)
                if not (fault == "skip_ring" and me == int(opts["rank"]) and step == s):
                    send = dist.isend(out, dst=(me + 1) % world)  # SITE:ring_send
                else:
                    send = None  # FAULT:skip_ring
                dist.irecv(got, src=(me - 1) % world).wait()
                if send is not None:
                    send.wait()
            else:
                acts = []
                for _ in range(2):
                    x = torch.randn(2, 8) if me == 0 else torch.empty(2, 8)
                    if me > 0:
                        dist.irecv(x, src=me - 1).wait()
                    x.requires_grad_(True)
                    y = lin(x)
                    acts.append((x, y))
                    if me < world - 1:
                        dist.isend(y.detach(), dst=me + 1).wait()
                for mb, (x, y) in reversed(list(enumerate(acts))):
                    g = torch.ones_like(y) if me == world - 1 else torch.empty_like(y)
                    if me < world - 1:
                        dist.irecv(g, src=me + 1).wait()
                    y.backward(g)
                    skip = fault == "skip_grad" and me == world - 1 and step == s and mb == 0  # FAULT:skip_grad
                    if me > 0 and not skip:
                        dist.isend(x.grad, dst=me - 1).wait()
            opt.step()
            opt.zero_grad()
            time.sleep(float(opts["step_s"]))
    dist.barrier()
    dist.destroy_process_group()
    return 0
