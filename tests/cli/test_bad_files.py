"""Files a careless user (or a fault campaign) hands the CLI: one line on stderr and exit 2, never a traceback."""

from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest

from distdiag.report.model import Finding, ProbeResult, Report

pytestmark = pytest.mark.timeout(120)


def distdiag(args, env, cwd, module="distdiag"):
    return subprocess.run([sys.executable, "-m", module, *args], env=env, cwd=cwd, capture_output=True, text=True,
                          timeout=90, stdin=subprocess.DEVNULL)


def _one_line_exit_2(out, words):
    assert out.returncode == 2, (out.returncode, out.stderr)
    assert out.stderr.count("\n") == 1 and out.stderr.startswith("distdiag: error:"), out.stderr
    assert words in out.stderr, out.stderr


def _report_json() -> dict:
    report = Report(world_size=2, exit_code=1, verdict="fail", summary="x",
                    probes=[ProbeResult.from_findings("collectives", [Finding("error", "bad", "ev", ranks=[1])])])
    return json.loads(report.to_json())


BAD_REPORTS = {
    "binary": (b"\x89PNG\r\n\x1a\n\xff", "is not UTF-8 text"),
    "deep": (b"[" * 50_000 + b"]" * 50_000, "nests JSON too deeply"),
    "findings-int": (None, "probes[0].findings must be a list, got int"),
    "finding-list": (None, "probes[0].findings[0] must be an object, got list"),
}


@pytest.mark.parametrize("case", list(BAD_REPORTS))
def test_report_show_bad_files(cli_env, tmp_path, case):
    """`distdiag report show` on non-UTF-8, deeply nested or mistyped files."""
    content, words = BAD_REPORTS[case]
    if content is None:
        data = _report_json()
        data["probes"][0]["findings"] = 5 if case == "findings-int" else [["error", "bad"]]
        content = json.dumps(data).encode()
    (tmp_path / "r.json").write_bytes(content)
    _one_line_exit_2(distdiag(["report", "show", "r.json"], cli_env, tmp_path), words)


def test_report_show_fifo_is_refused(cli_env, tmp_path):
    """A FIFO would block the reader: refused at once."""
    os.mkfifo(tmp_path / "r.json")
    _one_line_exit_2(distdiag(["report", "show", "r.json"], cli_env, tmp_path), "is a FIFO (named pipe)")


BAD_DUMPS = {
    "binary": (b"\xff\xfe\x00garbage", "neither JSON nor a pickle"),
    "deep": (b'{"entries": ' + b"[" * 50_000 + b"]" * 50_000 + b"}", "too deeply"),
    "entries-str": (b'{"entries": "x"}', "'entries' must be a list, got str"),
    "entry-list": (b'{"entries": [["all_reduce", 1]]}', "entries[0] must be an object, got list"),
    "seq-str": (b'{"entries": [{"collective_seq_id": "x", "process_group": ["0", "default"]}]}',
                "entries[0].collective_seq_id must be an integer"),
    "pg-int": (b'{"entries": [{"collective_seq_id": 1, "process_group": 5}]}', "process_group must be a non-empty list"),
}


@pytest.mark.parametrize("case", list(BAD_DUMPS))
def test_hang_report_bad_dumps(cli_env, tmp_path, case):
    """`distdiag hang-report DIR` on dumps that are binary, deep or of the wrong shape."""
    content, words = BAD_DUMPS[case]
    (tmp_path / "dumps").mkdir()
    (tmp_path / "dumps" / "rank_0").write_bytes(content)
    _one_line_exit_2(distdiag(["hang-report", "dumps"], cli_env, tmp_path), words)


@pytest.mark.parametrize("case", list(BAD_REPORTS))
def test_hang_report_bad_watchdog_report(cli_env, tmp_path, case):
    """A broken hang-report.json says what is wrong with it (not 'no entries')."""
    content, words = BAD_REPORTS[case]
    if case == "binary":  # not starting with "{", it is read as a dump
        words = "neither JSON nor a pickle"
    if content is None:
        data = _report_json()
        data["probes"][0]["findings"] = 5 if case == "findings-int" else [["error", "bad"]]
        content = json.dumps(data).encode()
    (tmp_path / "hang-report").mkdir()
    (tmp_path / "hang-report" / "hang-report.json").write_bytes(content)
    _one_line_exit_2(distdiag(["hang-report", "hang-report"], cli_env, tmp_path), words)


