"""One command line for the check: `distdiag check` and `python -m distdiag.check` share their options."""

from __future__ import annotations

import subprocess
import sys

import pytest

from distdiag import __version__
from distdiag.check.options import CHECK_OPTIONS, LAUNCHER_OPTIONS, build_parser, to_check_argv

pytestmark = pytest.mark.timeout(180)

SAMPLE = {"--timeout-s": "7.5", "--deadline-s": "90", "--format": "json", "--backend": "gloo"}


def run(args, env, cwd, timeout=120):
    return subprocess.run([sys.executable, "-m", *args], env=env, cwd=cwd, capture_output=True, text=True,
                          timeout=timeout, stdin=subprocess.DEVNULL)


def test_every_check_option_reaches_the_ranks_unchanged():
    """Whatever `distdiag check` accepts of the check's options, it hands the ranks, parsed the same way."""
    argv = []
    for option in CHECK_OPTIONS:
        argv += [option.flags[0]] if option.type is None else [option.flags[0], SAMPLE.get(option.flags[0], "x")]
    launcher = build_parser(launcher=True).parse_args(["--nproc-per-node", "3", *argv])
    rank = build_parser().parse_args(to_check_argv(launcher))
    for option in CHECK_OPTIONS:
        assert getattr(rank, option.dest) == getattr(launcher, option.dest), option.flags
    assert launcher.nproc_per_node == 3 and not hasattr(rank, "nproc_per_node")


def test_nproc_keeps_its_short_name():
    assert build_parser(launcher=True).parse_args(["--nproc", "5"]).nproc_per_node == 5
    assert build_parser(launcher=True).parse_args([]).nproc_per_node == 2


@pytest.mark.parametrize(
    "front",
    [["distdiag", "check"], ["distdiag.check"]],
    ids=["distdiag-check", "python-m-distdiag.check"],
)
@pytest.mark.parametrize("flag", ["-h", "--help"])
def test_both_front_ends_document_the_same_options(cli_env, tmp_path, front, flag):
    """-h and --help on both front ends list every option of the one table."""
    out = run([*front, flag], cli_env, tmp_path)
    assert out.returncode == 0, out.stderr
    flags = [f for option in CHECK_OPTIONS for f in option.flags]
    if front[0] == "distdiag":
        flags += [f for option in LAUNCHER_OPTIONS for f in option.flags]
    for name in flags + ["--version", "exit codes:"]:
        assert name in out.stdout, (name, out.stdout)


@pytest.mark.parametrize("args", [["distdiag", "-h"], ["distdiag", "report", "show", "-h"], ["distdiag", "probes", "-h"],
                                  ["distdiag", "hang-report", "-h"], ["distdiag", "analyze", "-h"]])
def test_dash_h_everywhere(cli_env, tmp_path, args):
    out = run(args, cli_env, tmp_path)
    assert out.returncode == 0 and out.stdout.startswith("Usage:"), out.stderr


@pytest.mark.parametrize("args", [["distdiag", "--version"], ["distdiag", "check", "--version"], ["distdiag.check", "--version"]])
def test_version(cli_env, tmp_path, args):
    out = run(args, cli_env, tmp_path)
    assert out.returncode == 0 and out.stdout == f"distdiag {__version__}\n", (out.stdout, out.stderr)


@pytest.mark.torchrun
def test_version_under_torchrun_prints_once(cli_env, tmp_path):
    """Rank 0 answers --version (and -h), the other ranks stay silent; all exit 0."""
    out = run(["torch.distributed.run", "--nproc-per-node", "2", "-m", "distdiag.check", "--version"], cli_env, tmp_path)
    assert out.returncode == 0, out.stderr[-2000:]
    assert out.stdout == f"distdiag {__version__}\n"


