"""Multi-group jobs (a 2-D mesh, a pipeline, two groups) with one fault: who stopped, who waits.

Issue 22: a rank stuck on one group strands the members of another group that wait on the
stranded ones; the report must name the rank where the chain of waits ends, not the ranks
it stranded. `train(argv)` is the harness entry (in-code `HangWatchdog` around the loop);
run as a script (`torchrun -m distdiag.watch -- mesh_workers.py ...`) it is an unchanged
user script with no watchdog code (steps from torch's optimizer hook).

Words (key=value):
  kind=tpdp      4 ranks, init_device_mesh("cpu", (2, 2), ("dp", "tp")): per step a TP
                 all-reduce of the activations, then a DP all-reduce of the grads
  kind=epdp      the same mesh with ("dp", "ep"): an expert-parallel all_to_all_single in place
                 of the TP all-reduce
  kind=pp        4 ranks, pp=2 x dp=2: first stages (ranks 0,2) send activations to the
                 last stages (1,3) with dist.send/recv, which send the grads back; a DP
                 all-reduce per stage ([0,2] and [1,3])
  kind=cycle     3 ranks, groups [0,1], [1,2], [0,2]; per step each rank all-reduces on its
                 two groups in one global order
  kind=3d        8 ranks, TP x PP x DP (2, 2, 2): TP all-reduce, send/recv, DP all-reduce
  kind=uneven    2+ ranks, data parallel (an all-reduce of the grads per step)
  kind=groups    2+ ranks: process groups made after the watchdog armed, then data parallel
                 steps on one of them and on the world. fault=order (3+ ranks): rank K makes
                 two overlapping groups in the other order; fault=members: a group of all
                 but the last rank made only by its members; fault=local: the same with
                 use_local_synchronization=True (no fault)
  kind=twins     2+ ranks, two groups of the same members (every rank), made with descs
                 desc=tp,dp (or tp,tp: the same desc): per step two all-reduces on the first,
                 one on the second; fault=stall stops rank K before the group in=first|second
  fault=none|stall|kill|deadlock|raise|uneven
      stall:    rank K stops at step S (tpdp: in its data loader before the TP all-reduce;
                pp: in its loss, K a last stage)
      kill:     (tpdp) rank K is SIGKILLed in its data loader at step S: its TP partner and
                its DP partner lose their connection to it; the fourth rank is stranded
      deadlock: (cycle) from step S rank K issues its two groups in the opposite order
      raise:    rank K raises in its loss at step S
      uneven:   (uneven) rank K has one batch fewer; then next=barrier|accelerate|metric|save
  rank=K|all step=S steps=N timeout=T (watchdog seconds) wd=code|none
Each fault is one line with a marker comment, so tests can find its line.
"""

from __future__ import annotations

import os
import signal
import sys
import threading
import time
from datetime import timedelta
from typing import Any

import torch
import torch.distributed as dist

if __name__ == "__main__":  # run as an unchanged script: the repository root for `tests`
    sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__)))))

from tests.faults.watchdog_workers import _NoWatchdog  # noqa: E402

__all__ = ["train"]


def _opts(argv: list[str]) -> dict[str, str]:
    out = {"kind": "tpdp", "fault": "none", "rank": "3", "step": "2", "steps": "5", "timeout": "3", "wd": "code",
           "step_s": "0.05", "next": "barrier"}
    for word in argv:
        key, _, value = word.partition("=")
        out[key] = value
    return out


def _hang_started() -> None:
    """When the fault starts (for the latency figures of benchmarks/bench_waitfor.py)."""
    with open("hang_started", "w") as handle:
        handle.write(repr(time.time()))


def _ranks(o: dict[str, str]) -> set[int]:
    """rank=K, or rank=all (every rank: an error everywhere)."""
    return set(range(dist.get_world_size())) if o["rank"] == "all" else {int(o["rank"])}


