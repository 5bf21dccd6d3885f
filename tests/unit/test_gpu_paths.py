"""The decisions on distdiag's CUDA, NCCL and NVML paths, as plain functions tested on CPU (no
GPU here, issue 35): which GPU a rank takes, when NCCL's start events are turned on, how a
collective is timed, what GPU memory another process holds, when fork is unsafe, how closely a
GPU's attention must match, and what a hang report says where the recorder is blind. The GPU
itself is exercised by .ci/gpu-check (docs/gpu-check.md)."""

from __future__ import annotations

import pytest

from distdiag.errors import ConfigError
from distdiag.runtime.context import choose_device


def test_one_gpu_per_local_rank() -> None:
    assert choose_device(0, 4, 8) == (0, "nccl")
    assert choose_device(3, 4, 8) == (3, "nccl")
    assert choose_device(0, 1, 0) == (None, "gloo")  # no CUDA: the CPU


def test_more_local_ranks_than_gpus_is_bad_input_on_every_local_rank() -> None:
    """`local_rank % gpus` put two ranks on one GPU, and NCCL refused them at init."""
    for rank in range(4):  # every local rank says it, not only the ones past the last GPU
        with pytest.raises(ConfigError) as err:
            choose_device(rank, 4, 2, host="node7", visible="0,1")
        line = str(err.value)
        assert "\n" not in line and "4 local ranks on host node7 but 2 GPU(s)" in line
        assert "--nproc-per-node 2" in line and "--backend gloo" in line and "CUDA_VISIBLE_DEVICES='0,1'" in line


def test_one_visible_gpu_per_rank_is_a_binding_not_a_collision() -> None:
    """Slurm --gpus-per-task=1: each of 8 local ranks sees one GPU, its own, as cuda:0."""
    assert choose_device(5, 8, 1, visible="5") == (0, "nccl")
    with pytest.raises(ConfigError):
        choose_device(1, 2, 1)  # one GPU and nothing hides the others: shared


def test_backend_choice() -> None:
    assert choose_device(0, 4, 2, backend="gloo") == (None, "gloo")  # CUDA visible, gloo asked: the CPU
    assert choose_device(0, 4, 0, backend="gloo") == (None, "gloo")
    assert choose_device(1, 2, 2, backend="nccl") == (1, "nccl")
    with pytest.raises(ConfigError, match="--backend nccl needs a GPU"):
        choose_device(0, 1, 0, backend="nccl")
    with pytest.raises(ConfigError, match="check.backend must be one of auto, nccl, gloo"):
        choose_device(0, 1, 0, backend="mpi")


def test_backend_is_a_check_option() -> None:
    from distdiag.check.plan import parse_config

    assert parse_config([]).backend == "auto"
    assert parse_config(["--backend", "gloo"]).backend == "gloo"
    with pytest.raises(ConfigError, match="invalid choice"):
        parse_config(["--backend", "mpi"])


def test_nccl_start_events_only_when_asked(monkeypatch) -> None:
    """TORCH_NCCL_ENABLE_TIMING (a start and a timing end event per NCCL collective) is set
    only when asked, never with the recorder off, and a value the user set is kept."""
    from distdiag.hang.recorder import FR_BUFFER_ENV, NCCL_TIMING_ENV, enable_recorder

    for name in (FR_BUFFER_ENV, NCCL_TIMING_ENV, "TORCH_NCCL_TRACE_BUFFER_SIZE"):
        monkeypatch.delenv(name, raising=False)
    import os

    enable_recorder(2000)  # the check, and the watch wrapper by default
    assert os.environ[FR_BUFFER_ENV] == "2000" and NCCL_TIMING_ENV not in os.environ
    monkeypatch.delenv(FR_BUFFER_ENV)
    enable_recorder(0, timing=True)  # --flight-recorder 0 --nccl-timing: nothing at all
    assert FR_BUFFER_ENV not in os.environ and NCCL_TIMING_ENV not in os.environ
    enable_recorder(500, timing=True)
    assert os.environ[NCCL_TIMING_ENV] == "1" and os.environ[FR_BUFFER_ENV] == "500"
    monkeypatch.setenv(NCCL_TIMING_ENV, "0")
    enable_recorder(500, timing=True)
    assert os.environ[NCCL_TIMING_ENV] == "0"


