"""The programs `.ci/gpu-check` runs on a GPU machine (docs/gpu-check.md), one subcommand each.

Each prints `RESULT <name> ok|FAIL: <what was seen>` lines, and exits 0 when everything it
checked held, 1 when something did not, 77 when it cannot run here (no CUDA: `SKIP <why>`).

    python .ci/gpu_steps.py env              versions of python, torch, CUDA, NCCL, NVML, deps
    python .ci/gpu_steps.py units            distdiag's CUDA/NCCL/NVML paths on one GPU, in-process
    python .ci/gpu_steps.py fork clean|touch forkrun's choice before and after CUDA is touched
    python .ci/gpu_steps.py fr_job           (under `distdiag watch`) an all_reduce queued behind
                                             a long kernel; flight-recorder dumps while it waits
    python .ci/gpu_steps.py capture          a recorder reader thread during CUDA-graph captures
    python .ci/gpu_steps.py report FILE      one line per probe of a distdiag JSON report

Only the standard library and what distdiag needs; torch is imported by each subcommand.
"""

from __future__ import annotations

import json
import os
import socket
import sys
import threading
import time
from datetime import timedelta
from types import SimpleNamespace
from typing import Any

SKIP = 77
GIB = 2**30


class Results:
    """RESULT lines and the exit code: 0 when every check held."""

    def __init__(self) -> None:
        self.failed = 0

    def check(self, name: str, ok: bool, detail: str) -> None:
        print(f"RESULT {name} {'ok' if ok else 'FAIL'}: {detail}", flush=True)
        self.failed += 0 if ok else 1

    def run(self, name: str, fn: Any) -> None:
        try:
            fn()
        except Exception as exc:  # noqa: BLE001 - a check that raises is a failed check, the rest go on
            self.check(name, False, f"raised {type(exc).__name__}: {str(exc)[:300]}")

    def code(self) -> int:
        return 1 if self.failed else 0


def _cuda() -> Any:
    """torch with a usable GPU, or exit 77 saying why not."""
    try:
        import torch
    except ImportError as exc:
        print(f"SKIP no GPU: torch is not importable ({exc})", flush=True)
        sys.exit(SKIP)
    if not torch.cuda.is_available():
        print(f"SKIP no GPU: torch {torch.__version__} says torch.cuda.is_available() is False", flush=True)
        sys.exit(SKIP)
    return torch


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def _one_rank_nccl(torch: Any) -> Any:
    """A world of one on NCCL, GPU 0 (no launcher: a TCP rendezvous on a free local port)."""
    import torch.distributed as dist

    dev = torch.device("cuda", 0)
    torch.cuda.set_device(dev)
    dist.init_process_group("nccl", device_id=dev, rank=0, world_size=1, init_method=f"tcp://127.0.0.1:{_free_port()}",
                            timeout=timedelta(seconds=120))
    return dev


def _cycles_per_s(torch: Any) -> float:
    """How many torch.cuda._sleep cycles make a second on this GPU."""
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    start.record()
    torch.cuda._sleep(200_000_000)
    end.record()
    torch.cuda.synchronize()
    return 2e8 / (start.elapsed_time(end) / 1000.0)