def test_hang_report_fifo_is_refused(cli_env, tmp_path):
    os.mkfifo(tmp_path / "dump")
    _one_line_exit_2(distdiag(["hang-report", "dump"], cli_env, tmp_path), "is a FIFO (named pipe)")


@pytest.mark.parametrize("front", ["distdiag check", "python -m distdiag.check"])
@pytest.mark.parametrize("flag", ["--report", "--junit"])
def test_check_refuses_a_fifo_as_output(cli_env, tmp_path, front, flag):
    """--report/--junit naming a FIFO is bad input before anything runs."""
    os.mkfifo(tmp_path / "out")
    args = ["--probes", "env", flag, "out"]
    if front == "distdiag check":
        out = distdiag(["check", "--nproc", "1", *args], cli_env, tmp_path)
    else:
        out = distdiag(args, cli_env, tmp_path, module="distdiag.check")
    key = "check.report" if flag == "--report" else "check.junit"
    _one_line_exit_2(out, f"{key}: out is a FIFO (named pipe), not a regular file; refusing to replace it (pass {flag} a file path)")
    assert (tmp_path / "out").is_fifo()


# -- issue 24 item 8: links, FIFOs, devices, limits and escapes -------------------------------

def _plant(path, kind, victim):
    """What a careless user or an attacker on a shared /tmp leaves at an output path."""
    if kind == "link":
        victim.write_text("precious")
        path.symlink_to(victim)
    elif kind == "dangling":
        path.symlink_to(victim)
    elif kind == "loop":
        path.symlink_to(path)
    else:
        os.mkfifo(path)


LINK_WORDS = {"link": "is a symbolic link (to", "dangling": "is a dangling symbolic link",
              "loop": "is a symbolic link loop", "fifo": "is a FIFO (named pipe)"}


@pytest.mark.parametrize("kind", ["link", "dangling", "loop"])
@pytest.mark.parametrize("flag", ["--report", "--junit"])
def test_check_never_writes_through_a_link(cli_env, tmp_path, kind, flag):
    """--report/--junit naming a symlink: one line, exit 2; the linked file is unchanged, a
    dangling link's target is not created, a loop is no traceback."""
    victim = tmp_path / "victim"
    _plant(tmp_path / "out", kind, victim)
    out = distdiag(["--probes", "env", flag, "out"], cli_env, tmp_path, module="distdiag.check")
    _one_line_exit_2(out, f"out {LINK_WORDS[kind]}")
    assert "refusing to write through it" in out.stderr
    assert (tmp_path / "out").is_symlink()
    assert (victim.read_text() == "precious") if kind == "link" else not victim.exists()


@pytest.mark.parametrize("kind", ["link", "dangling", "fifo"])
def test_analyze_plot_refuses_a_link_or_fifo(cli_env, tmp_path, kind):
    """--plot is an output too: refused before any log is read (matplotlib or not)."""
    (tmp_path / "log.jsonl").write_text("".join(json.dumps({"step": i, "loss": 2.0 - i / 10}) + "\n" for i in range(10)))
    victim = tmp_path / "victim.png"
    _plant(tmp_path / "plot.png", kind, victim)
    out = distdiag(["analyze", "log.jsonl", "--plot", "plot.png"], cli_env, tmp_path)
    _one_line_exit_2(out, f"--plot: plot.png {LINK_WORDS[kind]}")
    assert (victim.read_text() == "precious") if kind == "link" else not victim.exists()


def _config_input(tmp_path, case):
    path = tmp_path / "c.toml"
    if case == "fifo":
        os.mkfifo(path)  # nobody writes: opening it for reading used to block for good
    elif case == "dev-zero":
        path.symlink_to("/dev/zero")  # endless: read whole, it ended in MemoryError
    elif case == "directory":
        path.mkdir()
    elif case == "deep-arrays":
        path.write_text("a = " + "[" * 5000 + "]" * 5000 + "\n")
    elif case == "deep-tables":
        path.write_text("a = " + "{b = " * 5000 + "1" + "}" * 5000 + "\n")
    elif case == "link-loop":
        path.symlink_to(path)
    else:  # a healthy config, read through a symlink: links to inputs are followed
        (tmp_path / "real.toml").write_text('[check]\nprobes = ["env"]\n')
        path.symlink_to(tmp_path / "real.toml")
    return path


