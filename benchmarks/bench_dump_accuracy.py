"""Who `distdiag hang-report DIR` blames on every flight-recorder dump set the project has, side by
side with torch's own analyzer (fr_trace) on the same files.

    python benchmarks/bench_dump_accuracy.py [--acceptance ../shared/acceptance] [--no-gloo]

Dump sets, each with its known culprits:
- the real NCCL incidents under ACCEPTANCE/nccl_dumps (16 ranks, two faulted; truth in each
  folder's fault_injection.log), read as shipped (with their text files);
- the 4-rank gloo job torch writes dumps of (tests/faults/dump_workers.py): rank 3 stalled, and
  its healthy twin (run here for real, about 15 s each);
- the dump-version fixtures (tests/unit/fr_fixtures), one rank behind;
- the synthetic NCCL-shaped cases of tests/unit/test_dump_semantics.py, one semantic each.

For distdiag, "named" is every rank in a critical/error finding. For fr_trace, "named" is every
rank it lists as missing from a collective (it has no other verdict), "top" the rank it lists most
often; fr_trace reads pickles only, so JSON dumps are handed to it as pickles of the same content.
"""

from __future__ import annotations

import argparse
import json
import pickle
import re
import subprocess
import sys
import tempfile
from collections import Counter
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

SYNTHETIC = [
    # test function of tests/unit/test_dump_semantics.py, truth
    ("test_a_matched_batched_transfer_in_flight_is_no_deadlock", [3]),
    ("test_p2p_seq_ids_are_never_compared_across_ranks", [2]),
    ("test_an_uneven_all_to_all_with_one_rank_missing_blames_the_missing_rank", [3]),
    ("test_stale_discovery_is_the_gpu_error_signature", [1]),
    ("test_coalesced_per_op_entries_take_the_closing_state", [1]),
    ("test_an_op_seconds_old_at_dump_time_is_in_flight", []),
    ("test_a_rank_without_a_dump_is_the_end_of_the_chains", [2]),
]


def distdiag_named(folder: Path) -> tuple[list[int], str]:
    out = subprocess.run([sys.executable, "-m", "distdiag", "hang-report", str(folder), "--format", "json"],
                         capture_output=True, text=True, timeout=300, cwd=ROOT)
    if not out.stdout.startswith("{"):
        return [], f"refused: {out.stderr.strip()[-120:]}"
    findings = json.loads(out.stdout)["probes"][0]["findings"]
    named = sorted({r for f in findings if f["severity"] in ("critical", "error") for r in f.get("ranks", [])})
    lead = next((f.get("cause", "") for f in findings if f["severity"] in ("critical", "error")), "")
    return named, lead


def _as_pickles(folder: Path, into: Path) -> Path:
    """The folder's dumps as torch's pickles (fr_trace reads nothing else), other files left out."""
    into.mkdir(parents=True, exist_ok=True)
    for f in sorted(p for p in folder.rglob("*") if p.is_file()):
        data = f.read_bytes()
        if data[:1] == b"\x80":
            (into / f.name).write_bytes(data)
        elif data[:1] == b"{":
            dump = json.loads(data)
            for e in dump.get("entries", []):
                e["process_group"] = tuple(e.get("process_group", ()))
            (into / f.name.removesuffix(".json")).write_bytes(pickle.dumps(dump))
    return into


def fr_trace_named(folder: Path, tmp: Path) -> tuple[list[int], list[int], str]:
    """(ranks fr_trace lists as missing, the most-listed ones, how it ended)."""
    pickles = _as_pickles(folder, tmp / "fr")
    cmd = [sys.executable, "-m", "torch.distributed.flight_recorder.fr_trace", str(pickles), "--allow-incomplete-ranks"]
    out = subprocess.run(cmd, capture_output=True, text=True, timeout=300)
    text = out.stdout + out.stderr
    if out.returncode != 0:
        last = [line for line in text.strip().splitlines() if line.strip()][-1:]
        return [], [], f"crashed: {last[0][:100] if last else out.returncode}"
    cited: Counter[int] = Counter()
    for found in re.findall(r"missing ranks: \{([^}]*)\}", text):
        cited.update(int(x) for x in re.findall(r"\d+", found))
    top = max(cited.values(), default=0)
    return sorted(cited), sorted(r for r, n in cited.items() if n == top), "ok"


