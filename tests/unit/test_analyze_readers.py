"""Reading logs: JSONL, CSV, TensorBoard event files (own encoder below, no tensorboard needed);
malformed and truncated files give one clear line and exit 2, never a traceback."""

from __future__ import annotations

import json
import math
import struct
import sys

import pytest
from typer.testing import CliRunner

from distdiag.analyze import LogFormatError, load_run
from distdiag.analyze.tfevents import masked_crc
from distdiag.cli import app
from tests.unit.analyze_curves import clean_curve, grad_curve, write_jsonl


# -- a minimal TensorBoard event writer (protobuf by hand), the way add_scalar / TF2 write them --
def _varint(n: int) -> bytes:
    out = bytearray()
    while True:
        b = n & 0x7F
        n >>= 7
        out.append(b | (0x80 if n else 0))
        if not n:
            return bytes(out)


def _field(num: int, wire: int, payload: bytes) -> bytes:
    key = _varint((num << 3) | wire)
    return key + (_varint(len(payload)) + payload if wire == 2 else payload)


def _event(step: int, tag: str, value: float, *, tensor: bool = False) -> bytes:
    if tensor:  # TF2: a one-element DT_FLOAT TensorProto in tensor_content
        proto = _field(1, 0, _varint(1)) + _field(4, 2, struct.pack("<f", value))
        val = _field(1, 2, tag.encode()) + _field(8, 2, proto)
    else:  # simple_value
        val = _field(1, 2, tag.encode()) + _field(2, 5, struct.pack("<f", value))
    summary = _field(1, 2, val)
    return _field(1, 1, struct.pack("<d", 1.7e9 + step)) + _field(2, 0, _varint(step)) + _field(5, 2, summary)


def _record(payload: bytes) -> bytes:
    header = struct.pack("<Q", len(payload))
    return header + struct.pack("<I", masked_crc(header)) + payload + struct.pack("<I", masked_crc(payload))


def write_events(path, series: dict[str, list[float]], *, tensor: bool = False) -> None:
    blob = _record(_field(3, 2, b"brain.Event:2"))
    for step in range(max(len(v) for v in series.values())):
        for tag, values in series.items():
            if step < len(values):
                blob += _record(_event(step, tag, values[step], tensor=tensor))
    path.write_bytes(blob)


def _cli(*args: str):
    result = CliRunner().invoke(app, ["analyze", *args])
    return result.exit_code, result.stdout, result.stderr


# -- readers ------------------------------------------------------------------------------------
@pytest.mark.parametrize("tensor", [False, True])
def test_tensorboard_events_read_without_tensorboard(tmp_path, tensor):
    """simple_value and TF2 tensor scalars are read with their steps; a NaN stays a NaN."""
    loss = clean_curve(100)
    loss[60] = math.nan
    logdir = tmp_path / "tb"
    logdir.mkdir()
    write_events(logdir / "events.out.tfevents.1.host", {"train/loss": loss, "grad_norm": grad_curve(100)}, tensor=tensor)
    run = load_run(logdir)
    assert set(run.series) == {"train/loss", "grad_norm"}
    s = run.series["train/loss"]
    assert s.steps == list(range(100)) and math.isnan(s.values[60])
    assert s.values[3] == pytest.approx(loss[3], rel=1e-6)
    code, out, _ = _cli(str(logdir))
    assert code == 1 and "train/loss became NaN at step 60" in out


CRC32C_VECTORS = [(b"", 0), (b"123456789", 0xE3069283), (bytes(32), 0x8A9136AA), (b"\xff" * 32, 0x62A8AB43),
                  (bytes(range(32)), 0x46DD794E)]  # the check value and RFC 3720's B.4 vectors


def test_crc32c_python_gives_the_known_values():
    """The pure-Python fallback against the standard CRC32C vectors."""
    from distdiag.analyze.tfevents import crc32c_python

    assert [crc32c_python(data) for data, _ in CRC32C_VECTORS] == [want for _, want in CRC32C_VECTORS]


def test_crc32c_c_and_python_agree(tmp_path, monkeypatch):
    """google-crc32c's C code (the `crc32c` extra) and the Python fallback give the same checksums, and the
    reader gives the same series through either."""
    pytest.importorskip("google_crc32c")
    import random

    from distdiag.analyze import tfevents

    assert tfevents.crc32c_implementation() == "c"
    rng = random.Random(0)
    for data in [d for d, _ in CRC32C_VECTORS] + [rng.randbytes(n) for n in (1, 7, 64, 1000, 65537)]:
        assert tfevents.crc32c(data) == tfevents.crc32c_python(data), len(data)
    path = tmp_path / "events.out.tfevents.1.host"
    write_events(path, {"loss": clean_curve(50)}, tensor=False)
    with_c = load_run(path).series["loss"].values
    monkeypatch.setattr(tfevents, "_FAST", [None])
    assert tfevents.crc32c_implementation() == "python"
    assert load_run(path).series["loss"].values == with_c


