"""`distdiag analyze` on logs the real trainers wrote in this test (single process, tiny models):
the HF Trainer's trainer_state.json and TensorBoard events, Lightning's CSVLogger metrics.csv and
TensorBoardLogger events, each from a healthy run, a run whose learning rate is far too high and a
run with a NaN injected at a step. W&B cannot export offline: its CSV is built from W&B's panel
export layout ("Step", "RUN - METRIC", "RUN - METRIC__MIN/__MAX"; NaN written "NaN", or dropped)
out of the values the real HF and Lightning runs logged."""

from __future__ import annotations

import csv
import json
import math
import shutil
from pathlib import Path

import pytest

from distdiag.analyze import analyze, load_run

transformers = pytest.importorskip("transformers")
pytest.importorskip("lightning")
pytest.importorskip("tensorboardX")

from tests.integrations.real_logs import hf_run, lightning_run  # noqa: E402

pytestmark = pytest.mark.timeout(300)

NAN_STEP_HF = 30  # injected from the Trainer's step 30: log_history step 31 (global_step after the update)
NAN_STEP_PL = 40


@pytest.fixture(scope="module")
def hf_logs(tmp_path_factory) -> dict[str, Path]:
    root = tmp_path_factory.mktemp("hf")
    return {"ok": hf_run(root / "ok", save=20), "nan": hf_run(root / "nan", nan_step=NAN_STEP_HF), "lr": hf_run(root / "lr", lr=3.0)}


@pytest.fixture(scope="module")
def pl_logs(tmp_path_factory) -> dict[str, Path]:
    root = tmp_path_factory.mktemp("pl")
    out = {}
    for logger in ("csv", "tb"):
        out[f"ok_{logger}"] = lightning_run(root / f"ok_{logger}", logger=logger)
        out[f"nan_{logger}"] = lightning_run(root / f"nan_{logger}", logger=logger, nan_step=NAN_STEP_PL)
    out["lr_csv"] = lightning_run(root / "lr_csv", lr=3.0)
    return out


def _severe(path: Path) -> list[str]:
    report = analyze([load_run(path)])
    return [f"{p}: {f.issue}" for p, f in report.findings("warning")]


def _issues(path: Path, probe: str) -> list[str]:
    return [f.issue for f in analyze([load_run(path)]).probe(probe).findings]


def _events_dir(out: Path) -> Path:
    return next(out.glob("runs/*"))


def test_hf_healthy_run_is_quiet_in_every_form(hf_logs):
    """trainer_state.json (top level and the latest checkpoint's), the output dir, its TensorBoard run."""
    ok = hf_logs["ok"]
    run = load_run(ok / "trainer_state.json")
    assert run.format == "hf_trainer_state" and {"loss", "grad_norm", "learning_rate", "eval_loss"} <= set(run.series)
    assert len(run.series["loss"]) == 60 and len(run.series["eval_loss"]) == 6
    assert load_run(_events_dir(ok)).series["train/loss"].values == pytest.approx(run.series["loss"].values, rel=1e-6)
    ckpts = ok.parent / "ckpts"
    for c in ok.glob("checkpoint-*"):
        shutil.copytree(c, ckpts / c.name, ignore=shutil.ignore_patterns("*.safetensors", "*.pt", "*.bin"))
    assert load_run(ckpts).series["loss"].steps[-1] == 60  # checkpoint-60, not checkpoint-20
    for path in (ok, ok / "trainer_state.json", _events_dir(ok), ckpts):
        assert _severe(path) == [], path


def test_hf_nan_is_seen_through_the_trainers_mask(hf_logs):
    """The Trainer logs the NaN loss as exactly 0 (logging_nan_inf_filter) beside a NaN grad_norm:
    both the state file and the TensorBoard run say the loss was masked and became NaN at step 31."""
    nan = hf_logs["nan"]
    state = json.loads((nan / "trainer_state.json").read_text())
    logged = {e["step"]: e for e in state["log_history"] if "loss" in e}
    assert logged[NAN_STEP_HF + 1]["loss"] == 0.0 and math.isnan(logged[NAN_STEP_HF + 1]["grad_norm"])  # the mask, for real
    for path, loss, grad in ((nan / "trainer_state.json", "loss", "grad_norm"), (_events_dir(nan), "train/loss", "train/grad_norm")):
        masked = _issues(path, "masked")
        assert masked and masked[0].startswith(f"{loss} hides non-finite values from step {NAN_STEP_HF + 1}: logged as exactly 0"), masked
        assert f"where {grad} is NaN/Inf" in masked[0]
        assert _issues(path, "nonfinite")[0] == f"{loss} became NaN at step {NAN_STEP_HF + 1}"


