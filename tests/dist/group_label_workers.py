"""A 4-rank gloo job whose process groups take every form of label, and what it knows of them.

Groups: the default group; a 2x2 device mesh ("dp": [0,2] [1,3], "tp": [0,1] [2,3], torch's descs
mesh_dp / mesh_tp); two groups of [0,2] with the same desc "DP" (twins: only torch's group name
tells them apart); [1,3] with no desc. Each rank runs one all_reduce on every group it is in,
then writes:

- labels_K.json: per torch group name, the truth (`ranks`, `desc`) and the labels distdiag's
  live side builds for it: the recorder's (`group_label`, what the watchdog's wrappers use),
  the check's tracked collectives' (`comm.group_name`), and the live recorder reader's view
  (`EngineReader.read`: each group's label);
- json/fr_trace_K.json and pickle/nccl_trace_rank_K: torch's own flight-recorder dumps.

`job(argv)` is the harness entry (tests/harness.run_ranks).
"""

from __future__ import annotations

import json
import os

import torch
import torch.distributed as dist

__all__ = ["job"]


def _groups() -> dict[str, object]:
    from torch.distributed.device_mesh import init_device_mesh

    me = dist.get_rank()
    mesh = init_device_mesh("cpu", (2, 2), mesh_dim_names=("dp", "tp"))
    dp_a = dist.new_group([0, 2], group_desc="DP")
    dp_b = dist.new_group([0, 2], group_desc="DP")  # a twin of dp_a: same members, same desc
    plain = dist.new_group([1, 3])
    mine = {"world": dist.group.WORLD, "mesh_dp": mesh.get_group("dp"), "mesh_tp": mesh.get_group("tp")}
    if me in (0, 2):
        mine.update(dp_a=dp_a, dp_b=dp_b)
    else:
        mine["plain"] = plain
    return mine


def job(argv: list[str]) -> int:
    from distdiag.hang.recorder import EngineReader, group_label
    from distdiag.runtime.comm import group_name

    dist.init_process_group("gloo")
    me = dist.get_rank()
    try:
        groups = _groups()
        for pg in groups.values():
            dist.all_reduce(torch.ones(2), group=pg)
        view = EngineReader().read(details=False)
        live = {str(g["pg"]): g["group"] for g in view.get("groups") or []}
        truth = {}
        for pg in groups.values():
            name = pg.group_name
            truth[name] = {"ranks": dist.get_process_group_ranks(pg), "desc": pg.group_desc,
                           "recorder": group_label(name), "comm": group_name(pg)}
        with open(f"labels_{me}.json", "w") as f:
            json.dump({"state": view.get("state"), "groups": truth, "live": list(live.values())}, f)
        c10d = torch._C._distributed_c10d
        os.makedirs("json", exist_ok=True)
        os.makedirs("pickle", exist_ok=True)
        text = c10d._dump_fr_trace_json(True, False)
        with open(f"json/fr_trace_{me}.json", "wb") as f:
            f.write(text if isinstance(text, bytes) else text.encode())
        with open(f"pickle/nccl_trace_rank_{me}", "wb") as f:
            f.write(c10d._dump_fr_trace(includeCollectives=True, includeStackTraces=False, onlyActive=False))
        dist.barrier()
    finally:
        dist.destroy_process_group()
    return 0
