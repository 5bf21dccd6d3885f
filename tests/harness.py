"""The multi-process harness: N real ranks, a real TCPStore in the parent, hard timeouts.

Ranks are forked from a forkserver that has already imported torch and distdiag, so a rank
starts in milliseconds instead of paying torch's import (seconds on 2 cores). The parent
hosts the TCPStore the way torchrun's agent does (TORCHELASTIC_USE_AGENT_STORE=True), so the
store outlives any rank. Every run has a timeout after which every rank is SIGKILLed (and
SIGCONTed first, so stopped ones die too); the result says which ranks were killed.
"""

from __future__ import annotations

import importlib
import multiprocessing as mp
import os
import signal
import sys
import time
import uuid
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

__all__ = ["RankOutcome", "RunResult", "run_ranks", "run_check"]

_CTX: Any = None


def _context() -> Any:
    global _CTX
    if _CTX is None:
        _CTX = mp.get_context("forkserver")
        # Only torch itself: preloading torch.distributed.fsdp and torch._dynamo here too made
        # forked ranks hang now and then (tests/dist/test_monitor_dist.py, 3 runs in 5 stuck
        # with one rank never returning; 5 runs in 5 clean without them).
        _CTX.set_forkserver_preload(["torch", "torch.distributed", "distdiag.check.run", "tests.harness"])
    return _CTX


@dataclass
class RankOutcome:
    rank: int
    exitcode: int | None
    """The process's exit code; negative for a signal; None if it had to be killed."""
    stdout: str
    stderr: str
    killed: bool = False


@dataclass
class RunResult:
    outcomes: list[RankOutcome]
    elapsed: float
    workdir: Path
    timed_out: bool = False
    extra: dict[str, Any] = field(default_factory=dict)

    @property
    def codes(self) -> list[int | None]:
        return [o.exitcode for o in self.outcomes]

    @property
    def stdout(self) -> str:
        return "".join(o.stdout for o in self.outcomes)

    @property
    def stderr(self) -> str:
        return "".join(o.stderr for o in self.outcomes)

    def report(self, name: str = "distdiag-report.json") -> Any:
        from distdiag.report.model import read_report

        return read_report(self.workdir / name)


def _child(entry: str, argv: list[str], env: dict[str, str], workdir: str, rank: int) -> None:
    out = os.open(os.path.join(workdir, f"rank{rank}.out"), os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o644)
    err = os.open(os.path.join(workdir, f"rank{rank}.err"), os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o644)
    os.dup2(out, 1)
    os.dup2(err, 2)
    os.environ.update(env)
    os.chdir(workdir)
    import torch

    # torch read OMP_NUM_THREADS and TORCH_DISTRIBUTED_DEBUG when the forkserver imported it;
    # apply this rank's values.
    torch.set_num_threads(int(env.get("OMP_NUM_THREADS", "1")))
    import torch.distributed as dist

    if hasattr(dist, "set_debug_level_from_env"):
        dist.set_debug_level_from_env()
    module, _, func = entry.partition(":")
    code = 0
    try:
        result = getattr(importlib.import_module(module), func)(argv)
        code = int(result) if isinstance(result, int) else 0
    except SystemExit as exc:
        code = exc.code if isinstance(exc.code, int) else (0 if exc.code is None else 1)
    except BaseException:  # noqa: BLE001 - show it in the rank's stderr, like a real process
        import traceback

        traceback.print_exc()
        code = 1
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(code)