def test_watch_asks_for_start_events_by_flag_or_environment(monkeypatch) -> None:
    from distdiag.watch import build_parser, nccl_timing
    from distdiag.watchdog.config import WATCHDOG_NCCL_TIMING

    monkeypatch.delenv(WATCHDOG_NCCL_TIMING, raising=False)
    assert build_parser().parse_args(["--nccl-timing", "x.py"]).nccl_timing is True
    assert nccl_timing(None) is False and nccl_timing(True) is True
    monkeypatch.setenv(WATCHDOG_NCCL_TIMING, "1")
    assert nccl_timing(None) is True
    monkeypatch.setenv(WATCHDOG_NCCL_TIMING, "yes")
    assert nccl_timing(None) is False


def test_reader_threads_take_the_ranks_gpu_once_cuda_is_up(monkeypatch) -> None:
    """A thread reading the recorder gets the rank's device (LOCAL_RANK 2 of 4 visible GPUs),
    once, and only when CUDA is initialised; the main thread's device is never touched. The
    CUDA answers are stand-ins (no GPU here); the threads are real."""
    import threading

    import torch

    from distdiag.hang import recorder

    calls: list[int] = []
    monkeypatch.setattr(torch.cuda, "set_device", calls.append)
    monkeypatch.setattr(torch.cuda, "device_count", lambda: 4)
    monkeypatch.setenv("LOCAL_RANK", "2")

    def reads(times: int) -> None:
        for _ in range(times):
            recorder.bind_reader_thread()

    monkeypatch.setattr(torch.cuda, "is_initialized", lambda: False)
    t = threading.Thread(target=reads, args=(2,))
    t.start(), t.join()
    assert calls == []  # CUDA not up: nothing set, nothing initialised
    monkeypatch.setattr(torch.cuda, "is_initialized", lambda: True)
    t = threading.Thread(target=reads, args=(3,))
    t.start(), t.join()
    reads(2)  # the main thread
    assert calls == [2]


def _nccl_snaps() -> dict[int, dict]:
    """Three ranks' snapshots as the live reader gives them on NCCL: ranks 0 and 1 inside
    all_reduce #12 on the world, rank 2 never entered it."""
    from tests.unit.test_engine import history, nccl_dump, snaps_of

    dumps = {r: nccl_dump(12, None, 11, history(12, "scheduled")) for r in (0, 1)}
    dumps[2] = nccl_dump(11, None, 11, history(11, "completed"))
    snaps = snaps_of(dumps)
    for snap in snaps.values():
        for g in snap["engine"]["groups"]:
            g["backend"] = "nccl"
    return snaps


@pytest.mark.parametrize("name", ["TORCH_NCCL_BLOCKING_WAIT", "NCCL_BLOCKING_WAIT"])
def test_blocking_wait_makes_the_recorder_view_a_note_not_a_verdict(monkeypatch, name) -> None:
    """TORCH_NCCL_BLOCKING_WAIT=1: torch hands no NCCL work to its watchdog and the recorder
    never moves. The check's hang result and the watchdog's say so beside the lead finding and
    claim no more than BLIND_CONFIDENCE; without the variable (or on gloo) nothing changes."""
    from distdiag.check.consolidate import hang_result
    from distdiag.runtime.blind import BLIND_CONFIDENCE, BLOCKING_WAIT_ENVS, blind_spot
    from distdiag.watchdog.writer import analyse_and_detail

    for other in BLOCKING_WAIT_ENVS:
        monkeypatch.delenv(other, raising=False)
    snaps = _nccl_snaps()

    def check_findings():
        return hang_result("collectives", snaps, {}, {}, 3, timeout_s=30, reason="deadline", duration_s=30).findings

    def watchdog_findings():
        event = {"kind": "timeout", "rank": 0, "detail": "no progress"}
        return analyse_and_detail(event, snaps, {}, {}, 3, 30)[0]

    plain = check_findings()
    assert plain[0].severity == "critical" and plain[0].ranks == [2] and plain[0].confidence > BLIND_CONFIDENCE
    assert not any(f.cause == "recorder_blind" for f in plain + watchdog_findings())
    monkeypatch.setenv(name, "1")
    for findings in (check_findings(), watchdog_findings()):
        assert findings[0].severity == "critical" and findings[1].cause == "recorder_blind"
        assert f"{name}=1" in findings[1].issue and "stale" in findings[1].issue
        assert all(f.confidence <= BLIND_CONFIDENCE for f in findings if f.cause != "recorder_blind")
    gloo = {r: {**s, "engine": {**s["engine"], "groups": [{**g, "backend": "fr"} for g in s["engine"]["groups"]]}}
            for r, s in snaps.items()}
    assert blind_spot(snaps=gloo.values()) is None  # blocking wait is NCCL's: gloo's recorder still moves


