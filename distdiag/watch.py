"""`torchrun --nproc-per-node N -m distdiag.watch [--timeout-s S] -- train.py ARGS...`

Runs the user's script unchanged - as `__main__`, with its own argv - and arms the hang
watchdog the moment the script initialises its default process group (init_process_group
is wrapped for that one call, also when init_device_mesh makes it). Before the script
starts it may turn on torch's flight recorder (by environment, the only way: it must be set
before init). Every option has an environment twin (DISTDIAG_WATCHDOG_*); flags win.
The script's exit code is the process's; a hang ends it with code 3 (action abort).
"""

from __future__ import annotations

import argparse
import os
import runpy
import sys
import threading
from datetime import timedelta
from typing import Any, NoReturn

from distdiag.errors import DistDiagError, print_line, unknown_option_hint
from distdiag.launcher.ranks import ARMED_PHASE, RETURNED_PHASE, note_phase

__all__ = ["main", "build_parser", "armed"]

_STATE: dict[str, Any] = {"wd": None, "config": None}


def armed() -> Any:
    """The watchdog the wrapper armed (or None): scripts may call `.step(n)` on it if they like."""
    return _STATE["wd"]


class _Parser(argparse.ArgumentParser):
    """argparse that raises _BadUsage (one line on every rank, exit 2) instead of printing usage."""

    def error(self, message: str) -> NoReturn:
        raise _BadUsage(unknown_option_hint(self, message))


def build_parser() -> argparse.ArgumentParser:
    p = _Parser(
        prog="python -m distdiag.watch",
        description="Run a training script unchanged with distdiag's hang watchdog armed at init_process_group.",
    )
    p.add_argument("--timeout-s", type=float, default=None, help="seconds without progress before a hang (env DISTDIAG_WATCHDOG_TIMEOUT_S; default 300)")
    p.add_argument("--action", choices=("abort", "raise", "report"), default=None, help="what to do on a hang (env DISTDIAG_WATCHDOG_ACTION; default abort)")
    p.add_argument("--dump-dir", default=None, help="where the report goes (env DISTDIAG_WATCHDOG_DUMP_DIR; default hang-report)")
    p.add_argument(
        "--flight-recorder", type=int, default=None, metavar="N",
        help=(
            "enable torch's flight recorder with N entries before init (env DISTDIAG_WATCHDOG_FLIGHT_RECORDER; "
            "default 2000, 0: leave torch's setting). It is how the watchdog sees collectives torch issues itself "
            "(DDP, FSDP, compiled graphs, NCCL)"
        ),
    )
    p.add_argument(
        "--nccl-timing", action="store_true", default=None,
        help=(
            "also record NCCL's start events (TORCH_NCCL_ENABLE_TIMING=1, env DISTDIAG_WATCHDOG_NCCL_TIMING=1), so that a "
            "hang report tells a collective every rank started (the fabric) from one a rank's GPU never started; "
            "off by default: an extra CUDA event per collective; nothing without the flight recorder"
        ),
    )
    wrap = p.add_mutually_exclusive_group()
    wrap.add_argument(
        "--wrap", dest="wrap", action="store_true", default=None,
        help=(
            "wrap torch.distributed's Python collectives (env DISTDIAG_WATCHDOG_WRAP=1): finds a silent desync (a "
            "skipped or extra same-shape collective) at the next step mark while the job still runs, at ~8 us of "
            "Python per collective; without it call sites come from torch's flight recorder and such a desync is "
            "reported once it hangs (default: wrap send/recv only, everything where the recorder gives no call sites)"
        ),
    )
    wrap.add_argument(
        "--no-wrap", dest="wrap", action="store_false",
        help="never wrap torch.distributed's functions, not even send/recv (env DISTDIAG_WATCHDOG_WRAP=0)",
    )
    p.add_argument("-m", dest="module", default=None, help="run a module (like python -m) instead of a script")
    p.add_argument("script", nargs="?", help="the training script")
    p.add_argument("args", nargs=argparse.REMAINDER, help="the script's arguments")
    return p


def _fail(message: str) -> int:
    print_line(f"distdiag.watch: error: {message}")
    return 2


