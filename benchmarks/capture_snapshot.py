"""One real rank's hang snapshot, from a small real gloo run, for bench_scale.py `--real` to replicate.

    python benchmarks/capture_snapshot.py [--entries 2000] [--depth 30] [--reads 20] [--out FILE]

Two gloo ranks arm distdiag's HangWatchdog with its defaults (no wrappers where torch's flight
recorder gives call sites, as on torch 2.13; the recorder kept to `--entries` entries), run
more collectives than the recorder keeps through a call chain `--depth` frames deep (a real
trainer's stack: the loop, the model's modules, the framework), then rank 0's watchdog thread
takes the snapshot it posts when a hang is declared (watcher.py `_snapshot`: the progress,
the stack, the recorder read with its tail and call sites), `--reads` times, timed, and packs
it as it is posted (runtime/incident.py `compact_snapshot`). Written to `--out` (default
benchmarks/results/real_snapshot.json): the snapshot, its packed sizes, and each read's and
pack's seconds. Made once; bench_scale reads the file.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))
DEFAULT_OUT = ROOT / "benchmarks" / "results" / "real_snapshot.json"


def _deep(depth: int, fn, *args):  # a trainer's call chain: the loop, modules, the framework
    if depth <= 0:
        return fn(*args)
    return _deep(depth - 1, fn, *args)


def _worker(rank: int, port: int, args: argparse.Namespace) -> None:
    os.environ.update(RANK=str(rank), WORLD_SIZE="2", LOCAL_RANK=str(rank), LOCAL_WORLD_SIZE="2",
                      MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), TORCH_FR_BUFFER_SIZE=str(args.entries))
    import torch
    import torch.distributed as dist

    from distdiag.hang.records import IncidentEvent
    from distdiag.runtime.incident import compact_snapshot
    from distdiag.watchdog.core import HangWatchdog

    dist.init_process_group("gloo")
    sub = dist.new_group([0, 1])
    dog = HangWatchdog(timeout=__import__("datetime").timedelta(minutes=5), action="report").start()
    t = torch.ones(1024)
    for step in range(args.entries // 4 + 50):  # more than the recorder keeps: it is full
        dog.step(step)
        _deep(args.depth, dist.all_reduce, t)
        _deep(args.depth, dist.all_reduce, t, dist.ReduceOp.SUM, sub)
        _deep(args.depth, dist.broadcast, t, 0)
        _deep(args.depth, dist.all_gather_into_tensor, torch.empty(2048), t)
    watcher = dog._watcher
    end = time.monotonic() + 60
    while watcher.engine.sites_state in ("cold", "warming") and time.monotonic() < end:
        time.sleep(0.2)  # the call sites' one-time warm-up (the watcher's own tick starts it)
    if rank == 0:
        event = IncidentEvent.from_dict({"kind": "timeout", "rank": 1, "detail": "no progress for 300s"})
        reads, packs = [], []
        snap = None
        for _ in range(args.reads):
            start = time.perf_counter()
            # what the watchdog thread does before it posts, the training thread deep in its call chain
            # (here the same thread: its stack is the chain's)
            snap = _deep(args.depth, watcher._snapshot, event)
            reads.append(time.perf_counter() - start)
            start = time.perf_counter()
            core, hist = compact_snapshot(type(snap).from_dict(snap.to_dict()))
            packs.append(time.perf_counter() - start)
        parts = _parts(watcher.engine, args.reads)
        data = snap.to_dict()
        out = {"torch": torch.__version__, "recorder_entries": args.entries, "depth": args.depth,
               "sites_state": watcher.engine.sites_state, "wrap": dog.config.wrap, "read_s": reads, "pack_s": packs, "parts_cpu_s": parts,
               "packed_bytes": len(core), "history_bytes": len(hist) if hist else 0, "snapshot": data}
        Path(args.out).parent.mkdir(parents=True, exist_ok=True)
        Path(args.out).write_text(json.dumps(out, indent=1, default=str))
    dist.barrier()
    dog.close()
    dist.destroy_process_group()


def _parts(engine, n: int) -> dict[str, list[float]]:
    """The snapshot read's parts, CPU seconds of this thread: the recorder read without call
    sites, torch's stack dump (pickle, symbolized), and its parse (distdiag/hang/dumps.py)."""
    from distdiag.hang.dumps import parse_dump

    out: dict[str, list[float]] = {"read_without_sites": [], "torch_stack_dump": [], "parse_stack_dump": []}
    for _ in range(max(1, n // 4)):
        start = time.thread_time()
        engine.read(details=True, tail=32, sites=False)
        out["read_without_sites"].append(time.thread_time() - start)
        for tag, fn in engine._stack_fns:
            start = time.thread_time()
            raw = fn(includeCollectives=True, includeStackTraces=True, onlyActive=False)
            out["torch_stack_dump"].append(time.thread_time() - start)
            start = time.thread_time()
            parse_dump(raw, tag)
            out["parse_stack_dump"].append(time.thread_time() - start)
            out.setdefault("stack_dump_bytes", []).append(len(raw))
    return out


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--entries", type=int, default=2000, help="the flight recorder's size (TORCH_FR_BUFFER_SIZE)")
    parser.add_argument("--depth", type=int, default=30, help="frames of the trainer's call chain above each collective")
    parser.add_argument("--reads", type=int, default=20)
    parser.add_argument("--out", default=str(DEFAULT_OUT))
    args = parser.parse_args()
    import socket

    import torch.multiprocessing as tmp

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    tmp.spawn(_run, args=(port, args), nprocs=2)
    data = json.loads(Path(args.out).read_text())
    reads = sorted(data["read_s"])
    print({k: [round(x, 4) for x in v] for k, v in data["parts_cpu_s"].items()})
    print(f"snapshot read: median {reads[len(reads) // 2] * 1000:.1f} ms, max {reads[-1] * 1000:.1f} ms; packed "
          f"{data['packed_bytes']} B + history {data['history_bytes']} B; call sites {data['sites_state']}; -> {args.out}")
    return 0


def _run(rank: int, port: int, args: argparse.Namespace) -> None:
    _worker(rank, port, args)


if __name__ == "__main__":
    sys.exit(main())