def load_next_microbatch(i: int, o: dict[str, str], me: int) -> torch.Tensor:
    if o["fault"] == "stall" and me == int(o["rank"]) and i == int(o["step"]):
        _hang_started()
        threading.Event().wait()  # FAULT:stall-loader (stuck in its data loader, outside any collective)
    if o["fault"] == "kill" and me == int(o["rank"]) and i == int(o["step"]):
        _hang_started()
        os.kill(os.getpid(), signal.SIGKILL)  # FAULT:kill-loader (the OOM killer, a node lost: gone at once)
    torch.manual_seed(i * 10 + me)
    return torch.randn(4, 8)


def compute_loss(i: int, o: dict[str, str], me: int, y: torch.Tensor) -> torch.Tensor:
    if me in _ranks(o) and i == int(o["step"]):
        if o["fault"] == "stall":
            _hang_started()
            threading.Event().wait()  # FAULT:stall-loss (stuck in its loss, outside any collective)
        if o["fault"] == "raise":
            _hang_started()
            raise RuntimeError(f"loss is nan at step {i}")  # FAULT:raise
    return y.pow(2).mean()


def _tpdp(o: dict[str, str], wd: Any, me: int) -> None:
    from torch.distributed.device_mesh import init_device_mesh

    inner = "ep" if o["kind"] == "epdp" else "tp"
    mesh = init_device_mesh("cpu", (2, 2), mesh_dim_names=("dp", inner))
    tp, dp = mesh.get_group(inner), mesh.get_group("dp")
    w = torch.nn.Parameter(torch.ones(8, 8))
    opt = torch.optim.SGD([w], lr=0.01)
    for i in range(int(o["steps"])):
        x = load_next_microbatch(i, o, me)
        h = x @ w
        if inner == "ep":
            dist.all_to_all_single(torch.empty_like(h), h.detach(), group=tp)  # the expert dispatch
        else:
            dist.all_reduce(h.detach(), group=tp)  # the TP all-reduce of the activations
        compute_loss(i, o, me, h).backward()
        dist.all_reduce(w.grad, group=dp)  # the DP all-reduce of the grads
        opt.step()
        opt.zero_grad()
        time.sleep(float(o["step_s"]))


def _pp(o: dict[str, str], wd: Any, me: int) -> None:
    # stage = rank % 2 (ranks 0,2 first stage, 1,3 last stage); rank r's peer stage is r ^ 1;
    # the data-parallel pairs are [0,2] and [1,3]
    dp = [dist.new_group([0, 2]), dist.new_group([1, 3])][me % 2]
    peer, first = me ^ 1, me % 2 == 0
    w = torch.nn.Parameter(torch.ones(8, 8))
    opt = torch.optim.SGD([w], lr=0.01)
    for i in range(int(o["steps"])):
        if first:
            h = load_next_microbatch(i, o, me) @ w
            dist.send(h.detach(), peer)
            g = torch.empty(4, 8)
            dist.recv(g, peer)
            h.backward(g)
        else:
            x = torch.empty(4, 8)
            dist.recv(x, peer)
            x.requires_grad_(True)
            compute_loss(i, o, me, x @ w).backward()
            dist.send(x.grad, peer)
        dist.all_reduce(w.grad, group=dp)
        opt.step()
        opt.zero_grad()
        time.sleep(float(o["step_s"]))