def test_hf_learning_rate_far_too_high_diverges(hf_logs):
    report = analyze([load_run(hf_logs["lr"])])
    errors = [f"{p}: {f.issue}" for p, f in report.findings("error")]
    assert any(e.startswith(("divergence: loss diverged", "nonfinite: loss became")) for e in errors), errors


def test_lightning_csv_and_tensorboard_logs(pl_logs):
    """metrics.csv (step/epoch columns, train and validation rows mixed) and the TensorBoardLogger's
    events: healthy quiet; NaN named at its step; lr far too high an error."""
    version = pl_logs["ok_csv"]
    rows = list(csv.DictReader(open(version / "metrics.csv")))
    assert {"epoch", "step", "train_loss", "val_loss"} <= set(rows[0])
    assert any(r["val_loss"] and not r["train_loss"] for r in rows)  # the validation rows stand alone
    run = load_run(version / "metrics.csv")
    assert run.format == "lightning_csv" and "epoch" not in run.series and len(run.series["val_loss"]) == 4
    for key in ("ok_csv", "ok_tb"):
        assert _severe(pl_logs[key]) == [], key
    for key in ("nan_csv", "nan_tb"):
        assert _issues(pl_logs[key], "nonfinite")[0] == f"train_loss became NaN at step {NAN_STEP_PL}", key
    errors = [f.issue for _, f in analyze([load_run(pl_logs["lr_csv"])]).findings("error")]
    assert any(e.startswith("train_loss became") for e in errors), errors


def _wandb_export(path: Path, run_name: str, series: dict[str, dict[int, float]], *, drop_nonfinite: bool) -> Path:
    """W&B's panel CSV export: Step, then RUN - METRIC with its __MIN/__MAX bucket range."""
    steps = sorted({s for values in series.values() for s in values})
    header = ["Step"] + [f"{run_name} - {m}{suffix}" for m in series for suffix in ("", "__MIN", "__MAX")]
    with open(path, "w", newline="") as fh:
        w = csv.writer(fh)
        w.writerow(header)
        for s in steps:
            row: list = [s]
            for values in series.values():
                v = values.get(s)
                cell = "" if v is None or (drop_nonfinite and not math.isfinite(v)) else ("NaN" if math.isnan(v) else repr(v))
                row += [cell, cell, cell]
            w.writerow(row)
    return path


def test_wandb_exports_of_real_runs(hf_logs, pl_logs, tmp_path):
    """What HF's WandbCallback and Lightning's WandbLogger would have sent, exported as W&B does:
    healthy quiet; the masked HF loss seen through with NaN kept, a jump to exactly 0 named when
    the export dropped the NaN grad_norm; Lightning's NaN loss dropped leaves a named gap."""
    def hf_series(out: Path) -> dict[str, dict[int, float]]:
        run = load_run(out / "trainer_state.json")
        return {f"train/{m}": dict(zip(run.series[m].steps, run.series[m].values, strict=True)) for m in ("loss", "grad_norm", "learning_rate")}

    ok = _wandb_export(tmp_path / "ok.csv", "bright-sun-1", hf_series(hf_logs["ok"]), drop_nonfinite=False)
    assert load_run(ok).format == "wandb_csv" and _severe(ok) == []
    kept = _wandb_export(tmp_path / "kept.csv", "dark-moon-2", hf_series(hf_logs["nan"]), drop_nonfinite=False)
    assert _issues(kept, "masked")[0].startswith(f"train/loss hides non-finite values from step {NAN_STEP_HF + 1}")
    dropped = _wandb_export(tmp_path / "dropped.csv", "dark-moon-2", hf_series(hf_logs["nan"]), drop_nonfinite=True)
    assert _issues(dropped, "masked")[0].startswith(f"train/loss drops to exactly 0 at step {NAN_STEP_HF + 1}")
    pl = load_run(pl_logs["nan_csv"])
    loss = dict(zip(pl.series["train_loss"].steps, pl.series["train_loss"].values, strict=True))
    gap = _wandb_export(tmp_path / "gap.csv", "calm-sky-3", {"train_loss": loss, "lr-SGD": dict.fromkeys(loss, 0.05)}, drop_nonfinite=True)
    assert f"train_loss is not logged after step {NAN_STEP_PL - 1} while lr-SGD goes on to step {max(loss)}" in _issues(gap, "masked")
