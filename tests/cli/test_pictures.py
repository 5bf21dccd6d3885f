"""The pictures (matplotlib, the `plot` extra): the hang's wait-for graph as an image, the gate's
bandwidth chart, analyze's plot; each from a real input the tool wrote or read, each a valid
image of sane size; and without matplotlib, one line and exit 2 before anything runs."""

from __future__ import annotations

import json
import math
import struct
import subprocess
import sys
from pathlib import Path

import pytest

from tests.unit.analyze_curves import clean_curve, grad_curve

pytestmark = pytest.mark.timeout(240)

NO_MATPLOTLIB = (
    "import sys; sys.modules['matplotlib'] = None; from distdiag.cli import main; "
    "sys.argv = ['distdiag', *sys.argv[1:]]; main()"
)


def png_size(path: Path) -> tuple[int, int]:
    """(width, height) from the PNG's IHDR, after checking the signature."""
    data = path.read_bytes()
    assert data[:8] == b"\x89PNG\r\n\x1a\n" and data[12:16] == b"IHDR", data[:16]
    width, height = struct.unpack(">II", data[16:24])
    return width, height


def assert_sane_png(path: Path) -> None:
    width, height = png_size(path)
    assert 300 <= width <= 8000 and 200 <= height <= 8000, (width, height)


def run_cli(args: list[str], env: dict[str, str], cwd: Path, *, no_matplotlib: bool = False,
            timeout: float = 120) -> subprocess.CompletedProcess:
    head = ["-c", NO_MATPLOTLIB] if no_matplotlib else ["-m", "distdiag"]
    return subprocess.run([sys.executable, *head, *args], env=env, cwd=cwd, capture_output=True, text=True,
                          timeout=timeout, stdin=subprocess.DEVNULL)


def one_line_exit_2(out: subprocess.CompletedProcess, words: str) -> None:
    assert out.returncode == 2, (out.returncode, out.stderr)
    assert out.stderr.count("\n") == 1 and out.stderr.startswith("distdiag: error:"), out.stderr
    assert words in out.stderr, out.stderr


def _hang_folder(tmp_path: Path, world: int = 64) -> Path:
    """The watchdog writer's own report of a 64-rank hang (rank 3 in the data loader)."""
    from distdiag.report.model import write_report
    from tests.unit.test_hang_picture import _report

    folder = tmp_path / "hang"
    folder.mkdir()
    write_report(_report(world), folder / "hang-report.json")
    return folder


def _log(tmp_path: Path) -> Path:
    """A loss log with two spikes, a NaN region, a stretch a logger masked and an Inf tail."""
    loss, grad = clean_curve(600), grad_curve(600)
    for i in (150, 420):
        loss[i] *= 4
        grad[i - 1] *= 30
    loss = loss[:480] + [loss[479]] * 60 + [math.nan] * 20 + [loss[479]] * 10 + [math.inf] * 30
    grad = grad[:540] + [math.nan] * 60
    path = tmp_path / "run.jsonl"
    path.write_text("".join(json.dumps({"step": i, "loss": a, "grad_norm": b}) + "\n"
                            for i, (a, b) in enumerate(zip(loss, grad, strict=True))))
    return path


# -- the hang ---------------------------------------------------------------------------------


def test_hang_graph_as_png_and_svg(tmp_path, cli_env):
    """The watchdog's report of a 64-rank hang drawn as PNG and SVG: exit 3 (the verdict), images written."""
    pytest.importorskip("matplotlib")
    folder = _hang_folder(tmp_path)
    out = run_cli(["hang-report", str(folder), "--graph", "hang.png"], cli_env, tmp_path)
    assert out.returncode == 3 and "wait-for graph written to hang.png" in out.stderr, out.stderr
    assert_sane_png(tmp_path / "hang.png")
    out = run_cli(["hang-report", str(folder), "--graph", "hang.svg"], cli_env, tmp_path)
    assert out.returncode == 3, out.stderr
    assert (tmp_path / "hang.svg").read_text().lstrip().startswith("<?xml")


def test_hang_graph_image_from_dumps(tmp_path, cli_env):
    """Flight-recorder dumps (rank 1 stopped early) drawn as an image."""
    pytest.importorskip("matplotlib")
    from tests.unit.test_watchdog_cli import dump, entry

    (tmp_path / "fr_trace_0").write_text(json.dumps(dump([entry(1), entry(2), entry(3)])))
    (tmp_path / "fr_trace_1").write_text(json.dumps(dump([entry(1), entry(2)])))
    out = run_cli(["hang-report", ".", "--graph", str(tmp_path / "out" / "g.png")], cli_env, tmp_path)
    assert out.returncode == 3, out.stderr
    assert_sane_png(tmp_path / "out" / "g.png")