def _three_d(o: dict[str, str], wd: Any, me: int) -> None:
    """8 ranks, mesh ("pp", "dp", "tp") = (2, 2, 2): a TP all-reduce per stage, send/recv
    between the stages (rank r and r ^ 4), a DP all-reduce of the grads."""
    from torch.distributed.device_mesh import init_device_mesh

    mesh = init_device_mesh("cpu", (2, 2, 2), mesh_dim_names=("pp", "dp", "tp"))
    tp, dp = mesh.get_group("tp"), mesh.get_group("dp")
    peer, first = me ^ 4, me < 4
    w = torch.nn.Parameter(torch.ones(8, 8))
    opt = torch.optim.SGD([w], lr=0.01)
    for i in range(int(o["steps"])):
        if first:
            h = load_next_microbatch(i, o, me) @ w
            dist.all_reduce(h.detach(), group=tp)
            dist.send(h.detach(), peer)
            g = torch.empty(4, 8)
            dist.recv(g, peer)
            h.backward(g)
        else:
            x = torch.empty(4, 8)
            dist.recv(x, peer)
            x.requires_grad_(True)
            y = x @ w
            dist.all_reduce(y.detach(), group=tp)
            compute_loss(i, o, me, y).backward()
            dist.send(x.grad, peer)
        dist.all_reduce(w.grad, group=dp)
        opt.step()
        opt.zero_grad()
        time.sleep(float(o["step_s"]))


_RING = {0: ("01", "02"), 1: ("01", "12"), 2: ("12", "02")}
"""kind=cycle: each rank's two groups, in the order every rank issues them (01, then 12, then 02)."""


def _cycle(o: dict[str, str], wd: Any, me: int) -> None:
    groups = {"01": dist.new_group([0, 1]), "12": dist.new_group([1, 2]), "02": dist.new_group([0, 2])}
    w = torch.nn.Parameter(torch.ones(8, 8))
    opt = torch.optim.SGD([w], lr=0.01)
    for i in range(int(o["steps"])):
        x = load_next_microbatch(i, o, me)
        compute_loss(i, o, me, x @ w).backward()
        order = list(_RING[me])
        if o["fault"] == "deadlock" and me == int(o["rank"]) and i >= int(o["step"]):
            _hang_started()
            order.reverse()  # FAULT:deadlock (this rank issues its two groups in the opposite order)
        for name in order:
            dist.all_reduce(w.grad, group=groups[name])
        opt.step()
        opt.zero_grad()
        time.sleep(float(o["step_s"]))