# -- env ---------------------------------------------------------------------------------------
def cmd_env() -> int:
    import importlib

    info: dict[str, Any] = {"python": sys.version.split()[0], "executable": sys.executable}
    for mod in ("torch", "numpy", "psutil", "pynvml", "typer", "orjson", "setuptools"):
        try:
            info[mod] = getattr(importlib.import_module(mod), "__version__", "present")
        except Exception as exc:  # noqa: BLE001 - reported, not raised
            info[mod] = f"MISSING ({type(exc).__name__}: {exc})"
    try:
        import torch

        info.update(cuda_build=torch.version.cuda, cuda_available=torch.cuda.is_available())
        if torch.cuda.is_available():
            props = torch.cuda.get_device_properties(0)
            info.update(gpus=torch.cuda.device_count(), name=props.name, total_gib=round(props.total_memory / GIB, 1),
                        uuid=str(props.uuid), nccl=".".join(map(str, torch.cuda.nccl.version())))
        c10d = torch._C._distributed_c10d
        info["dump_functions"] = [n for n in ("_dump_nccl_trace", "_dump_nccl_trace_json", "_dump_fr_trace_json")
                                  if hasattr(c10d, n)]
    except Exception as exc:  # noqa: BLE001 - reported, not raised
        info["torch_error"] = f"{type(exc).__name__}: {exc}"
    print(json.dumps(info, indent=1, default=str))
    missing = sorted(k for k, v in info.items() if isinstance(v, str) and v.startswith("MISSING") and k != "setuptools")
    print(f"RESULT env {'FAIL' if missing else 'ok'}: torch {info.get('torch')} CUDA {info.get('cuda_build')} "
          f"NCCL {info.get('nccl')} on {info.get('gpus', 0)} x {info.get('name', 'no GPU')}"
          + (f"; missing: {', '.join(missing)}" if missing else ""), flush=True)
    return 1 if missing else 0


# -- units -------------------------------------------------------------------------------------
def _losses(torch: Any, res: Results) -> None:
    """Item 1: the built-in losses on a model on the GPU, fed the batch on the CPU."""
    from distdiag.workloads import get_workload
    from distdiag.workloads import sequence as seqw

    for name in ("mlp", "transformer"):
        w = get_workload(name)
        torch.manual_seed(0)
        model = w.build_model().cuda()
        loss = w.loss_fn(model, w.shard_batch(w.make_batch(1), 0, 1))
        loss.backward()
        res.check(f"loss_{name}", loss.device.type == "cuda" and bool(torch.isfinite(loss)), f"{float(loss):.4f} on {loss.device}")
    lm = seqw.TinyCausalLM(vocab=64, max_len=64).cuda()
    loss = seqw.sp_loss(lm, seqw.make_lm_batch(batch_size=2, seq_len=32, vocab=64, pad=4))
    res.check("loss_sequence", loss.device.type == "cuda" and bool(torch.isfinite(loss)), f"{float(loss):.4f} on {loss.device}")


def _parity(torch: Any, res: Results) -> None:
    """Item 1: loss_parity's comparison of a GPU tensor with a CPU reference."""
    from distdiag.probes.numerics.loss_parity import compare_tensors

    ref = {"w": torch.randn(64, 32), "b": torch.randn(32)}
    out = compare_tensors(ref, {k: v.cuda() for k, v in ref.items()}, 1.0, fit=True)
    res.check("parity_compare", out["max_abs"] == 0.0 and not out["bad"], f"max abs {out['max_abs']}, bad {out['bad']}")


def _timing(torch: Any, dev: Any, res: Results) -> None:
    """Item 7: an all_reduce queued behind a 1 s kernel, timed around the call and after a sync."""
    import torch.distributed as dist

    from distdiag.probes.cluster.collectives import device_clock

    cycles = _cycles_per_s(torch)
    x = torch.ones(1 << 20, device=dev)
    dist.all_reduce(x)
    torch.cuda.synchronize()
    torch.cuda._sleep(int(cycles * 1.0))
    started = time.perf_counter()
    dist.all_reduce(x)
    launch = time.perf_counter() - started
    done = device_clock(dev) - started
    res.check("collective_timing", done >= 0.5 and launch < done,
              f"perf_counter around the call {launch * 1e3:.1f} ms; device_clock {done * 1e3:.0f} ms (1 s kernel ahead)")