CONFIG_WORDS = {
    "fifo": "config file c.toml is a FIFO (named pipe), not a TOML config file",
    "dev-zero": "config file c.toml is a character device, not a TOML config file",
    "directory": "config file c.toml is a directory, not a TOML config file",
    "deep-arrays": "config file c.toml nests arrays or tables too deeply to be a config",
    "deep-tables": "config file c.toml nests arrays or tables too deeply to be a config",
    "link-loop": "config file c.toml is a symbolic link loop",
}


@pytest.mark.parametrize("case", list(CONFIG_WORDS))
@pytest.mark.parametrize("front", ["distdiag check", "python -m distdiag.check"])
def test_config_that_is_not_a_toml_file(cli_env, tmp_path, case, front):
    """--config naming a FIFO, /dev/zero, a directory, a link loop, or TOML nested 5000 deep:
    one line and exit 2 (the subprocess's own hard timeout stands for 'within seconds')."""
    _config_input(tmp_path, case)
    if front == "distdiag check":
        out = distdiag(["check", "--nproc", "1", "--config", "c.toml"], cli_env, tmp_path)
    else:
        out = distdiag(["--config", "c.toml"], cli_env, tmp_path, module="distdiag.check")
    _one_line_exit_2(out, CONFIG_WORDS[case])


def test_config_through_a_symlink_is_read(cli_env, tmp_path):
    """The healthy twin: a config that is a link to a TOML file is read (only outputs refuse links)."""
    _config_input(tmp_path, "healthy")
    out = distdiag(["--config", "c.toml", "--report", "r.json", "--quiet"], cli_env, tmp_path, module="distdiag.check")
    assert out.returncode == 0, out.stderr
    assert "verdict: PASS" in out.stdout


def _jsonl(lines) -> str:
    return "".join(line + "\n" for line in lines)


BAD_LOGS = {
    "fifo": (None, "log.jsonl is a FIFO (named pipe), not a metrics log"),
    "dev-zero": ("/dev/zero", "log.jsonl is a character device, not a metrics log"),
    "huge-int": (_jsonl([json.dumps({"step": 1, "loss": 2.0}), '{"step": 2, "loss": ' + "9" * 5000 + "}"]),
                 "log.jsonl: line 2: holds an integer of over 4300 digits, not a metric value"),
    "trainer-state-strings": (json.dumps({"global_step": 20, "log_history": [
        {"step": 10, "loss": 2.31, "grad_norm": 1.0}, {"step": 20, "loss": "2.05", "grad_norm": 1.1}]}),
        "log_history[1]: 'loss' is the string '2.05', expected a number"),
}


@pytest.mark.parametrize("case", list(BAD_LOGS))
def test_analyze_bad_logs(cli_env, tmp_path, case):
    """`distdiag analyze` on a FIFO, /dev/zero, a 5000-digit integer, a trainer_state.json
    with a quoted loss: one line, exit 2."""
    content, words = BAD_LOGS[case]
    name = "trainer_state.json" if case == "trainer-state-strings" else "log.jsonl"
    path = tmp_path / name
    if case == "fifo":
        os.mkfifo(path)
    elif case == "dev-zero":
        path.symlink_to(content)
    else:
        path.write_text(content)
    _one_line_exit_2(distdiag(["analyze", name], cli_env, tmp_path), words)


def test_analyze_trainer_state_with_numbers_reads(cli_env, tmp_path):
    """The healthy twin: the same trainer_state.json with numbers is analysed."""
    state = {"global_step": 20, "log_history": [{"step": 10, "loss": 2.31, "grad_norm": 1.0},
                                                {"step": 20, "loss": 2.05, "grad_norm": 1.1}]}
    (tmp_path / "trainer_state.json").write_text(json.dumps(state))
    out = distdiag(["analyze", "trainer_state.json", "--format", "json"], cli_env, tmp_path)
    assert out.returncode == 0, out.stderr
    assert json.loads(out.stdout)["schema"].startswith("distdiag.report/")


ESCAPES = "\x1b[2J\x1b]0;owned\x07\r\x9b31m\u202e"