def _make_groups(o: dict[str, str], me: int) -> Any:
    """The groups of kind=groups, made the way fault= says; returns the groups this rank trains on."""
    world = dist.get_world_size()
    if o["fault"] in ("order", "none") and world >= 3:
        first, last = list(range(world - 1)), list(range(1, world))  # two overlapping groups
        if o["fault"] == "order" and me == int(o["rank"]):
            _hang_started()
            b = dist.new_group(last); a = dist.new_group(first)  # FAULT:group-order (its config lists them the other way)  # noqa: E702
        else:
            a = dist.new_group(first); b = dist.new_group(last)  # noqa: E702
        return [g for g, ranks in ((a, first), (b, last)) if me in ranks]
    # a group of all but the last rank (a logging or metrics group), then the pairs everyone trains on
    # (with 2 or 4 ranks the numbers then collide in a way gloo always hangs on; with 3 the pair
    # groups can meet the right peers by chance)
    low = list(range(max(1, world - 1)))
    if o["fault"] == "members":
        if me in low:
            dist.new_group(low)
        else:
            _hang_started()  # FAULT:group-members (only the members create it)
    elif o["fault"] == "local":
        if me in low:  # the members alone, which a hashed name allows: no fault
            dist.new_group(low, use_local_synchronization=True)
    else:
        dist.new_group(low)
    pairs = [list(range(i, min(i + 2, world))) for i in range(0, world, 2)]
    made = [dist.new_group(p) for p in pairs]
    return [made[me // 2]]


def _groups(o: dict[str, str], wd: Any, me: int) -> None:
    """Process groups made inside the watched job (fault=order|members|local|none), then data
    parallel steps on the group made and on the world."""
    groups = _make_groups(o, me)
    w = torch.nn.Parameter(torch.ones(8, 8))
    opt = torch.optim.SGD([w], lr=0.01)
    for i in range(int(o["steps"])):
        x = load_next_microbatch(i, o, me)
        compute_loss(i, o, me, x @ w).backward()
        for group in groups:
            dist.all_reduce(w.grad, group=group)
        dist.all_reduce(w.grad)
        opt.step()
        opt.zero_grad()
        time.sleep(float(o["step_s"]))


def _twins(o: dict[str, str], wd: Any, me: int) -> None:
    """Two groups of the same members (Megatron's data-parallel group beside its context-parallel
    twin at cp=1): their sequence numbers are their own, so the report must keep them apart."""
    everyone = list(range(dist.get_world_size()))
    descs = o.get("desc", "tp,dp").split(",")
    first, second = (dist.new_group(everyone, group_desc=d) for d in descs)
    t = torch.ones(4)
    for i in range(int(o["steps"])):
        dist.all_reduce(t, group=first)
        if o["fault"] == "stall" and me == int(o["rank"]) and i == int(o["step"]) and o.get("in") == "first":
            _hang_started()
            threading.Event().wait()  # FAULT:stall-twin-first (before the first group's second all-reduce)
        dist.all_reduce(t, group=first)
        if o["fault"] == "stall" and me == int(o["rank"]) and i == int(o["step"]) and o.get("in") != "first":
            _hang_started()
            threading.Event().wait()  # FAULT:stall-twin-second (before the second group's all-reduce)
        dist.all_reduce(t, group=second)
        wd.step()
        time.sleep(float(o["step_s"]))


def wait_for_everyone(o: dict[str, str]) -> None:
    """What the short rank does once out of data: a barrier (accelerate's wait_for_everyone), a
    validation all-reduce of a metric, or a checkpoint save (no collective)."""
    _hang_started()
    if o["next"] == "barrier":
        dist.barrier()  # FAULT:uneven-barrier (the short rank's next call is a collective)
    elif o["next"] == "accelerate":  # the barrier is in accelerate's state.py, called from here
        from accelerate import PartialState

        PartialState(cpu=True).wait_for_everyone()  # FAULT:uneven-accelerate
    elif o["next"] == "metric":
        dist.all_reduce(torch.zeros(1))  # FAULT:uneven-metric (a validation sync)
    else:
        time.sleep(600)  # FAULT:uneven-save (the short rank writes its checkpoint)


def _uneven(o: dict[str, str], wd: Any, me: int) -> None:
    """Data parallel on every rank; with fault=uneven, rank K has one batch fewer."""
    w = torch.nn.Parameter(torch.ones(8, 8))
    opt = torch.optim.SGD([w], lr=0.01)
    batches = int(o["steps"]) - (1 if o["fault"] == "uneven" and me == int(o["rank"]) else 0)
    for i in range(batches):
        x = load_next_microbatch(i, o, me)
        compute_loss(i, o, me, x @ w).backward()
        dist.all_reduce(w.grad)
        opt.step()
        opt.zero_grad()
        time.sleep(float(o["step_s"]))
    if o["fault"] == "uneven" and me == int(o["rank"]):
        wait_for_everyone(o)


def train(argv: list[str]) -> int:
    o = _opts(argv)
    dist.init_process_group("gloo", timeout=timedelta(seconds=120))
    me = dist.get_rank()
    if o["wd"] == "none":
        wd: Any = _NoWatchdog()
    else:
        from distdiag import HangWatchdog

        wd = HangWatchdog(timeout=timedelta(seconds=float(o["timeout"])), dump_dir="hang-report")
    with wd:
        {"tpdp": _tpdp, "epdp": _tpdp, "pp": _pp, "cycle": _cycle, "uneven": _uneven, "3d": _three_d,
         "groups": _groups, "twins": _twins}[o["kind"]](o, wd, me)
    dist.barrier()
    dist.destroy_process_group()
    return 0


if __name__ == "__main__":
    sys.exit(train(sys.argv[1:] + ["wd=none"]))