def _arm_after(init: Any) -> Any:
    import functools

    @functools.wraps(init)
    def init_process_group(*args: Any, **kwargs: Any) -> Any:
        result = init(*args, **kwargs)
        if _STATE["wd"] is None and threading.current_thread() is threading.main_thread():
            from distdiag.watchdog import HangWatchdog

            wd = _STATE["wd"] = HangWatchdog(config=_STATE["config"]).start()
            _say_armed(_STATE["config"])
            # `distdiag watch` leaves a rank that stops from now on to its peers' watchdogs
            note_phase(ARMED_PHASE, launcher_only=True)
            # A worker that dies makes torchrun SIGTERM the others at once: take the signal
            # so that they report it first (distdiag/watchdog/sigterm.py).
            wd.take_sigterm()
        return result

    init_process_group.__distdiag_wrapped__ = init  # type: ignore[attr-defined]
    return init_process_group


def _say_armed(config: Any) -> None:
    """Once per job (rank 0): the watchdog is armed, with its timeout (the job may run for hours
    before anything else of distdiag's shows)."""
    if os.environ.get("RANK", "0") != "0":
        return
    world = os.environ.get("WORLD_SIZE", "1")
    then = {"abort": "the ranks are ended", "raise": "HangDetected is raised", "report": "the job goes on"}
    print_line(f"distdiag.watch: watchdog armed on {world} rank(s): {config.timeout_s:g} s without progress is a hang, "
               f"reported to {os.path.join(config.dump_dir, 'hang-report.json')}, then {then.get(config.action, config.action)}")


def _install_init_hook() -> list[tuple[Any, Any]]:
    import torch.distributed as dist
    from torch.distributed import distributed_c10d as c10d

    saved = []
    original = c10d.init_process_group
    hooked = _arm_after(original)
    modules: list[Any] = [dist, c10d]
    try:
        from torch.distributed import device_mesh

        modules.append(device_mesh)
    except ImportError:
        pass
    for module in modules:
        if getattr(module, "init_process_group", None) is original:
            saved.append((module, original))
            module.init_process_group = hooked
    return saved


MAX_RECORDER_ENTRIES = 10_000_000
"""Flight-recorder entries at most (torch keeps them all in memory on every rank)."""

_VALUED = {"--timeout-s", "--action", "--dump-dir", "--flight-recorder", "-m"}
"""Our options that take a value (the next word is theirs, not the script)."""


def _split_argv(argv: list[str]) -> tuple[list[str], list[str]]:
    """(our options, the script and its arguments)."""
    i = 0
    while i < len(argv):
        word = argv[i]
        if word == "--":
            return argv[:i], argv[i + 1 :]
        if word in _VALUED:
            i += 2
            if word == "-m":
                return argv[:i], argv[i:]
            continue
        if word.startswith("-"):  # ours (or unknown: argparse says so in one line)
            i += 1
            continue
        return argv[:i], argv[i:]
    return argv, []


class _BadUsage(DistDiagError):
    """A bad option or script: the message is the one line `_fail` prints."""


_NO_SCRIPT = "no training script given; usage: python -m distdiag.watch [options] -- train.py ARGS..."


def nccl_timing(flag: bool | None) -> bool:
    """--nccl-timing, else DISTDIAG_WATCHDOG_NCCL_TIMING=1 (any other value: off)."""
    from distdiag.watchdog.config import WATCHDOG_NCCL_TIMING

    return bool(flag) or os.environ.get(WATCHDOG_NCCL_TIMING, "").strip() == "1"


def _parse(argv: list[str]) -> tuple[argparse.Namespace, Any, int]:
    """(the options with the script and its arguments, the watchdog's config, the flight
    recorder's entries); raises _BadUsage on a bad one."""
    from distdiag.errors import ConfigError
    from distdiag.watchdog.config import MAX_TIMEOUT_S, WATCHDOG_FLIGHT_RECORDER, WatchdogConfig

    parser = build_parser()
    # Our own options come first; they end at the first `--` or at the first word that is not
    # one of them (the script). Everything after is the script's, `--` included.
    # `ours` holds no script word, so the parser's `script`/`args` (kept for --help) stay empty.
    ours, rest = _split_argv(argv)
    ns = parser.parse_args(ours)
    if ns.module is None:
        if not rest:
            raise _BadUsage(_NO_SCRIPT)
        ns.script, ns.args = rest[0], rest[1:]
    else:
        ns.args = rest
    if ns.module is None and not ns.script:
        raise _BadUsage(_NO_SCRIPT)
    if ns.timeout_s is not None and not 0 < ns.timeout_s <= MAX_TIMEOUT_S:
        raise _BadUsage(f"--timeout-s must be within (0, {MAX_TIMEOUT_S:g}] seconds (a week), got {ns.timeout_s:g}")
    try:
        config = WatchdogConfig.from_env(
            timeout=timedelta(seconds=ns.timeout_s) if ns.timeout_s is not None else None,
            action=ns.action, dump_dir=ns.dump_dir, wrap=ns.wrap,
        )
        entries = ns.flight_recorder
        if entries is None:
            entries = int(os.environ.get(WATCHDOG_FLIGHT_RECORDER, "2000") or 0)
    except (ConfigError, ValueError) as exc:
        raise _BadUsage(str(exc)) from exc
    if not 0 <= entries <= MAX_RECORDER_ENTRIES:
        raise _BadUsage(f"--flight-recorder must be from 0 to {MAX_RECORDER_ENTRIES} entries, got {entries}")
    if ns.module is None and not os.path.isfile(ns.script):
        raise _BadUsage(f"training script {ns.script!r} not found")
    if ns.module is not None:
        _check_module(ns.module)
    if os.path.lexists(config.dump_dir) and not os.path.isdir(config.dump_dir):
        raise _BadUsage(f"the dump dir {config.dump_dir!r} exists and is not a directory; pass --dump-dir a directory")
    return ns, config, entries