def _ulysses(torch: Any, dev: Any, res: Results) -> None:
    """Item 12: the Ulysses attention against its reference on the same device."""
    from distdiag.probes.sequence_parallel.probe import attention_tolerance, ulysses_attention

    def a2a(out: Any, inp: Any, *args: Any, **kwargs: Any) -> None:  # a world of one
        out.copy_(inp)

    gen = torch.Generator().manual_seed(7)
    q, k, v = (torch.randn(1, 8, 4, 8, generator=gen) for _ in range(3))
    pos = torch.arange(8)[None]
    _, out, ref = ulysses_attention(q, k, v, pos, slice(0, 8), 1, a2a, dev)
    _, _, cpu_ref = ulysses_attention(q, k, v, pos, slice(0, 8), 1, a2a, torch.device("cpu"))
    err, tol = float((out - ref).abs().max()), attention_tolerance(dev)
    res.check("ulysses_tolerance", err <= tol,
              f"GPU vs GPU reference {err:.2e} (tolerance {tol:g}); GPU vs CPU reference {float((ref.cpu() - cpu_ref).abs().max()):.2e}")


def _reader(torch: Any, dev: Any, res: Results) -> None:
    """Item 5: a recorder read on a thread of its own takes the rank's device."""
    from distdiag.hang.recorder import EngineReader

    seen: dict[str, Any] = {}

    def read() -> None:
        view = EngineReader().read(details=True, tail=8)
        seen.update(device=torch.cuda.current_device(), state=view["state"],
                    groups=[(g["backend"], g["group"], g["enqueued"], g["completed"]) for g in view.get("groups", [])])

    thread = threading.Thread(target=read, name="reader")
    thread.start()
    thread.join(60)
    ok = seen.get("device") == dev.index and seen.get("state") == "ok"
    res.check("reader_thread", ok, f"thread's device {seen.get('device')} (rank's {dev.index}); view {seen.get('state')} "
              f"{seen.get('groups')} (one GPU: device 0 either way; several GPUs tell more)")


def _fork_and_env(torch: Any, dev: Any, res: Results) -> None:
    """Items 11 and 2: the driver seen in use once CUDA is up; the GPU's UUID as NVML takes it."""
    from distdiag.launcher.forkrun import cuda_in_parent
    from distdiag.probes.cluster.env import _device_uuid

    why = cuda_in_parent()
    res.check("fork_detect", why is not None, f"cuda_in_parent() after CUDA init: {why}")
    uuid = _device_uuid(dev)
    from distdiag.probes.cluster import gpu as G

    nvml, reason = G._nvml()
    if nvml is None:
        res.check("env_uuid", False, f"NVML: {reason}")
        return
    try:
        name = G._text(nvml.nvmlDeviceGetName(nvml.nvmlDeviceGetHandleByUUID(uuid)))
        res.check("env_uuid", True, f"{uuid} -> {name}")
    finally:
        nvml.nvmlShutdown()


def _memory(torch: Any, dev: Any, res: Results) -> None:
    """Item 8: 4 GiB held by this process are not "another process's"."""
    from distdiag.probes.cluster import gpu as G

    nvml, reason = G._nvml()
    if nvml is None:
        res.check("gpu_memory", False, f"NVML: {reason}")
        return
    try:
        ctx = SimpleNamespace(device=dev, info=SimpleNamespace(local_rank=0))
        handle, label = G._device_handle(nvml, ctx)
        block = torch.empty(4 * GIB, dtype=torch.uint8, device=dev)
        del block  # freed to torch's cache: still reserved, still used in NVML's eyes
        reading = G.read_device(nvml, handle)
        reading["own"] = G._own_usage(ctx)
        total, free = reading["memory_total"], reading["memory_free"]
        others, how = G.memory_held_by_others(total, free, reading["processes"], reading["own"])
        flagged = [f["issue"] for f in G.assess_device(reading, G.GpuConfig(), label) if "GiB free" in f["issue"]]
        res.check("gpu_memory", (total - free) - others >= 0.9 * 4 * GIB,
                  f"used {(total - free) / GIB:.1f} GiB, others {others / GIB:.1f} GiB ({how}); "
                  f"processes {reading['processes']}; own {reading['own']}; finding: {flagged or 'none'}")
        print(json.dumps({k: v for k, v in reading.items() if k not in ("unsupported", "errors")}, default=str))
    finally:
        nvml.nvmlShutdown()


