"""Synthetic hang incidents at scale: every rank's snapshot, as the live watchdog writer feeds
them to `distdiag.hang.analyze_hang` (distdiag/watchdog/progress.py `Progress.snapshot` plus
the watcher's rank/host/pid, with the engine view distdiag/hang/recorder.py `EngineReader.read`
returns). Pure Python, no processes: benchmarks/bench_hang_scale.py times the analysis on
them and tests/unit/test_hang_scale.py checks the report stays readable.

The job: TP=8 x PP=4 x DP=N/32, tensor-parallel ranks innermost (one TP group per host of 8),
rank = dp*32 + pp*8 + tp. Replica dp=0 is held up at pipeline stage `stage`:
  - `stall`: rank (dp 0, stage, tp 3) computes in load_next_microbatch, outside any collective;
    its TP peers wait in tp all_reduce #6 for it;
  - `host`: the host of (dp 0, stage) is lost (its 8 ranks posted nothing);
the other stages of replica 0 wait in their pp broadcast #5 for that stage's member, and every
other replica finished the step and waits in dp all_reduce #11 for replica 0's member.
"""

from __future__ import annotations

from typing import Any

TP, PP = 8, 4
SEQ = {"world": 2, "tp": 6, "pp": 5, "dp": 11}
OP = {"world": "barrier", "tp": "all_reduce", "pp": "broadcast", "dp": "all_reduce"}
SHAPE = {"world": [1], "tp": [4096, 1024], "pp": [8, 4096], "dp": [1048576]}
SITE = {
    "world": "train.py:40 in setup", "tp": "model.py:212 in row_parallel_forward",
    "pp": "pipeline.py:97 in recv_activations", "dp": "train.py:131 in sync_gradients",
}


def coords(rank: int) -> tuple[int, int, int]:
    """(dp, pp, tp) of a rank."""
    return rank // (TP * PP), (rank // TP) % PP, rank % TP


def host_of(rank: int) -> str:
    return f"node{rank // TP:04d}"


def groups_of(rank: int, world: int) -> dict[str, list[int]]:
    """The rank's four groups by kind: world, tp, pp, dp (members, global ranks)."""
    dp, pp, tp = coords(rank)
    base = dp * TP * PP
    return {
        "world": list(range(world)),
        "tp": [base + pp * TP + t for t in range(TP)],
        "pp": [base + p * TP + tp for p in range(PP)],
        "dp": [d * TP * PP + pp * TP + tp for d in range(world // (TP * PP))],
    }


def label(kind: str, members: list[int]) -> str:
    return "world" if kind == "world" else "ranks[" + ",".join(map(str, members)) + "]"


def _record(kind: str, group: str, seq: int, for_s: float | None = None, rank: int = 0) -> dict[str, Any]:
    c: dict[str, Any] = {
        "op": OP[kind], "group": group, "seq": seq, "shape": SHAPE[kind], "dtype": "bfloat16",
        "call_site": SITE[kind], "step": 42, "fp": f"{OP[kind]}|{tuple(SHAPE[kind])}|bfloat16|{SITE[kind]}",
    }
    if for_s is None:  # each rank's own, as on a real job: a whole record is rarely another rank's
        c["duration_s"] = round(0.002 + (rank * 7 + seq * 13) % 97 * 1e-5, 6)
    else:
        c["for_s"] = for_s
    return c


def _history(labels: dict[str, str], done: dict[str, int], rank: int = 0) -> list[dict[str, Any]]:
    """The last 16 completed collectives, in the order a step issues them (tp, pp, dp)."""
    out = []
    for kind in ("tp", "pp", "dp"):
        out += [_record(kind, labels[kind], s, rank=rank) for s in range(max(1, done[kind] - 4), done[kind] + 1)]
    return out[-16:]


def _stack(kind: str | None) -> list[str]:
    # as distdiag/watchdog/progress.py writes frames: 'path:line in function: source'
    top = ["/job/train.py:160 in <module>: main()", "/job/train.py:122 in train_step: batch = load_next_microbatch(it)"]
    if kind is None:
        return [*top, "/job/data.py:58 in load_next_microbatch: return next(self.iterator)"]
    return [*top, f"/job/{SITE[kind]}: dist.{OP[kind]}(t, group=g)",
            f"/usr/lib/python3/site-packages/torch/distributed/distributed_c10d.py:2850 in {OP[kind]}: work.wait()"]


def _engine(labels: dict[str, str], done: dict[str, int], inside: str | None) -> dict[str, Any]:
    groups = []
    for i, kind in enumerate(("world", "tp", "pp", "dp")):
        enq = done[kind] + (1 if kind == inside else 0)
        g: dict[str, Any] = {"pg": str(i), "group": labels[kind], "backend": "cuda", "enqueued": enq,
                             "started": enq, "completed": done[kind], "pending": None}
        if kind == inside:
            g["pending"] = {"seq": enq, "op": OP[kind], "shape": SHAPE[kind], "dtype": "bfloat16",
                            "for_s": 61.0, "state": "started"}
        groups.append(g)
    return {"state": "ok", "groups": groups}


def rank_snapshot(rank: int, world: int, inside: str | None) -> dict[str, Any]:
    """One rank's snapshot: inside `inside`'s collective (tp|pp|dp) or computing (None)."""
    labels = {k: label(k, m) for k, m in groups_of(rank, world).items()}
    order = ["world", "tp", "pp", "dp"]
    # collectives completed: every kind before the one it waits in (a computing rank: before tp)
    first_open = order.index(inside) if inside else 1
    done = {k: SEQ[k] - (0 if i < first_open else 1) for i, k in enumerate(order)}
    return {
        "phase": "training", "phase_for_s": 61.0, "where": "step 42", "step": 42, "steps": 41,
        "step_source": "marks", "step_for_s": 61.0, "step_cadence_s": 0.8, "in_loop": True,
        "loop": "/job/train.py in main", "in_collective": _record(inside, labels[inside], SEQ[inside], 61.0) if inside else None,
        "collectives_in_probe": 5, "collectives_total": 400, "no_progress_s": 61.0, "phases": [],
        "history": _history(labels, done, rank), "recent": _history(labels, done, rank)[-8:],
        "stack": _stack(inside), "engine": _engine(labels, done, inside),
        "rank": rank, "host": host_of(rank), "pid": 10000 + rank % TP,
    }


def incident(world: int, kind: str = "stall", stage: int = 0) -> tuple[dict[int, dict[str, Any]], dict[int, str]]:
    """(snapshots, lost) for a `world`-rank job held up at replica 0's pipeline `stage`."""
    if world % (TP * PP):
        raise ValueError(f"world {world} is not a multiple of TP*PP = {TP * PP}")
    culprit = stage * TP + 3
    snaps: dict[int, dict[str, Any]] = {}
    lost: dict[int, str] = {}
    for rank in range(world):
        dp, pp, _tp = coords(rank)
        if dp == 0 and pp == stage:
            if kind == "host":
                lost[rank] = f"no snapshot: host {host_of(rank)} stopped answering"
                continue
            inside = None if rank == culprit else "tp"
        elif dp == 0:
            inside = "pp"
        else:
            inside = "dp"
        snaps[rank] = rank_snapshot(rank, world, inside)
    return snaps, lost