def test_jsonl_generic_nested_and_resumed(tmp_path):
    """Generic lines, nested dicts flattened with '/', a resumed run's repeated steps keep the last."""
    p = tmp_path / "m.jsonl"
    lines = [{"step": i, "loss": 2.0 - i / 10, "opt": {"lr": 0.1}} for i in range(5)] + [{"step": 3, "loss": 9.0}]
    p.write_text("".join(json.dumps(x) + "\n" for x in lines))
    run = load_run(p)
    assert run.series["loss"].steps == [0, 1, 2, 3, 4] and run.series["loss"].values[3] == 9.0
    assert run.series["opt/lr"].values == [0.1] * 5


def test_csv_with_wandb_style_header(tmp_path):
    p = tmp_path / "export.csv"
    p.write_text("Step,train_loss,val_loss\n0,2.0,\n1,1.5,1.9\n2,nan,\n")
    run = load_run(p)
    assert run.series["train_loss"].steps == [0, 1, 2] and math.isnan(run.series["train_loss"].values[2])
    assert run.series["val_loss"].steps == [1]


# -- bad input: one line, exit 2 -----------------------------------------------------------------
def _bad_files(tmp_path):
    good = "".join(json.dumps({"step": i, "loss": 1.0}) + "\n" for i in range(5))
    (tmp_path / "mid.jsonl").write_text(good + "{not json\n" + good)
    (tmp_path / "empty.jsonl").write_text("")
    (tmp_path / "array.jsonl").write_text("[1, 2]\n")
    (tmp_path / "strstep.jsonl").write_text('{"step": "x", "loss": 1}\n')
    (tmp_path / "cols.csv").write_text("step,loss\n1,2.0\n2,3.0,4.0\n3,1.0\n")
    (tmp_path / "text.csv").write_text("step,loss\n1,abc\n2,1.0\n")
    (tmp_path / "nometric.jsonl").write_text('{"step": 1, "name": "a"}\n')
    (tmp_path / "binary.jsonl").write_bytes(b"\xff\xfe\x00garbage")
    (tmp_path / "weird.bin").write_bytes(b"\x00\x01")
    write_events(tmp_path / "events.out.tfevents.corrupt", {"loss": [1.0, 2.0, 3.0]})
    blob = bytearray((tmp_path / "events.out.tfevents.corrupt").read_bytes())
    blob[40] ^= 0xFF  # flip a byte inside a record: its checksum no longer matches
    (tmp_path / "events.out.tfevents.corrupt").write_bytes(bytes(blob))
    (tmp_path / "events.out.tfevents.notevents").write_bytes(b"hello world, this is not a TFRecord")
    return [
        ("mid.jsonl", "line 6 is not valid JSON"),
        ("empty.jsonl", "no numeric metrics"),
        ("array.jsonl", "holds a JSON list"),
        ("strstep.jsonl", "step 'step' is 'x'"),
        ("cols.csv", "row 3 has 3 columns"),
        ("text.csv", "'abc' is not a number"),
        ("nometric.jsonl", "no numeric metrics"),
        ("binary.jsonl", "not a text file"),
        ("weird.bin", "unknown log format"),
        ("events.out.tfevents.corrupt", "checksum"),
        ("events.out.tfevents.notevents", "bad length checksum"),
        ("missing.jsonl", "no such file"),
    ]


def test_malformed_logs_give_one_line_and_exit_2(tmp_path):
    """Each malformed file: exit 2, one stderr line naming the file and the problem, no traceback."""
    for name, expected in _bad_files(tmp_path):
        code, out, err = _cli(str(tmp_path / name))
        assert code == 2, (name, code, out, err)
        lines = err.strip().splitlines()
        assert len(lines) == 1 and lines[0].startswith("distdiag: error: ") and name in lines[0], (name, err)
        assert expected in lines[0], (name, lines[0])
        assert "Traceback" not in out + err