def cmd_units() -> int:
    torch = _cuda()
    res = Results()
    res.run("losses", lambda: _losses(torch, res))
    res.run("parity_compare", lambda: _parity(torch, res))
    dev = _one_rank_nccl(torch)
    for name, fn in (("collective_timing", _timing), ("ulysses_tolerance", _ulysses), ("reader_thread", _reader),
                     ("fork_detect", _fork_and_env), ("gpu_memory", _memory)):
        res.run(name, lambda fn=fn: fn(torch, dev, res))
    import torch.distributed as dist

    dist.destroy_process_group()
    return res.code()


# -- fork --------------------------------------------------------------------------------------
def cmd_fork(mode: str) -> int:
    """forkrun's choice in a process that imported what `distdiag check` imports before it
    forks (the default suite's preloads: FSDP2, DTensor, torch._dynamo, DCP): fork while nothing
    asked the CUDA driver, spawn once something did (`touch`)."""
    import importlib

    torch = _cuda()
    from distdiag.launcher.forkrun import cuda_in_parent, plan_preloads, start_method

    for name in plan_preloads([], 1 << 16):
        try:
            importlib.import_module(name)
        except Exception as exc:  # noqa: BLE001 - as forkrun: the rank that needs it reports it
            print(f"NOTE preloading {name} failed: {exc}", flush=True)
    if mode == "touch":
        torch.cuda.is_available()
        torch.cuda.init()
    method = start_method()
    expected = "spawn" if mode == "touch" else "fork"
    print(f"RESULT fork_{mode} {'ok' if method == expected else 'FAIL'}: start_method {method} (expected {expected}); "
          f"cuda_in_parent: {cuda_in_parent()}", flush=True)
    return 0 if method == expected else 1


# -- fr_job (run by `distdiag watch --nproc-per-node 1 ... -- gpu_steps.py fr_job`) ------------
def _write(work: str, folder: str, data: Any, suffix: str = "") -> None:
    import torch.distributed as dist

    path = os.path.join(work, folder)
    os.makedirs(path, exist_ok=True)
    name = os.path.join(path, f"nccl_trace_rank_{dist.get_rank()}{suffix}")
    with open(name, "wb" if isinstance(data, bytes) else "w") as handle:
        handle.write(data)


def cmd_fr_job() -> int:
    """An all_reduce queued behind a kernel of SLEEP_S seconds: the watchdog (timeout 5 s,
    action report) declares the hang while it waits; dumps while pending and after."""
    torch = _cuda()
    import torch.distributed as dist

    work, sleep_s = os.environ["GPU_CHECK_WORK"], float(os.environ.get("GPU_CHECK_SLEEP_S", "20"))
    dev = torch.device("cuda", int(os.environ.get("LOCAL_RANK", "0")))
    torch.cuda.set_device(dev)
    dist.init_process_group("nccl", device_id=dev, timeout=timedelta(seconds=600))
    side = dist.new_group(backend="gloo")  # a gloo group beside NCCL's, as the check's side group
    x = torch.ones(1 << 20, device=dev)
    for _ in range(4):
        dist.all_reduce(x)
    dist.all_reduce(torch.ones(8), group=side)
    cycles = _cycles_per_s(torch)
    c10d = torch._C._distributed_c10d
    torch.cuda._sleep(int(cycles * sleep_s))  # the GPU is busy for sleep_s
    started = time.perf_counter()
    dist.all_reduce(x)  # returns at once: enqueued behind the kernel
    call_s = time.perf_counter() - started
    time.sleep(1.0)
    _write(work, "fr_pending", c10d._dump_nccl_trace(True, True, False))
    _write(work, "fr_pending_json", c10d._dump_nccl_trace_json(True, False), ".json")
    started = time.perf_counter()
    value = float(x[0].item())  # the training thread blocks here, as a loss's .item() does
    blocked_s = time.perf_counter() - started
    _write(work, "fr_done", c10d._dump_nccl_trace(True, True, False))
    print(f"RESULT fr_job {'ok' if call_s < 1.0 and blocked_s > sleep_s / 2 else 'FAIL'}: all_reduce call {call_s:.3f} s, "
          f".item() blocked {blocked_s:.1f} s, value {value:g}", flush=True)
    dist.destroy_process_group()
    return 0