def run_ranks(
    world_size: int,
    argv: list[str],
    workdir: str | Path,
    *,
    entry: str = "distdiag.check.run:main",
    env: dict[str, str] | None = None,
    rank_env: dict[int, dict[str, str]] | None = None,
    timeout: float = 60.0,
    hosts: int = 1,
    signal_after: tuple[float, int] | None = None,
) -> RunResult:
    """Start `world_size` ranks running `entry(argv)`; wait at most `timeout` seconds.

    `hosts` > 1 splits the ranks into that many pretend nodes (GROUP_RANK, LOCAL_RANK) on
    this one machine. `signal_after=(seconds, signum)` sends that signal to every rank once,
    that long after every rank of a check checked in, else after the start (what a launcher
    does when a job is cancelled).
    """
    import torch.distributed as dist

    workdir = Path(workdir)
    workdir.mkdir(parents=True, exist_ok=True)
    store = dist.TCPStore("127.0.0.1", 0, world_size, is_master=True, wait_for_workers=False)
    per_node = world_size // hosts
    base_env = {
        "WORLD_SIZE": str(world_size),
        "MASTER_ADDR": "127.0.0.1",
        "MASTER_PORT": str(store.port),
        "TORCHELASTIC_USE_AGENT_STORE": "True",
        "TORCHELASTIC_RUN_ID": uuid.uuid4().hex[:8],
        "TORCHELASTIC_RESTART_COUNT": "0",
        "LOCAL_WORLD_SIZE": str(per_node),
        "OMP_NUM_THREADS": "1",
        **(env or {}),
    }
    ctx = _context()
    procs = []
    started = time.monotonic()
    for rank in range(world_size):
        renv = dict(base_env)
        renv.update({"RANK": str(rank), "LOCAL_RANK": str(rank % per_node), "GROUP_RANK": str(rank // per_node)})
        renv.update((rank_env or {}).get(rank, {}))
        proc = ctx.Process(target=_child, args=(entry, list(argv), renv, str(workdir), rank), daemon=False)
        proc.start()
        procs.append(proc)
    deadline = started + timeout
    killed: set[int] = set()
    try:
        if signal_after is not None:
            # the clock starts once every rank of a check has checked in (its sentinel, which
            # turns the signal into a report, runs by then): on a loaded machine the imports
            # alone outran a clock started at launch
            checked_in = f"distdiag/{base_env['TORCHELASTIC_RUN_ID']}/0//info/n"  # PrefixStore adds a /
            since = started
            while time.monotonic() < deadline - 5 and not all(p.exitcode is not None for p in procs):
                if store.check([checked_in]) and int(store.add(checked_in, 0)) >= world_size:
                    since = time.monotonic()
                    break
                time.sleep(0.1)
            time.sleep(max(0.0, since + signal_after[0] - time.monotonic()))
            for proc in procs:
                if proc.is_alive():
                    os.kill(proc.pid, signal_after[1])
        for proc in procs:
            proc.join(max(0.0, deadline - time.monotonic()))
    finally:
        # Also when pytest-timeout interrupts the join: no rank outlives its test.
        for rank, proc in enumerate(procs):
            if proc.is_alive():
                killed.add(rank)
                try:
                    os.kill(proc.pid, signal.SIGCONT)
                    os.kill(proc.pid, signal.SIGKILL)
                except OSError:
                    pass
                proc.join(5)
    timed_out = bool(killed)
    elapsed = time.monotonic() - started
    outcomes = []
    for rank, proc in enumerate(procs):
        outcomes.append(
            RankOutcome(
                rank=rank,
                exitcode=None if rank in killed else proc.exitcode,
                stdout=(workdir / f"rank{rank}.out").read_text(errors="replace") if (workdir / f"rank{rank}.out").exists() else "",
                stderr=(workdir / f"rank{rank}.err").read_text(errors="replace") if (workdir / f"rank{rank}.err").exists() else "",
                killed=rank in killed,
            )
        )
    del store
    return RunResult(outcomes=outcomes, elapsed=elapsed, workdir=workdir, timed_out=timed_out)


def run_check(world_size: int, args: list[str], workdir: str | Path, *, inject: str | None = None, timeout: float = 60.0, **kw: Any) -> RunResult:
    """Run `distdiag.check` with args on world_size ranks (DISTDIAG_INJECT=inject if given)."""
    env = dict(kw.pop("env", {}) or {})
    if inject:
        env["DISTDIAG_INJECT"] = inject
    return run_ranks(world_size, args, workdir, env=env, timeout=timeout, **kw)


def descendants(pid: int) -> set[int]:
    """Every process under `pid` now (from /proc: torchrun's workers live in sessions of their own,
    so a process group does not hold them)."""
    out, todo = set(), [pid]
    while todo:
        p = todo.pop()
        try:
            kids = open(f"/proc/{p}/task/{p}/children").read().split()
        except OSError:
            continue
        for k in map(int, kids):
            if k not in out:
                out.add(k)
                todo.append(k)
    return out


def run_within(cmd: list[str], cwd: str, limit: float, env: dict[str, str] | None = None,
               over: str = "timeout") -> tuple[object, float]:
    """Run `cmd` in a session of its own in `cwd` (output to cwd/output.txt) for at most `limit`
    seconds: (its exit code, or `over` when it ran past the limit; the seconds it took). At the
    end every process it started that was ever seen is killed (a black-box runner's hard limit)."""
    import subprocess

    t0 = time.time()
    with open(os.path.join(cwd, "output.txt"), "w") as log:
        p = subprocess.Popen(cmd, cwd=cwd, stdout=log, stderr=subprocess.STDOUT, start_new_session=True,
                             env=env if env is not None else dict(os.environ, PYTHONUNBUFFERED="1"))
        seen: set[int] = set()
        while p.poll() is None and time.time() - t0 < limit:
            seen |= descendants(p.pid)
            time.sleep(0.2)
        rc: object = p.poll()
        if rc is None:
            rc = over
            seen |= descendants(p.pid)
            try:
                os.killpg(p.pid, signal.SIGKILL)
            except ProcessLookupError:
                pass
            p.wait()
        for pid in seen:
            try:
                os.kill(pid, signal.SIGKILL)
            except ProcessLookupError:
                pass
    return rc, time.time() - t0