def test_truncated_last_line_is_noted_or_strict_error(tmp_path):
    """A log cut mid-line (a killed writer): analysed with a note; with --strict: exit 2."""
    p = write_jsonl(tmp_path / "cut.jsonl", loss=clean_curve(100))
    p.write_text(p.read_text()[:-9])
    code, out, err = _cli(str(p))
    assert code == 0 and "skipped a truncated last line 100" in err and "verdict" in out
    code, out, err = _cli(str(p), "--strict")
    assert code == 2 and len(err.strip().splitlines()) == 1 and "line 100 is not valid JSON" in err


def test_truncated_tensorboard_record(tmp_path):
    """An event file cut inside its last record: noted (default) or one line, exit 2 (--strict)."""
    ev = tmp_path / "events.out.tfevents.cut"
    write_events(ev, {"loss": clean_curve(50)})
    ev.write_bytes(ev.read_bytes()[:-7])
    code, _, err = _cli(str(ev))
    assert code == 0 and "truncated last record" in err
    code, _, err = _cli(str(ev), "--strict")
    assert code == 2 and len(err.strip().splitlines()) == 1 and "truncated record" in err


def test_bad_options_and_unknown_metric(tmp_path):
    p = write_jsonl(tmp_path / "a.jsonl", loss=clean_curve(50))
    code, _, err = _cli(str(p), "--spike-factor", "1")
    assert code == 2 and "--spike-factor must be a finite number > 1, got 1.0" in err
    code, _, err = _cli(str(p), "--spike-factor", "inf")  # it would find no spike at all, and pass
    assert code == 2 and "--spike-factor must be a finite number > 1, got inf" in err
    code, _, err = _cli(str(p), "--metric", "nope")
    assert code == 2 and "no metric 'nope'" in err and "loss" in err
    code, _, err = _cli(str(p), "--format", "xml")
    assert code == 2 and "--format must be text or json" in err


def test_json_output_is_a_report_and_exit_code(tmp_path):
    """--format json is a distdiag report that parses back; the exit code is 1 on an error."""
    from distdiag.report.model import Report

    loss = [v if i < 80 else math.nan for i, v in enumerate(clean_curve(100))]
    p = write_jsonl(tmp_path / "nan.jsonl", loss=loss)
    code, out, _ = _cli(str(p), "--format", "json")
    assert code == 1
    report = Report.from_dict(json.loads(out))
    assert report.probe("nonfinite").findings[0].issue == "loss became NaN at step 80"
    assert report.probe("nonfinite").details["events"][0]["step"] == 80


def test_printed_exit_code_is_the_one_returned(tmp_path):
    """A failing analysis exits with the verdict's code by default (a CI step fails on it), 0 with
    --exit-zero, and prints the code it returns; the old --exit-code is accepted and changes nothing."""
    loss = [v if i < 80 else math.nan for i, v in enumerate(clean_curve(100))]
    p = write_jsonl(tmp_path / "nan.jsonl", loss=loss)
    code, out, _ = _cli(str(p))
    assert code == 1 and "verdict: FAIL (exit 1) -" in out, out
    code, out, _ = _cli(str(p), "--exit-zero")
    assert code == 0 and "verdict: FAIL (exit 0 with --exit-zero; the verdict's code is 1)" in out, out
    code, out, _ = _cli(str(p), "--exit-code")
    assert code == 1 and "verdict: FAIL (exit 1) -" in out, out


def test_plot_written(tmp_path):
    """--plot writes a PNG (matplotlib installed as the plot extra)."""
    pytest.importorskip("matplotlib")
    loss = clean_curve()
    loss[300] *= 4
    a = write_jsonl(tmp_path / "a.jsonl", loss=loss, grad_norm=grad_curve())
    b = write_jsonl(tmp_path / "b.jsonl", loss=clean_curve(seed=3), grad_norm=grad_curve(seed=4))
    code, _, err = _cli(str(a), str(b), "--plot", str(tmp_path / "out" / "curves.png"))
    assert code == 0, err
    assert (tmp_path / "out" / "curves.png").read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


def test_plot_without_matplotlib_is_one_line(tmp_path, monkeypatch):
    """No matplotlib: one line saying how to install it, exit 2."""
    monkeypatch.setitem(sys.modules, "matplotlib", None)  # import matplotlib now raises ImportError
    p = write_jsonl(tmp_path / "a.jsonl", loss=clean_curve(50))
    code, _, err = _cli(str(p), "--plot", str(tmp_path / "x.png"))
    assert code == 2 and err.strip() == "distdiag: error: --plot needs matplotlib: pip install 'distdiag[plot]'"


def test_load_run_raises_logformaterror(tmp_path):
    with pytest.raises(LogFormatError, match="no such file"):
        load_run(tmp_path / "nope.jsonl")
