"""Rank entry for tests/dist/test_settle.py: does gloo's worker thread still hold a collective's
tensor when the collective returns, and does `wait_released` (and the monitor's close, often a
script's last collective) wait until it does not?

argv: SCENARIO WORKDIR. Scenarios:
  collectives     40 all_reduces of a fresh tensor: how many were still held on return, and
                  whether each was released by `wait_released`
  monitor_close   a small DDP loop under TrainingMonitor; close()'s last look records what its
                  wait returned; before it, the at-exit settle of the last look (for scripts
                  that never call close())
  gloo_idle       a DDP loop (its gradient all_reduces are the script's own collectives, issued
                  by torch in C++): `wait_gloo_idle` after the last backward, right after an
                  all_reduce, and while an all_reduce is pending on rank 0 only (rank 1 enters it
                  later): the worker blocked in the network counts as idle, the wait returns
Each rank writes WORKDIR/settle{rank}.json.
"""

from __future__ import annotations

import json
import os
import sys

import torch
import torch.distributed as dist

from distdiag.runtime.settle import gloo_workers, use_counts, wait_gloo_idle, wait_released


def _collectives() -> dict:
    held_on_return = released = 0
    for i in range(40):
        t = torch.full((1024,), float(i))
        before = use_counts([t])
        dist.all_reduce(t)
        held_on_return += int(t._use_count() > before[0])
        ok = wait_released([t], before)
        released += int(ok and t._use_count() <= before[0])
    return {"held_on_return": held_on_return, "released": released, "calls": 40}


def _monitor_close() -> dict:
    import distdiag.monitor.monitor as monitor_module
    from distdiag.monitor import TrainingMonitor

    waits: list[bool] = []
    real = monitor_module.wait_released

    def recording(tensors, before, timeout_s=2.0):
        ok = real(tensors, before, timeout_s)
        waits.append(ok and all(t._use_count() <= b for t, b in zip(tensors, before, strict=True)))
        return ok

    monitor_module.wait_released = recording
    torch.manual_seed(0)
    model = torch.nn.parallel.DistributedDataParallel(torch.nn.Sequential(torch.nn.Linear(8, 16), torch.nn.Tanh(), torch.nn.Linear(16, 1)))
    opt = torch.optim.SGD(model.parameters(), lr=0.01)
    monitor = TrainingMonitor(model, optimizer=opt, every=5)
    for step in range(12):
        x = torch.randn(8, 8)
        loss = torch.nn.functional.mse_loss(model(x), x.sum(1, keepdim=True))
        loss.backward()
        monitor.after_backward(loss, step)
        opt.step()
        opt.zero_grad()
    looks_before_close = len(waits)
    # a script that never calls close(): the last look's tensor is remembered (weakly), and the
    # handler atexit runs waits for it
    remembered = len(monitor_module._LAST_LOOK)
    ref, held = monitor_module._LAST_LOOK[0]
    monitor_module._settle_at_exit()
    vec = ref()
    settled = vec is None or vec._use_count() <= held[0]
    del vec
    monitor.close()
    return {"waits_during_loop": looks_before_close, "waits_at_close": waits[looks_before_close:],
            "remembered": remembered, "settled_at_exit": settled}


def _timed_idle() -> tuple[bool, float, list[str]]:
    import time

    t0 = time.monotonic()
    ok = wait_gloo_idle()
    return ok, round(time.monotonic() - t0, 4), sorted(state for state, _ in gloo_workers().values())


def _gloo_idle() -> dict:
    torch.manual_seed(0)
    model = torch.nn.parallel.DistributedDataParallel(torch.nn.Linear(64, 64))
    for _ in range(10):
        model(torch.randn(8, 64)).sum().backward()
    after_ddp = _timed_idle()
    t = torch.ones(1 << 16)
    dist.all_reduce(t)
    after_all_reduce = _timed_idle()
    # a collective only rank 0 has entered: its worker waits in the network, not for the GIL
    pending = None
    store = dist.distributed_c10d._get_default_store()
    if dist.get_rank() == 0:
        work = dist.all_reduce(torch.ones(4), async_op=True)
        pending = _timed_idle()
        store.set("settle/entered", "1")
        work.wait()
    else:
        store.wait(["settle/entered"])
        dist.all_reduce(torch.ones(4))
    return {"workers": len(gloo_workers()), "after_ddp": after_ddp, "after_all_reduce": after_all_reduce,
            "pending": pending}


def main(argv: list[str]) -> int:
    scenario, workdir = argv[0], argv[1]
    dist.init_process_group("gloo")
    try:
        out = {"collectives": _collectives, "monitor_close": _monitor_close, "gloo_idle": _gloo_idle}[scenario]()
        with open(os.path.join(workdir, f"settle{dist.get_rank()}.json"), "w") as fh:
            json.dump(out, fh)
        dist.barrier()
    finally:
        dist.destroy_process_group()
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