def test_hang_layers_put_the_culprit_first():
    """The layout's columns: the blamed rank in column 0, its direct waiters in 1, theirs in 2."""
    from distdiag.hang.drawing import layers
    from tests.unit.test_hang_picture import _report

    picture = _report(32).probes[0].details["wait_for_graph"]
    layer = layers(picture)
    assert layer["r3"] == 0 and layer["r0"] == 1, layer
    assert max(layer.values()) >= 2 and all(layer[e["src"]] > layer[e["dst"]] for e in picture["edges"]
                                            if layer[e["dst"]] == 0), layer
    cyclic = {"nodes": [{"id": "a", "label": "a", "kind": "stranded"}, {"id": "b", "label": "b", "kind": "stranded"}],
              "edges": [{"src": "a", "dst": "b", "label": ""}, {"src": "b", "dst": "a", "label": ""}]}
    assert set(layers(cyclic).values()) <= {0, 1}  # a cycle in a report is cut, not recursed into


# -- analyze ----------------------------------------------------------------------------------


def test_analyze_plot_of_a_log_with_nan_regions(tmp_path, cli_env):
    """A real log with spikes, NaN, a masked stretch and Inf: the plot is a sane PNG; the findings are there."""
    pytest.importorskip("matplotlib")
    log = _log(tmp_path)
    out = run_cli(["analyze", str(log), "--plot", "curves.png"], cli_env, tmp_path)
    assert out.returncode == 1 and "plot written to curves.png" in out.stderr, out.stderr
    assert "became NaN at step 540" in out.stdout and "spiked at step 150" in out.stdout, out.stdout
    assert_sane_png(tmp_path / "curves.png")


def test_nonfinite_spans_and_label_rows():
    """NaN runs become spans up to the next finite step; labels that would overlap go to other rows."""
    from distdiag.analyze.plot import label_rows, nonfinite_spans
    from distdiag.analyze.series import Series

    s = Series("loss", list(range(10)), [1.0, math.nan, math.nan, 2.0, 3.0, math.inf, 1.0, 1.0, math.nan, math.nan])
    assert nonfinite_spans(s) == [(1, 3), (5, 6), (8, 9)]
    assert nonfinite_spans(Series("x", [0, 1], [1.0, 2.0])) == []
    rows = label_rows([(0.10, 0.05), (0.12, 0.05), (0.13, 0.05), (0.16, 0.05), (0.5, 0.05)], rows=2)
    assert rows == [0, 1, None, 0, 0]
    # what label_rows places never overlaps in a row
    items = [(i / 40, 0.08) for i in range(40)]
    placed = [(row, left, left + w) for row, (left, w) in zip(label_rows(items), items, strict=True) if row is not None]
    for row, left, right in placed:
        assert not any(r == row and left < r2 and l2 < right and (l2, r2) != (left, right) for r, l2, r2 in placed)


# -- the gate's chart -------------------------------------------------------------------------


def _bandwidth_config(tmp_path: Path, body: str) -> Path:
    path = tmp_path / "bw.toml"
    path.write_text('[probes.bandwidth]\nsizes = ["4KiB"]\np2p_size = "64KiB"\n' + body)
    return path


def test_chart_of_a_real_bandwidth_report(tmp_path):
    """Rank 2 sleeps 30 ms before each call (4 gloo ranks): the chart marks it as the probe named it."""
    pytest.importorskip("matplotlib")
    from distdiag.report.bandwidth_chart import draw_bandwidth_chart, judged
    from tests.harness import run_check

    cfg = _bandwidth_config(tmp_path, 'delay_rank = 2\ndelay_s = 0.03\nexpected_busbw_gbps = {"4KiB" = {all_reduce = 50}}\n')
    result = run_check(4, ["--probes", "bandwidth", "--config", str(cfg)], tmp_path / "run", timeout=90)
    assert result.codes == [1] * 4, result.stderr
    report = result.report()
    probe = report.probe("bandwidth")
    assert probe.details["limits"]["straggler_score"] == 0.3, probe.details
    stragglers, slow = judged(probe.details, probe.findings)
    named = {r for f in probe.findings if "straggler" in f.issue for r in f.ranks}
    assert stragglers == named == {2}, (stragglers, [f.issue for f in probe.findings])
    assert slow == {"1<->2", "2<->3"}, slow
    # an older report (no limits): the same marks from the findings
    old = {k: v for k, v in probe.details.items() if k != "limits"}
    assert judged(old, probe.findings) == (stragglers, slow)
    assert_sane_png(draw_bandwidth_chart(report, tmp_path / "chart.png"))
    # the same chart from the saved report, afterwards
    from typer.testing import CliRunner

    from distdiag.cli import app

    out = CliRunner().invoke(app, ["report", "show", str(tmp_path / "run" / "distdiag-report.json"),
                                   "--chart", str(tmp_path / "again.svg")])
    assert out.exit_code == 1 and "bandwidth chart written to" in out.output, out.output
    assert (tmp_path / "again.svg").read_text().lstrip().startswith("<?xml")