def _check_module(name: str) -> None:
    """`-m NAME` must name an importable module, found as runpy would (a missing one is a
    usage error of one line, not runpy's traceback; the module itself is not run here)."""
    import importlib.util

    try:
        spec = importlib.util.find_spec(name)
        runnable = spec is None or spec.submodule_search_locations is None or importlib.util.find_spec(f"{name}.__main__")
    except (ImportError, ValueError):  # a missing parent package, or an empty/relative name
        spec = None
    if spec is None:
        raise _BadUsage(f"module {name!r} not found (is it installed or on PYTHONPATH?)")
    if not runnable:
        raise _BadUsage(f"{name!r} is a package without a __main__ module; name the module to run")


def _run_script(ns: argparse.Namespace) -> None:
    """Run the user's script or module as `__main__`, with its own argv."""
    if ns.module is not None:
        sys.argv = [ns.module, *ns.args]
        runpy.run_module(ns.module, run_name="__main__", alter_sys=True)
    else:
        sys.argv = [ns.script, *ns.args]
        sys.path.insert(0, os.path.dirname(os.path.abspath(ns.script)))
        runpy.run_path(ns.script, run_name="__main__")


def _exit_code(exc: SystemExit) -> int:
    """The process's code for the script's sys.exit(...); a message is printed, as Python does."""
    if not isinstance(exc.code, int) and exc.code is not None:
        print_line(str(exc.code))
    return exc.code if isinstance(exc.code, int) else (0 if exc.code is None else 1)


def run(argv: list[str]) -> int:
    from distdiag.hang.recorder import enable_recorder

    try:
        ns, config, entries = _parse(argv)
    except _BadUsage as exc:
        return _fail(str(exc))
    note = enable_recorder(entries, timing=nccl_timing(ns.nccl_timing))
    if note and os.environ.get("RANK", "0") == "0":
        print_line(f"distdiag.watch: {note}")
    _STATE["config"] = config
    # `distdiag watch` ends the job if this rank stops before its watchdog arms (nobody else
    # would see it): it knows the rank by this note
    note_phase("running the training script, its watchdog not armed yet", launcher_only=True)
    saved = _install_init_hook()
    code = 0
    try:
        _run_script(ns)
    except SystemExit as exc:
        code = _exit_code(exc)
    except BaseException as exc:
        wd = _STATE["wd"]
        if wd is not None and wd.ended_from_outside():
            wd.leave_ended()  # a peer that left at the launcher's SIGTERM broke a collective: no traceback
        if wd is not None:
            wd.close(exc)  # reports a dead peer before the traceback, if that is what happened
        raise
    finally:
        wd, _STATE["wd"] = _STATE["wd"], None
        if wd is not None:
            wd.close()
        for module, original in saved:
            module.init_process_group = original
    if code == 0:
        # what follows is the interpreter's exit: a rank that dies there (torch's gloo worker can
        # abort it, docs/facts.md) is named by the launcher as such, not as a failed training
        note_phase(RETURNED_PHASE, launcher_only=True)
    return code


def main() -> None:
    sys.exit(run(sys.argv[1:]))


if __name__ == "__main__":
    # Run as `-m distdiag.watch` this module is `__main__`: a script's own
    # `import distdiag.watch` would load a second copy whose armed() is always None.
    sys.modules.setdefault("distdiag.watch", sys.modules[__name__])
    main()