def _gloo_sets(tmp: Path) -> list[tuple[str, Path, list[int]]]:
    from tests.harness import run_ranks

    out = []
    for fault, truth in (("stall", [3]), ("none", [])):
        work = tmp / f"gloo-{fault}"
        work.mkdir()
        run_ranks(4, [f"fault={fault}", "rank=3"], work, entry="tests.faults.dump_workers:job",
                  env={"TORCH_FR_BUFFER_SIZE": "2000"}, timeout=90)
        name = "gloo 4 ranks (torch's own dumps), rank 3 stalled" if truth else "gloo 4 ranks, healthy twin"
        out.append((name + ", pickle", work / "pickle", truth))
        out.append((name + ", JSON", work / "json", truth))
    return out


def _fixture_sets(tmp: Path) -> list[tuple[str, Path, list[int]]]:
    out = []
    for f in sorted((ROOT / "tests/unit/fr_fixtures").glob("v*.json")):
        dumps = json.loads(f.read_text())["dumps"]
        folder = tmp / f.stem
        folder.mkdir()
        for rank, dump in dumps.items():
            (folder / f"nccl_trace_rank_{rank}").write_text(json.dumps(dump))
        truth = [3] if "multigroup" in f.stem else [1]
        out.append((f"fixture {f.stem} (NCCL-shaped, {len(dumps)} ranks)", folder, truth))
    return out


def _synthetic_sets(tmp: Path) -> list[tuple[str, Path, list[int]]]:
    import tests.unit.test_dump_semantics as cases

    out = []
    for name, truth in SYNTHETIC:
        folder = tmp / name
        getattr(cases, name)(folder)  # writes the dumps (and checks distdiag's verdict on them)
        out.append((f"synthetic: {name.removeprefix('test_').replace('_', ' ')}", folder, truth))
    return out


def _real_sets(acceptance: Path) -> list[tuple[str, Path, list[int]]]:
    out = []
    for folder in sorted((acceptance / "nccl_dumps").iterdir()):
        log = folder / "fault_injection.log"
        if log.is_file():
            truth = json.loads(re.search(r"Fault ranks: (\[.*\])", log.read_text()).group(1))  # type: ignore[union-attr]
            out.append((f"real NCCL, 16 ranks: {folder.name}", folder, sorted(truth)))
    return out


def _row(name: str, folder: Path, truth: list[int], tmp: Path) -> str:
    named, lead = distdiag_named(folder)
    fr, top, how = fr_trace_named(folder, tmp)
    false_dd = sorted(set(named) - set(truth))
    false_fr = sorted(set(fr) - set(truth))
    fr_text = how if how != "ok" else f"{fr or '-'} (false {false_fr or '-'}; most listed {top or '-'})"
    return f"| {name} | {truth or '-'} | {named or '-'} ({lead or 'no verdict'}) | {false_dd or '-'} | {fr_text} |"


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    near = [ROOT.parent / "shared" / "acceptance", ROOT.parent.parent / "shared" / "acceptance"]
    p.add_argument("--acceptance", type=Path, default=next((d for d in near if d.is_dir()), near[0]))
    p.add_argument("--no-gloo", action="store_true", help="skip the 4-rank gloo runs")
    args = p.parse_args()
    with tempfile.TemporaryDirectory() as t:
        tmp = Path(t)
        sets = _real_sets(args.acceptance) if (args.acceptance / "nccl_dumps").is_dir() else []
        sets += [] if args.no_gloo else _gloo_sets(tmp)
        sets += _fixture_sets(tmp) + _synthetic_sets(tmp)
        print("| dump set | faulted | distdiag names (lead cause) | distdiag false blames | fr_trace lists as missing |")
        print("|---|---|---|---|---|")
        for i, (name, folder, truth) in enumerate(sets):
            print(_row(name, folder, truth, tmp / f"run{i}"), flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
