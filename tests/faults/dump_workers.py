"""A 4-rank gloo job with a 2x2 mesh (dp and tp groups) and a send/recv pair, that writes torch's
own flight-recorder dumps: the input of `distdiag hang-report DIR` as torch produces it.

`job(argv)` is the harness entry. Words (key=value): fault=none|stall, rank=K (the rank that
stalls), steps=N. Each step: all_reduce on the world, all_reduce on the rank's dp group
([0,2] or [1,3]), all_gather_into_tensor on its tp group ([0,1] or [2,3]), then rank 0 sends
to rank 1 on a P2P group [0,1]. With fault=stall, rank K sleeps (a host stall, no collective)
instead of its tp all_gather in the last step: its tp peer waits in that all_gather, the
others in the next world all_reduce.

Every rank writes its dump from a side thread once the job has had time to settle (the main
thread may be blocked inside a gloo collective; the GIL is released there):
pickle/nccl_trace_rank_K (`_dump_fr_trace`, torch's default pickle with Python frames) and
json/fr_trace_K.json (`_dump_fr_trace_json`), then the process ends itself (gloo cannot
unblock a collective; FACTS: ending a hung rank on gloo means ending the process).
"""

from __future__ import annotations

import os
import threading
import time

import torch
import torch.distributed as dist

__all__ = ["job"]

SETTLE_S = 4.0
"""How long after the last step the dumps are taken: every rank has reached where it stays."""


def _opts(argv: list[str]) -> dict[str, str]:
    out = {"fault": "none", "rank": "3", "steps": "2"}
    for word in argv:
        key, _, value = word.partition("=")
        out[key] = value
    return out


def _dump_then_exit(me: int, main_done: threading.Event) -> None:
    time.sleep(SETTLE_S)
    c10d = torch._C._distributed_c10d
    os.makedirs("pickle", exist_ok=True)
    os.makedirs("json", exist_ok=True)
    data = c10d._dump_fr_trace(includeCollectives=True, includeStackTraces=True, onlyActive=False)
    with open(f"pickle/nccl_trace_rank_{me}", "wb") as f:
        f.write(data)
    text = c10d._dump_fr_trace_json(True, False)
    with open(f"json/fr_trace_{me}.json", "wb") as f:
        f.write(text if isinstance(text, bytes) else text.encode())
    open(f"dumped_{me}", "w").close()
    # every rank ends only once all four dumped: an early exit would break the others' gloo pairs
    # before their dumps are written
    end = time.monotonic() + 60
    while not all(os.path.exists(f"dumped_{r}") for r in range(dist.get_world_size())) and time.monotonic() < end:
        time.sleep(0.05)
    main_done.wait(1.0)
    os._exit(0)


def _step(me: int, step: int, last: bool, o: dict[str, str], groups: dict[str, object]) -> None:
    t = torch.full((4,), float(me))
    dist.all_reduce(t)
    dist.all_reduce(t, group=groups["dp"])
    if o["fault"] == "stall" and last and me == int(o["rank"]):
        threading.Event().wait()  # FAULT:stall (a host stall instead of the tp all_gather)
    dist.all_gather_into_tensor(torch.zeros(8), t, group=groups["tp"])
    if me == 0:
        dist.send(torch.ones(3) * step, 1, group=groups["p2p"])
    elif me == 1:
        dist.recv(torch.zeros(3), 0, group=groups["p2p"])


def job(argv: list[str]) -> int:
    o = _opts(argv)
    dist.init_process_group("gloo")
    me = dist.get_rank()
    dp = [dist.new_group([0, 2]), dist.new_group([1, 3])]
    tp = [dist.new_group([0, 1]), dist.new_group([2, 3])]
    p2p = dist.new_group([0, 1])
    groups = {"dp": dp[me % 2], "tp": tp[me // 2], "p2p": p2p}
    done = threading.Event()
    threading.Thread(target=_dump_then_exit, args=(me, done), name="fr-dump", daemon=True).start()
    steps = int(o["steps"])
    try:
        for step in range(steps):
            _step(me, step, step == steps - 1, o, groups)
        dist.all_reduce(torch.ones(1))  # the next step's first collective: where a stall strands the others
    except RuntimeError:
        pass  # a peer ended after the dumps were written: the dump thread ends this process too
    done.set()
    threading.Event().wait()  # the dump thread ends the process
    return 0
