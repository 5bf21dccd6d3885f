"""Formats recognised by content, and the fault campaign of issue 14: non-UTF-8 files, deeply
nested JSON and fields of the wrong type are each one line on stderr and exit 2, no traceback.
(Logs written by the real trainers: tests/integrations/test_analyze_trainer_logs.py.)"""

from __future__ import annotations

import json
import math

import pytest
from typer.testing import CliRunner

from distdiag.analyze import load_run
from distdiag.cli import app
from tests.unit.analyze_curves import clean_curve, grad_curve
from tests.unit.test_analyze_readers import write_events


def _cli(*args: str):
    result = CliRunner().invoke(app, ["analyze", *args])
    return result.exit_code, result.stdout, result.stderr


def _state(history: list) -> dict:
    return {"global_step": 10, "epoch": 1.0, "log_history": history, "best_metric": None}


def test_trainer_state_by_content_whatever_its_name(tmp_path):
    """A trainer_state.json, pretty or on one line, named anything: log_history read, the closing
    summary and runtime keys left out, distdiag findings carried into the 'monitor' probe."""
    finding = {"severity": "error", "issue": "the first non-finite value on rank 1 appeared in its forward: module 'mlp'",
               "evidence": "", "ranks": [1], "fix": "", "confidence": 0.9}
    history = [{"loss": v, "grad_norm": 1.0, "learning_rate": 1e-3, "epoch": i / 50, "step": i + 1} for i, v in enumerate(clean_curve(50))]
    history += [{"eval_loss": 2.0, "eval_runtime": 0.1, "eval_samples_per_second": 9.0, "step": 25, "epoch": 0.5},
                {"distdiag_finding": finding, "step": 30},
                {"train_loss": 1.5, "train_runtime": 3.0, "total_flos": 1e9, "step": 50, "epoch": 1.0}]
    for name, indent in (("trainer_state.json", 2), ("state.txt", None), ("noext", 1)):
        p = tmp_path / name
        p.write_text(json.dumps(_state(history), indent=indent))
        run = load_run(p)
        assert run.format == "hf_trainer_state"
        assert set(run.series) == {"loss", "grad_norm", "learning_rate", "eval_loss"}, (name, set(run.series))
        assert run.series["loss"].steps[:2] == [1, 2] and run.series["eval_loss"].steps == [25]
        assert run.monitor_findings[0]["step"] == 30
    code, out, _ = _cli(str(tmp_path / "trainer_state.json"))
    assert code == 1 and "module 'mlp'" in out and f"{tmp_path.name} (" in out  # labelled by its folder; a FAIL: exit 1


def test_directories_json_arrays_and_renamed_event_files(tmp_path):
    """A checkpoint folder tree reads its latest trainer_state.json; a JSON array of records reads
    like JSON lines; an event file without 'tfevents' in its name is recognised by its records."""
    for step in (10, 20):
        d = tmp_path / "out" / f"checkpoint-{step}"
        d.mkdir(parents=True)
        d.joinpath("trainer_state.json").write_text(json.dumps(_state([{"loss": 1.0 / (i + 1), "step": i} for i in range(step)])))
    assert load_run(tmp_path / "out").series["loss"].steps[-1] == 19
    (tmp_path / "records.json").write_text(json.dumps([{"step": i, "loss": v} for i, v in enumerate(clean_curve(30))]))
    assert len(load_run(tmp_path / "records.json").series["loss"]) == 30
    write_events(tmp_path / "renamed.bin", {"loss": clean_curve(20)})
    assert len(load_run(tmp_path / "renamed.bin").series["loss"]) == 20
    (tmp_path / "metrics.log").write_text("step,loss\n1,2.0\n2,1.5\n")  # a CSV header wins over the name
    assert load_run(tmp_path / "metrics.log").series["loss"].values == [2.0, 1.5]


def test_lightning_and_wandb_csv_layouts(tmp_path):
    """Lightning's CSVLogger (epoch + step, train and validation rows mixed) and a W&B panel export
    (`RUN - METRIC` columns, __MIN/__MAX companions skipped, NaN cells kept)."""
    p = tmp_path / "metrics.csv"
    p.write_text("epoch,step,train_loss,val_loss\n0,0,2.0,\n0,1,1.8,\n0,1,,1.9\n1,2,nan,\n")
    run = load_run(p)
    assert run.format == "lightning_csv" and set(run.series) == {"train_loss", "val_loss"}
    assert run.series["train_loss"].steps == [0, 1, 2] and math.isnan(run.series["train_loss"].values[2])
    assert run.series["val_loss"].steps == [1]
    w = tmp_path / "wandb.csv"
    w.write_text('"Step","run-1 - train/loss","run-1 - train/loss__MIN","run-1 - train/loss__MAX","run-1 - train/grad_norm"\n'
                 '1,2.0,1.9,2.1,0.5\n2,1.5,1.4,1.6,NaN\n')
    run = load_run(w)
    assert run.format == "wandb_csv" and set(run.series) == {"train/loss", "train/grad_norm"}
    assert math.isnan(run.series["train/grad_norm"].values[1])