def test_report_show_prints_escapes_as_text(cli_env, tmp_path):
    """Strings of a report (issue, evidence, fix, summary, probe name, table cells) reach the
    terminal escaped: no ESC, BEL, CR, C1 or bidi override is printed raw."""
    finding = Finding("error", f"bad{ESCAPES}", f"ev{ESCAPES}\nsecond{ESCAPES}", ranks=[1], fix=f"fix{ESCAPES}")
    probe = ProbeResult.from_findings(f"env{ESCAPES}", [finding], details={"table:t": [{"col": f"cell{ESCAPES}"}]})
    report = Report(world_size=2, exit_code=1, verdict="fail", summary=f"sum{ESCAPES}", probes=[probe])
    (tmp_path / "r.json").write_text(report.to_json())
    out = distdiag(["report", "show", "r.json", "--verbose"], cli_env, tmp_path)
    assert out.returncode == 1, out.stderr  # the report's verdict: FAIL
    assert not any(c in out.stdout for c in "\x1b\x07\r\x9b\u202e"), repr(out.stdout)
    assert out.stdout.count("\\x1b[2J\\x1b]0;owned\\x07\\r\\x9b31m\\u202e") >= 6, out.stdout
    shown = distdiag(["report", "show", "r.json", "--format", "json"], cli_env, tmp_path)
    assert json.loads(shown.stdout)["summary"] == f"sum{ESCAPES}"  # the JSON keeps the text as it is


def test_report_show_follows_a_link_to_a_report(cli_env, tmp_path):
    """The healthy twin of the link refusals: an input that is a symlink is read."""
    (tmp_path / "real.json").write_text(Report(world_size=1, exit_code=0, verdict="pass", summary="fine").to_json())
    (tmp_path / "r.json").symlink_to(tmp_path / "real.json")
    out = distdiag(["report", "show", "r.json"], cli_env, tmp_path)
    assert out.returncode == 0 and "verdict: PASS (exit 0) - fine" in out.stdout, out.stderr


WATCH_BAD = {
    "missing-module": (["-m", "no_such_module_xyz"], "module 'no_such_module_xyz' not found"),
    "missing-parent": (["-m", "no_such_pkg_xyz.train"], "module 'no_such_pkg_xyz.train' not found"),
    "package-without-main": (["-m", "distdiag.hang"], "'distdiag.hang' is a package without a __main__ module"),
    "dump-dir-is-a-file": (["--dump-dir", "dd", "--", "train.py"], "the dump dir 'dd' exists and is not a directory"),
}


@pytest.mark.parametrize("case", list(WATCH_BAD))
def test_watch_bad_module_or_dump_dir(cli_env, tmp_path, case):
    """`-m distdiag.watch` with a module that is not there or a dump dir that is a file: one
    usage line, exit 2, before the script runs."""
    args, words = WATCH_BAD[case]
    (tmp_path / "dd").write_text("a file")
    (tmp_path / "train.py").write_text("print('ran')\n")
    out = distdiag(args, cli_env, tmp_path, module="distdiag.watch")
    assert out.returncode == 2, (out.returncode, out.stderr)
    assert out.stderr.count("\n") == 1 and out.stderr.startswith("distdiag.watch: error:"), out.stderr
    assert words in out.stderr and "ran" not in out.stdout


def test_watch_runs_a_module_and_a_script(cli_env, tmp_path):
    """The healthy twin: an existing module (-m) and a script with a dump dir that is a directory run."""
    (tmp_path / "dd").mkdir()
    (tmp_path / "train.py").write_text("print('ran')\n")
    out = distdiag(["--dump-dir", "dd", "--", "train.py"], cli_env, tmp_path, module="distdiag.watch")
    assert out.returncode == 0 and out.stdout.strip() == "ran", out.stderr
    (tmp_path / "mod_ok.py").write_text("print('module ran')\n")
    env = dict(cli_env, PYTHONPATH=f"{tmp_path}{os.pathsep}{cli_env['PYTHONPATH']}")
    out = distdiag(["-m", "mod_ok"], env, tmp_path, module="distdiag.watch")
    assert out.returncode == 0 and out.stdout.strip() == "module ran", out.stderr