def test_collectives_are_timed_once_the_device_is_done(monkeypatch) -> None:
    """An NCCL call returns when enqueued: the clock is read after the device synchronised,
    before and after the timed call; on the CPU (gloo returns when done) nothing is waited on."""
    import torch

    from distdiag.probes.cluster import collectives as C

    synced: list[torch.device] = []
    monkeypatch.setattr(torch.cuda, "synchronize", lambda device=None: synced.append(device))
    C.device_clock(torch.device("cpu"))
    assert synced == []
    gpu = torch.device("cuda", 1)
    checker = C._Checker(0, 2, gpu)
    started = checker.start()
    checker.timed("all_reduce", started)
    assert synced == [gpu, gpu] and checker.timings["all_reduce"] >= 0.0


def test_the_probe_times_with_its_device(monkeypatch) -> None:
    """Every timed collective of the probe goes through the device's clock (the world ops and
    the barrier), with a real comm on one rank: gloo, world 1, no collective issued outside."""
    import torch

    from distdiag.probes.cluster import collectives as C

    seen: list[torch.device] = []
    real = C.device_clock
    monkeypatch.setattr(C, "device_clock", lambda device: seen.append(device) or real(device))

    class OneRankComm:
        def all_reduce(self, t, op=None, group=None): return None  # noqa: E704, ANN001
        def broadcast(self, t, src=0): return None  # noqa: E704, ANN001
        def all_gather(self, outs, t): outs[0].copy_(t)  # noqa: E704, ANN001
        def all_gather_into_tensor(self, out, t): out.copy_(t)  # noqa: E704, ANN001
        def reduce_scatter_tensor(self, out, t): out.copy_(t)  # noqa: E704, ANN001
        def all_to_all_single(self, out, t, a=None, b=None): out.copy_(t)  # noqa: E704, ANN001
        def send_recv(self, send, dst, recv, src): recv.copy_(send)  # noqa: E704, ANN001
        def barrier(self): return None  # noqa: E704

    checker = C._Checker(0, 1, torch.device("cpu"))
    ops = C._WorldOps(OneRankComm(), 0, 1, 8, checker, set(C.OPS), "float32", torch.float32, torch.device("cpu"))
    ops.reductions(), ops.gathers(), ops.exchanges(barrier=True)
    assert set(checker.timings) == {"all_reduce", "all_gather", "reduce_scatter_tensor", "barrier"}
    assert len(seen) == 8 and set(seen) == {torch.device("cpu")}
    assert checker.failures == []


GIB = 2**30