# -- capture -----------------------------------------------------------------------------------
def cmd_capture() -> int:
    """Does a thread reading the NCCL flight recorder (as distdiag's reader does on snapshots)
    break CUDA-graph captures on the main thread (capture_error_mode "global", the default)?"""
    torch = _cuda()
    import torch.distributed as dist

    from distdiag.hang.recorder import EngineReader

    dev = _one_rank_nccl(torch)
    c10d = torch._C._distributed_c10d
    x = torch.ones(1 << 16, device=dev)
    dist.all_reduce(x)
    torch.cuda.synchronize()
    cycles = _cycles_per_s(torch)
    stop, errors, reads = threading.Event(), [], [0]

    def poll() -> None:
        reader = EngineReader()
        while not stop.is_set():
            try:
                c10d._dump_nccl_trace_json(True, False)
                reader.read(details=True, tail=16)
                reads[0] += 1
            except Exception as exc:  # noqa: BLE001 - counted and shown
                errors.append(repr(exc)[:200])

    a = torch.randn(256, 256, device=dev)
    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):  # warm-up outside any capture
        b = a @ a
        for _ in range(3):
            b = b + 1
    torch.cuda.current_stream().wait_stream(side)
    torch.cuda.synchronize()
    thread = threading.Thread(target=poll, name="recorder-poll", daemon=True)
    thread.start()
    results = []
    for _ in range(15):
        torch.cuda._sleep(int(cycles * 0.2))  # an NCCL entry not yet retired when the capture starts
        dist.all_reduce(x)
        graph = torch.cuda.CUDAGraph()
        try:
            with torch.cuda.graph(graph):
                b = a @ a
                for _ in range(500):
                    b = b + 1
            graph.replay()
            results.append("ok")
        except Exception as exc:  # noqa: BLE001 - the finding this step is for
            results.append(repr(exc)[:200])
    torch.cuda.synchronize()
    stop.set()
    thread.join(5)
    bad = [r for r in results if r != "ok"]
    print(f"RESULT capture {'ok' if not bad and not errors else 'FAIL'}: {len(results)} captures, {len(bad)} failed; "
          f"{reads[0]} recorder reads, {len(errors)} raised", flush=True)
    for line in bad[:3] + errors[:3]:
        print(f"NOTE {line}", flush=True)
    dist.destroy_process_group()
    return 1 if bad or errors else 0


# -- report ------------------------------------------------------------------------------------
def cmd_report(path: str) -> int:
    try:
        with open(path) as handle:
            text = handle.read()
        report = json.loads(text[text.index("{"):])
    except (OSError, ValueError) as exc:
        print(f"RESULT report FAIL: no JSON report at {path}: {exc}", flush=True)
        return 1
    print(f"RESULT report: {report.get('verdict')} exit {report.get('exit_code')} outcome {report.get('outcome')}", flush=True)
    for probe in report.get("probes", []):
        worst = [f for f in probe.get("findings", []) if f.get("severity") in ("critical", "error", "warning")]
        first = f" - {worst[0].get('severity')}: {worst[0].get('issue', '')[:200]}" if worst else ""
        print(f"  {probe.get('name')}: {probe.get('status')}{first}", flush=True)
    return 0


def main(argv: list[str]) -> int:
    commands = {"env": cmd_env, "units": cmd_units, "fr_job": cmd_fr_job, "capture": cmd_capture}
    if argv and argv[0] in commands and len(argv) == 1:
        return commands[argv[0]]()
    if len(argv) == 2 and argv[0] == "fork" and argv[1] in ("clean", "touch"):
        return cmd_fork(argv[1])
    if len(argv) == 2 and argv[0] == "report":
        return cmd_report(argv[1])
    print(__doc__, file=sys.stderr)
    return 2


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