@pytest.mark.parametrize("kind", ["link", "dangling", "fifo"])
def test_gate_refuses_a_report_path_that_is_a_link_or_fifo(cli_env, tmp_path, kind):
    """DISTDIAG_REPORT naming a link or FIFO: one line and exit 2 before torchrun starts (the
    ranks refused it, and the gate then read the linked file as its verdict: three lines, exit 3)."""
    victim = tmp_path / "victim"
    _plant(tmp_path / "gate.json", kind, victim)
    out = distdiag(["gate", "--nproc-per-node", "1", "--", sys.executable, "-c", "print('job ran')"],
                   dict(cli_env, DISTDIAG_REPORT="gate.json"), tmp_path)
    _one_line_exit_2(out, f"DISTDIAG_REPORT: gate.json {LINK_WORDS[kind]}")
    assert "job ran" not in out.stdout
    assert (victim.read_text() == "precious") if kind == "link" else not victim.exists()


def _memo_bomb(levels: int, inside_entries: bool) -> bytes:
    """A pickle of ~550 bytes whose list holds the same list twice, `levels` times over: a small
    graph through the memo, 2**levels values to any walk over it."""
    out = bytearray(b"\x80\x02]q\x00")  # PROTO 2, EMPTY_LIST, BINPUT 0
    for _ in range(levels):  # memo[0] = [memo[0], memo[0]]
        out += b"]q\x01(h\x00h\x00eh\x01q\x000"
    if inside_entries:  # {"entries": [{"input_sizes": memo[0]}]}
        return bytes(out + b"}(X\x07\x00\x00\x00entries](}(X\x0b\x00\x00\x00input_sizesh\x00ueu.")
    return bytes(out + b"}(X\x07\x00\x00\x00entriesh\x00u.")


BOUNDED_DUMPS = {
    "memo-bomb": (lambda: _memo_bomb(40, False), "one list shared many times over"),
    "memo-bomb-in-entries": (lambda: _memo_bomb(40, True), "one list shared many times over"),
    "ten-million-ints": (lambda: __import__("pickle").dumps({"entries": list(range(10**7))}),
                         "has over 5,000,000 items"),
    "cycle": (lambda: b"\x80\x02}q\x00(X\x07\x00\x00\x00entries]q\x01h\x01au.", "it contains itself"),
}


@pytest.mark.parametrize("case", list(BOUNDED_DUMPS))
def test_hang_report_dump_bombs_are_refused_in_seconds(cli_env, tmp_path, case):
    """A pickle memo bomb (~550 bytes that expand exponentially), the same inside `entries`, a list of
    10^7 numbers, a cycle: one line and exit 2 in seconds (the first ran until killed, the third was read)."""
    import time

    make, words = BOUNDED_DUMPS[case]
    (tmp_path / "dumps").mkdir()
    (tmp_path / "dumps" / "rank_0").write_bytes(make())
    start = time.monotonic()
    out = distdiag(["hang-report", "dumps"], cli_env, tmp_path)
    _one_line_exit_2(out, words)
    assert time.monotonic() - start < 30


def test_dump_bounds_read_a_real_sized_dump():
    """The healthy twin of the bombs: 2000 entries with call stacks, torch's default, pass the bounds."""
    import pickle

    from distdiag.hang.plainpickle import load_plain

    frames = [{"name": f"f{i}", "filename": "train.py", "line": i} for i in range(12)]
    entries = [{"collective_seq_id": i, "process_group": ("0", "default"), "input_sizes": [[4, 4]],
                "frames": frames, "state": "completed"} for i in range(2000)]
    dump = {"version": "2.10", "entries": entries, "pg_config": {}}
    assert load_plain(pickle.dumps(dump)) == dump


BIG_INPUT = {
    "5000-digit-config": (["--config", "big.toml"], "holds a number too long to be a setting"),
    "5000-char-report": (["--report", "r" * 5000], "check.report: cannot write"),
    "100kb-probes": (["--probes", ",".join(["env"] * 25_000)], "check.probes is 99999 characters long"),
    "empty-profile": (["--profile", ""], "unknown profile ''"),
    "inf-delay": (["--config", "inf.toml"], "probes.bandwidth.delay_s must be a finite number, got inf"),
    "nproc-2^31": (["--nproc-per-node", "2147483648"], "must be a whole number of ranks from 1 to 65536"),
    "timeout-minus-inf": (["--timeout-s=-inf"], "check.timeout_s must be a number of seconds > 0"),
}