def test_memory_of_other_processes_leaves_this_process_out() -> None:
    """An 80 GiB GPU read after NCCL's init: 6 GiB used, all of it this process's (torch's cache
    and its context). Before issue 35 that was "only 74 of 80 GiB free ... another process holds
    GPU memory" at a 0.95 threshold; now it is nobody else's."""
    from distdiag.probes.cluster.gpu import OWN_OVERHEAD_BYTES, memory_held_by_others

    total, free = 80 * GIB, 74 * GIB
    mine = [{"pid": 4242, "used": 6 * GIB}]
    others, how = memory_held_by_others(total, free, mine, {"pid": 4242, "reserved": 5 * GIB, "cuda_context": True})
    assert others == 0 and "pid 4242" in how and "left out" in how
    # Another process beside it: exactly its share.
    two = mine + [{"pid": 99, "used": 20 * GIB}]
    others, how = memory_held_by_others(total, 54 * GIB, two, {"pid": 4242, "reserved": 5 * GIB, "cuda_context": True})
    assert others == 20 * GIB and "pid 99 20.0 GiB" in how
    # In a container NVML shows host pids (ours is not among them), or no per-process numbers:
    # torch's reserved memory and the context allowance come off instead.
    hidden = [{"pid": 777001, "used": 6 * GIB}]
    for procs in (hidden, None, [{"pid": 4242, "used": None}]):
        others, how = memory_held_by_others(total, free, procs, {"pid": 4242, "reserved": 5 * GIB, "cuda_context": True})
        assert others == max(0, 6 * GIB - 5 * GIB - OWN_OVERHEAD_BYTES) and "reserved by torch" in how
    # Nothing known of this process: all used memory counts, and the evidence says so.
    assert memory_held_by_others(total, free, None, None) == (6 * GIB, "6.0 GiB used (this process's own share not known)")
    # No CUDA context in this process (a gloo check with CUDA visible): used memory is others'.
    assert memory_held_by_others(total, free, None, {"pid": 1, "reserved": 0, "cuda_context": False})[0] == 6 * GIB


def test_the_memory_finding_reads_the_other_processes_share() -> None:
    from distdiag.probes.cluster.gpu import GpuConfig, assess_device

    def findings(free, processes, own):
        reading = {"memory_total": 80 * GIB, "memory_free": free, "processes": processes, "own": own, "errors": {}}
        return [f for f in assess_device(reading, GpuConfig(min_free_memory_fraction=0.95), "h cuda:0") if "GiB free" in f["issue"]]

    own = {"pid": 10, "reserved": 5 * GIB, "cuda_context": True}
    assert findings(74 * GIB, [{"pid": 10, "used": 6 * GIB}], own) == []
    (f,) = findings(54 * GIB, [{"pid": 10, "used": 6 * GIB}, {"pid": 11, "used": 20 * GIB}], own)
    assert "only 60.0 of 80.0 GiB free for this job: other processes hold 20.0 GiB" in f["issue"] and "pid 11" in f["evidence"]


def test_ulysses_reference_is_computed_where_the_sharded_attention_is() -> None:
    """sequence_parallel's Ulysses check on a "GPU" (meta here, one rank: the all_to_all is a
    copy): the round trip, the sharded attention and the unsharded reference all stay on the
    device. Before issue 35 the reference ran on the CPU against a 1e-5 absolute tolerance, and
    the positions' mask stayed on the CPU beside the GPU's scores (which raises)."""
    import torch

    from distdiag.probes.sequence_parallel.probe import ulysses_attention

    def a2a(out, inp, out_splits=None, in_splits=None, group=None):  # noqa: ANN001 - one rank
        out.copy_(inp)

    gen = torch.Generator().manual_seed(7)
    q, k, v = (torch.randn(1, 4, 2, 8, generator=gen) for _ in range(3))
    pos = torch.arange(4)[None]
    meta = torch.device("meta")
    back, out, ref = ulysses_attention(q, k, v, pos, slice(0, 4), 1, a2a, meta)
    assert {back.device, out.device, ref.device} == {meta} and out.shape == ref.shape == (1, 4, 2, 8)
    back, out, ref = ulysses_attention(q, k, v, pos, slice(0, 4), 1, a2a, torch.device("cpu"))
    assert torch.equal(back, q) and float((out - ref).abs().max()) <= 1e-5


def test_attention_tolerance_follows_the_device_and_tf32(monkeypatch) -> None:
    import torch

    from distdiag.probes.sequence_parallel.probe import attention_tolerance

    gpu = torch.device("cuda", 0)
    monkeypatch.setattr(torch, "get_float32_matmul_precision", lambda: "highest")
    assert not torch.backends.cuda.matmul.allow_tf32  # torch's default
    assert attention_tolerance(torch.device("cpu")) == 1e-5 and attention_tolerance(gpu) == 1e-4
    monkeypatch.setattr(torch, "get_float32_matmul_precision", lambda: "high")  # TF32 matmuls
    assert attention_tolerance(gpu) == 1e-2 and attention_tolerance(torch.device("cpu")) == 1e-5