@pytest.mark.parametrize(
    ("args", "words"),
    [
        (["check", "--format", "xml"], "argument --format: invalid choice: 'xml'"),
        (["check", "--nproc-per-node", "0"], "argument --nproc-per-node/--nproc: must be a whole number of ranks from 1 to 65536, got 0"),
        (["check", "--nproc-per-node", "1", "--probes", "collectives"], "WORLD_SIZE must be >= 2"),
        (["check", "--checkpoint", "ckpt", "--bogus"], "unrecognized arguments: --bogus (see: distdiag check -h)"),
        (["probes", "--format", "xml"], "--format must be text or json, got 'xml'"),
        (["probes", "--bogus"], "No such option: --bogus"),
        (["nope"], "No such command 'nope'"),
        (["report", "show"], "Missing argument"),
        (["check", "--probez", "env"], "unrecognized arguments: --probez (did you mean '--probes'?)"),
        (["check", "--probes", "collectivs"], "unknown probe 'collectivs' (did you mean 'collectives'?)"),
        (["check", "--profile", "quik"], "unknown profile 'quik' (did you mean 'quick'?)"),
        (["check", "--checkpoint", "no_such_ckpt"], "--checkpoint 'no_such_ckpt' does not exist"),
        (["check", "--target", "nope.py"], "target file nope.py does not exist"),
        (["watch", "--nproc-per-node", "1", "--timeout", "5", "--", "train.py"],
         "unrecognized arguments: --timeout (did you mean '--timeout-s'?)"),
        (["watch", "--timeout-s", "abc", "--", "train.py"], "argument --timeout-s: invalid float value: 'abc'"),
        (["watch", "--action", "bogus", "--", "train.py"], "argument --action: invalid choice: 'bogus'"),
        (["watch", "--flight-recorder", "x", "--", "train.py"], "argument --flight-recorder: invalid int value: 'x'"),
    ],
)
def test_usage_errors_are_one_line_exit_2(cli_env, tmp_path, args, words):
    """A mistyped command line is one line on stderr and exit 2 within seconds, in typer's commands as in the
    check's and watch's (with "did you mean" for an option or a probe name typed wrong)."""
    import time

    (tmp_path / "train.py").write_text("print('ran')\n")
    start = time.monotonic()
    out = run(["distdiag", *args], cli_env, tmp_path)
    assert time.monotonic() - start < 30  # torch's import at most, never a rank's start
    assert out.returncode == 2, out.stderr
    assert out.stderr.count("\n") == 1 and out.stderr.startswith("distdiag: error:"), out.stderr
    assert words in out.stderr, out.stderr


def test_probes_says_which_are_opt_in_and_how_to_run_them(cli_env, tmp_path):
    """bandwidth is not in a default run: `distdiag probes` says so and how to get it."""
    out = run(["distdiag", "probes"], cli_env, tmp_path)
    assert out.returncode == 0, out.stderr
    line = next(x for x in out.stdout.splitlines() if x.startswith("bandwidth "))
    assert "(opt-in;" in line
    assert "bandwidth is opt-in: a default run leaves it out; run it with --probes bandwidth" in out.stdout
    assert "--profile full" in out.stdout
    import json

    rows = {r["name"]: r for r in json.loads(run(["distdiag", "probes", "--format", "json"], cli_env, tmp_path).stdout)}
    assert rows["bandwidth"]["default"] is False and "full" in rows["bandwidth"]["profiles"]
    assert rows["env"]["default"] is True


def test_bare_barrier_benchmark_help(cli_env, tmp_path):
    """benchmarks/bare_barrier.py --help prints its usage and exits 0 (it used to start a process group and crash)."""
    from pathlib import Path

    script = Path(__file__).resolve().parents[2] / "benchmarks" / "bare_barrier.py"
    out = subprocess.run([sys.executable, str(script), "--help"], env=cli_env, cwd=tmp_path, capture_output=True,
                         text=True, timeout=60, stdin=subprocess.DEVNULL)
    assert out.returncode == 0 and "torchrun --nproc-per-node N" in out.stdout and not out.stderr, out.stderr