@pytest.mark.torchrun
def test_gate_chart_drawn_on_a_pass_and_on_a_stop(tmp_path, cli_env):
    """`distdiag gate --chart`: passing, the chart is drawn and the command then runs (its code);
    stopped by a missed busbw floor, the chart is drawn and the command never runs."""
    pytest.importorskip("matplotlib")
    for case, body, code in (("pass", "delay_rank = 1\ndelay_s = 0.02\n", 0),
                             ("stop", 'expected_busbw_gbps = {"4KiB" = {all_reduce = 50}}\n', 1)):
        cwd = tmp_path / case
        cwd.mkdir()
        env = dict(cli_env, DISTDIAG_CONFIG=str(_bandwidth_config(cwd, body)), DISTDIAG_CHECK_ARGS="--probes env,bandwidth")
        out = run_cli(["gate", "--chart", "bw.png", "--nproc-per-node", "3", "--",
                       sys.executable, "-c", "open('trained', 'w').write('yes')"], env, cwd, timeout=200)
        assert out.returncode == code, (case, out.stderr[-3000:])
        assert "bandwidth chart written to bw.png" in out.stderr, out.stderr[-3000:]
        assert_sane_png(cwd / "bw.png")
        assert (cwd / "trained").exists() == (case == "pass")


def test_split_chart():
    """--chart is the gate's own option only before `--`; the rest is handed on untouched."""
    from distdiag.cli.gate import split_chart

    assert split_chart(["--chart", "a.png", "--nnodes", "2", "--", "x", "--chart", "b"]) == (
        "a.png", ["--nnodes", "2", "--", "x", "--chart", "b"])
    assert split_chart(["--chart=a.svg", "--", "x"]) == ("a.svg", ["--", "x"])
    assert split_chart(["--", "train.py", "--chart", "c.png"]) == (None, ["--", "train.py", "--chart", "c.png"])
    with pytest.raises(ValueError, match="--chart needs a FILE"):
        split_chart(["--chart", "--", "x"])


def test_gate_chart_bad_input_is_one_line(tmp_path, cli_env):
    """A --chart that is not an image path, or a link: one line, exit 2, before any rank starts."""
    out = run_cli(["gate", "--chart", "bw.txt", "--", "true"], cli_env, tmp_path)
    one_line_exit_2(out, "--chart: bw.txt must end in .png, .svg, .pdf")
    (tmp_path / "victim.png").write_text("precious")
    (tmp_path / "bw.png").symlink_to(tmp_path / "victim.png")
    out = run_cli(["gate", "--chart", "bw.png", "--", "true"], cli_env, tmp_path)
    one_line_exit_2(out, "--chart: bw.png")
    assert (tmp_path / "victim.png").read_text() == "precious"
    assert not (tmp_path / "distdiag-gate-report.json").exists()


# -- without matplotlib -----------------------------------------------------------------------


def test_without_matplotlib_each_image_is_one_line_and_exit_2(tmp_path, cli_env):
    """matplotlib missing: asking any command for an image is one line naming the extra, exit 2,
    no file; the DOT text still works."""
    folder = _hang_folder(tmp_path)
    log = _log(tmp_path)
    cases = {
        "--graph FILE.png": ["hang-report", str(folder), "--graph", "hang.png"],
        "--plot": ["analyze", str(log), "--plot", "hang.png"],
        "--chart": ["gate", "--chart", "hang.png", "--nproc-per-node", "2", "--", "true"],
        "--chart ": ["report", "show", str(folder / "hang-report.json"), "--chart", "hang.png"],
    }
    for option, args in cases.items():
        out = run_cli(args, cli_env, tmp_path, no_matplotlib=True)
        one_line_exit_2(out, f"{option.strip()} needs matplotlib: pip install 'distdiag[plot]'")
        assert not (tmp_path / "hang.png").exists() and not (tmp_path / "distdiag-gate-report.json").exists()
    out = run_cli(["hang-report", str(folder), "--graph", "hang.dot"], cli_env, tmp_path, no_matplotlib=True)
    assert out.returncode == 3 and (tmp_path / "hang.dot").read_text().startswith("digraph"), out.stderr


def test_node_labels_wrap_between_folders():
    """A long path in a node's label breaks after a `/`, never inside a file name; no line is too long."""
    from distdiag.hang.drawing import _wrap

    rows = _wrap("is at /work/wt/plots36/distdiag/runtime/faults.py:59 in fire: time.sleep(3600)")
    assert rows == ["is at /work/wt/plots36/distdiag/runtime/", "faults.py:59 in fire: time.sleep(3600)"]
    assert all(len(r) <= 44 for r in _wrap("x" * 100)) and _wrap("") == [""]