def _bad(tmp_path) -> list[tuple[str, str]]:
    (tmp_path / "latin1.csv").write_bytes("step,loss\n1,2.0\n2,1.5 é\n".encode("latin-1"))
    (tmp_path / "latin1.jsonl").write_bytes(b'{"step": 1, "loss": 2.0, "na\xefve": 1}\n')
    (tmp_path / "utf16.json").write_text(json.dumps(_state([{"loss": 1.0, "step": 1}])), encoding="utf-16")
    (tmp_path / "latin1_state").mkdir()
    (tmp_path / "latin1_state" / "trainer_state.json").write_bytes(b'{"log_history": [], "note": "caf\xe9"}')
    (tmp_path / "deep.json").write_text("[" * 100_000 + "]" * 100_000)
    (tmp_path / "deep.jsonl").write_text('{"a":' * 5000 + "1" + "}" * 5000 + "\n")
    (tmp_path / "nested.jsonl").write_text('{"step": 1, "m":' + '{"a":' * 100 + "1" + "}" * 101 + "\n")
    (tmp_path / "plain.json").write_text(json.dumps({"model": "x", "lr": 0.1}, indent=2))
    (tmp_path / "broken.json").write_text('{\n  "log_history": [\n    {"loss": 1.0,\n')
    (tmp_path / "severity.jsonl").write_text('{"kind": "finding", "step": 1, "finding": {"severity": 3, "issue": "x"}}\n{"step": 1, "loss": 2}\n')
    (tmp_path / "ranks.jsonl").write_text('{"kind": "finding", "step": 1, "finding": {"severity": "error", "issue": "x", "ranks": "ab"}}\n')
    (tmp_path / "fstep.jsonl").write_text('{"kind": "finding", "step": "one", "finding": {"severity": "error", "issue": "x"}}\n')
    (tmp_path / "history.json").write_text(json.dumps({"log_history": {"loss": 1}}))
    (tmp_path / "entry.json").write_text(json.dumps(_state([{"loss": 1.0, "step": 1}, [1, 2]])))
    (tmp_path / "hfstep.json").write_text(json.dumps(_state([{"loss": 1.0, "step": "3"}])))
    (tmp_path / "hffinding.json").write_text(json.dumps(_state([{"distdiag_finding": {"severity": "bad", "issue": "x"}, "step": 3}])))
    (tmp_path / "infstep.csv").write_text("step,loss\n1,2.0\ninf,1.0\n")
    (tmp_path / "emptydir").mkdir()
    return [
        ("latin1.csv", "byte 0xe9 at offset 22 is not UTF-8 (expected CSV)"),
        ("latin1.jsonl", "byte 0xef at offset 28 is not UTF-8"),
        ("utf16.json", "byte 0xff at offset 0 is not UTF-8"),
        ("latin1_state", "is not UTF-8 (expected a Hugging Face trainer_state.json)"),
        ("deep.json", "nested too deeply"),
        ("deep.jsonl", "nested too deeply"),
        ("nested.jsonl", "nested more than 64 levels deep"),
        ("plain.json", "not a Hugging Face trainer_state.json (no 'log_history' list; keys: lr, model); expected JSON lines"),
        ("broken.json", "neither JSON lines (line 1 is not valid JSON) nor one JSON document"),
        ("severity.jsonl", "line 1: finding field 'severity' is 3, expected one of info, warning, error, critical"),
        ("ranks.jsonl", "finding field 'ranks' is 'ab', expected a list of rank numbers"),
        ("fstep.jsonl", "the finding's step is 'one', expected an integer"),
        ("history.json", "'log_history' is a JSON dict, expected a list"),
        ("entry.json", "log_history[1] is a JSON list, expected an object"),
        ("hfstep.json", "log_history[0]: 'step' is '3', expected the integer global step"),
        ("hffinding.json", "log_history[0]: finding field 'severity' is 'bad'"),
        ("infstep.csv", "row 3: step 'inf' is not a number"),
        ("emptydir", "a directory with no log distdiag reads; expected TensorBoard event files"),
    ]


@pytest.mark.timeout(60)
def test_bad_encodings_nesting_and_field_types_are_one_line_exit_2(tmp_path):
    for name, expected in _bad(tmp_path):
        code, out, err = _cli(str(tmp_path / name))
        lines = err.strip().splitlines()
        assert code == 2 and len(lines) == 1 and lines[0].startswith("distdiag: error: "), (name, code, out[-500:], err[-1500:])
        assert expected in lines[0] and name in lines[0], (name, lines[0])
        assert "Traceback" not in out + err


def test_masked_loss_beside_nan_grad_norm_is_seen_through(tmp_path):
    """A trainer_state.json whose loss turns exactly 0 where grad_norm turns NaN (the HF Trainer's
    NaN filter): 'masked' says so and the loss counts as NaN from there for the other detectors."""
    loss, grad = clean_curve(100), grad_curve(100)
    history = [{"loss": 0.0 if i >= 60 else loss[i], "grad_norm": math.nan if i >= 60 else grad[i], "step": i} for i in range(100)]
    p = tmp_path / "trainer_state.json"
    p.write_text(json.dumps(_state(history)))
    code, out, _ = _cli(str(p), "--format", "json")
    report = json.loads(out)
    probes = {pr["name"]: pr for pr in report["probes"]}
    masked = probes["masked"]["findings"]
    assert masked[0]["severity"] == "error" and masked[0]["issue"].startswith("loss hides non-finite values from step 60: logged as exactly 0")
    assert "logging_nan_inf_filter=True" in masked[0]["evidence"]
    assert probes["nonfinite"]["findings"][0]["issue"] == "loss became NaN at step 60"
    assert probes["plateau"]["findings"] == [] or all("at 0 " not in f["issue"] for f in probes["plateau"]["findings"])


def test_a_loss_that_stops_while_others_go_on_is_named(tmp_path):
    """An export that dropped the NaN points: the loss ends at step 59, the learning rate goes on."""
    loss = clean_curve(100)
    p = tmp_path / "export.csv"
    p.write_text("Step,loss,lr\n" + "".join(f"{i},{loss[i] if i < 60 else ''},{1e-3}\n" for i in range(100)))
    code, out, _ = _cli(str(p))
    assert code == 0 and "loss is not logged after step 59 while lr goes on to step 99" in out
