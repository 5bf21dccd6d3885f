"""Writes the flight-recorder dump fixtures of older versions (run once; the JSON files are committed).

Sources: the flight-recorder tutorial's sample dump (pytorch/tutorials,
prototype_source/flight_recorder_tutorial.rst: version "2.3" in its first revision, "2.5"
now: pg_config keyed by group name with ranks as a string, pg_status, entries with frames,
process_group as a (name, desc) tuple in the pickle); torch's FlightRecorder constants for
the key names ("nccl_version" up to 2.9, "comm_lib_version" in 2.10, seen in torch 2.13's own
dumps). torch bumps the minor version when it adds fields only, so 2.2, 2.4, 2.6, 2.8 and 2.9
are modelled on their neighbours: 2.2 without pg_status/is_p2p/frames (the entries-only
path), the rest with the fields the versions around them show. The 2.9 fixture is the
multi-group NCCL case of issue 22: pg_id per process, TP/PP groups named by desc, a P2P-only
group counting the p2p sequence, a rank stalled on the host that wrote empty entries.
"""

import json

T0 = 1_724_779_239_936_775_119
FRAMES = [{"name": "train_step", "filename": "/job/train.py", "line": 44},
          {"name": "<module>", "filename": "/job/train.py", "line": 90}]


def entry(version, rid, pg_id, pg, op, seq, state, sizes=((3, 4),), p2p_seq=0, is_p2p=False):
    e = {"record_id": rid, "pg_id": pg_id, "process_group": list(pg), "collective_seq_id": 0 if is_p2p else seq,
         "p2p_seq_id": seq if is_p2p else p2p_seq, "op_id": rid + 1, "profiling_name": f"nccl:{op}",
         "time_created_ns": T0 + rid * 1000, "input_sizes": [list(s) for s in sizes], "input_dtypes": ["Float"],
         "output_sizes": [list(s) for s in sizes], "output_dtypes": ["Float"], "state": state,
         "time_discovered_started_ns": None, "time_discovered_completed_ns": T0 + rid * 1000 + 10 if state == "completed" else None,
         "retired": state == "completed", "timeout_ms": 600000}
    if version >= (2, 3):
        e["is_p2p"] = is_p2p
        e["frames"] = FRAMES
    return e


def simple(version_s):
    """Two ranks on the default group; rank 1 never entered all_reduce #3."""
    v = tuple(int(x) for x in version_s.split("."))
    out = {}
    for rank, n in ((0, 3), (1, 2)):
        entries = [entry(v, i, 0, ("0", "default_pg"), "all_reduce", i + 1, "completed") for i in range(n)]
        if rank == 0:
            entries[-1]["state"] = "started"
        d = {"version": version_s, "pg_config": {"0": {"name": "0", "desc": "default_pg", "ranks": "[0, 1]"}},
             "entries": entries}
        if v >= (2, 3):
            d["pg_status"] = {"0": {"last_enqueued_collective": n, "last_started_collective": n,
                                    "last_completed_collective": n - 1 if rank == 0 else n}}
        if (2, 4) <= v < (2, 10):
            d["nccl_version"] = "2.21.5"
        elif v >= (2, 10):
            d["comm_lib_version"] = "2.27.3"
        out[str(rank)] = d
    return out


TP, PP = "TENSOR_MODEL_PARALLEL_GROUP", "PIPELINE_MODEL_PARALLEL_GROUP"
CONFIG = {"0": {"name": "0", "desc": "default_pg", "ranks": "[0, 1, 2, 3]"},
          "1": {"name": "1", "desc": TP, "ranks": "[0, 1]"}, "2": {"name": "2", "desc": TP, "ranks": "[2, 3]"},
          "43": {"name": "43", "desc": PP, "ranks": "[0, 2]"}, "44": {"name": "44", "desc": PP, "ranks": "[1, 3]"}}
# rank -> (tp name, pp name, pp peer local index as 'send a->b' / 'recv a<-b')
LAYOUT = {0: ("1", "43", "send 0->1"), 1: ("1", "44", "send 0->1"), 2: ("2", "43", "recv 1<-0"), 3: ("2", "44", "recv 1<-0")}


def multigroup():
    """Four ranks, 4 steps of (tp all_reduce, pp send/recv, world all_reduce); in step 5 rank 3
    stalls on the host before anything: rank 2 waits in tp all_reduce #5 on [2,3], ranks 0-1
    finished tp #5 and wait in their pp send #5."""
    out = {}
    v = (2, 9)
    for rank in range(4):
        tp, pp, p2p = LAYOUT[rank]
        # pg_id counts this process's groups: the same id is a different group on other ranks
        ids = {"0": 0, tp: 1 + rank % 2, pp: 2 - rank % 2}
        entries, rid = [], 0
        for step in range(1, 6):
            plan = [(tp, "all_reduce", False), (pp, p2p, True), ("0", "all_reduce", False)]
            if rank == 2 and step == 5:
                plan = plan[:1]
            if rank in (0, 1) and step == 5:
                plan = plan[:2]
            for name, op, is_p2p in plan:
                state = "completed"
                if step == 5 and (rank == 2 or is_p2p):
                    state = "started"
                desc = CONFIG[name]["desc"]
                e = entry(v, rid, ids[name], (name, desc), op, step, state, sizes=((1024, 512),), is_p2p=is_p2p)
                e["collective_seq_id"] = str(e["collective_seq_id"])  # some writers give sequence ids as strings
                entries.append(e)
                rid += 1
        status = {}
        for name, pid in ids.items():
            last = {"0": 4, tp: 5, pp: 5}[name]
            done = last if name != pp and not (rank == 2 and name == tp) else last - 1
            if rank == 2 and name == pp:
                last, done = 4, 4
            status[str(pid)] = {"last_enqueued_collective": last, "last_started_collective": last,
                                "last_completed_collective": done}
        if rank == 3:  # stalled on the host: every op it recorded completed, the dump (onlyActive) is empty
            entries = []
            status = {str(p): {"last_enqueued_collective": 4, "last_started_collective": 4,
                               "last_completed_collective": 4} for p in ids.values()}
        out[str(rank)] = {"version": "2.9", "nccl_version": "2.27.3", "rank": rank,
                          "pg_config": {k: CONFIG[k] for k in ("0", tp, pp)}, "pg_status": status, "entries": entries}
    return out


if __name__ == "__main__":
    for ver in ("2.2", "2.3", "2.4", "2.5", "2.6", "2.7", "2.8", "2.10"):
        with open(f"v{ver.replace('.', '_')}.json", "w") as f:
            json.dump({"_source": __doc__.split("\n\n")[1].replace("\n", " "), "dumps": simple(ver)}, f, indent=1)
    with open("v2_9_multigroup.json", "w") as f:
        json.dump({"_source": __doc__.split("\n\n")[1].replace("\n", " "), "dumps": multigroup()}, f, indent=1)