@pytest.mark.parametrize("case", list(BIG_INPUT))
def test_check_huge_or_empty_values_are_one_line(cli_env, tmp_path, case):
    """A 5,000-digit integer in a config, a 5,000-character report name, --probes of 100 KB, --profile "",
    delay_s = inf, --nproc-per-node 2^31 (it grew to 10 GB), -inf seconds: one short line, exit 2, at once."""
    (tmp_path / "big.toml").write_text("[check]\ntimeout_s = " + "9" * 5000 + "\n")
    (tmp_path / "inf.toml").write_text("[probes.bandwidth]\ndelay_s = inf\n")
    args, words = BIG_INPUT[case]
    out = distdiag(["check", *args], cli_env, tmp_path)
    _one_line_exit_2(out, words)
    assert len(out.stderr) < 400, out.stderr


@pytest.mark.parametrize(("spec", "words"), [
    ("hang:collectivs:1", "names 'collectivs' (did you mean 'collectives'?), not a probe"),
    ("hang:env:100000000000000000000", "names rank 100000000000000000000; this job's ranks are 0 to 1"),
])
def test_inject_naming_no_probe_or_rank_is_bad_input(cli_env, tmp_path, spec, words):
    """DISTDIAG_INJECT naming an unknown probe or rank 10^20 never fires: said once, exit 2 (it was a PASS)."""
    out = distdiag(["check", "--probes", "env"], dict(cli_env, DISTDIAG_INJECT=spec), tmp_path)
    _one_line_exit_2(out, words)


def test_analyze_trainer_state_loss_that_is_no_number(cli_env, tmp_path):
    """`"loss": "x"` in a trainer_state.json: one line and exit 2, not a PASS on the points left."""
    history = [{"step": 1, "loss": "x"}] + [{"step": s, "loss": 1.0 / s} for s in range(2, 40)]
    (tmp_path / "trainer_state.json").write_text(json.dumps({"log_history": history}))
    _one_line_exit_2(distdiag(["analyze", "trainer_state.json"], cli_env, tmp_path),
                     "log_history[0]: 'loss' is 'x', expected a number")


def test_verdict_note_outside_a_launcher_folder_writes_nothing(tmp_path, monkeypatch):
    """DISTDIAG_VERDICT_NOTE pointing at a 0600 file of the user's (leaked, or set by hand) is never
    written through; in a launcher's own folder (the healthy twin) the note is written."""
    import tempfile

    from distdiag.launcher.ranks import LAUNCH_FOLDER_PREFIX, note_phase, note_verdict, read_json

    victim = tmp_path / "id_ed25519"
    victim.write_text("precious")
    victim.chmod(0o600)
    monkeypatch.setenv("DISTDIAG_VERDICT_NOTE", str(victim))
    note_verdict(0, True)
    note_phase("in probe 'env'")
    assert victim.read_text() == "precious" and sorted(p.name for p in tmp_path.iterdir()) == ["id_ed25519"]
    folder = tempfile.mkdtemp(prefix=LAUNCH_FOLDER_PREFIX, dir=tmp_path)
    monkeypatch.setenv("DISTDIAG_VERDICT_NOTE", os.path.join(folder, "verdict.json"))
    note_verdict(1, True)
    assert read_json(os.path.join(folder, "verdict.json"))["exit_code"] == 1


def test_gate_check_args_may_not_name_the_report(cli_env, tmp_path):
    """DISTDIAG_CHECK_ARGS="--report FILE" would make the ranks write over FILE unchecked: refused, exit 2."""
    victim = tmp_path / "secret"
    victim.write_text("precious")
    victim.chmod(0o600)
    out = distdiag(["gate", "--nproc-per-node", "1", "--", sys.executable, "-c", "print('job ran')"],
                   dict(cli_env, DISTDIAG_CHECK_ARGS=f"--report {victim}"), tmp_path)
    _one_line_exit_2(out, "DISTDIAG_CHECK_ARGS: --report is the gate's own; set DISTDIAG_REPORT instead")
    assert victim.read_text() == "precious" and "job ran" not in out.stdout
