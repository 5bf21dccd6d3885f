"""The probes' consolidation gives the same findings and report content as before it was made
linear for 16k ranks (issue 21): golden results recorded from the code at 8896294 on synthetic
payloads (tests/unit/check_payloads.py: for env, gpu, collectives and bandwidth a healthy job, a
straggler, a bad link, a slow rank, a mismatched env, a sick GPU, wrong values, ragged timings;
for data_shards identical, overlapping and repeated data); the rest of the default suite's
probes (setup_sync, fsdp_plan, loss_parity, param_sync, determinism, sequence_parallel,
moe_routing, checkpoint: tests/unit/check_suite_payloads.py, a healthy job and a faulty twin
each, at 8 and 48 ranks) recorded from the code at 7a2ebeb, before their consolidation was made
linear; the bandwidth arithmetic against the
statistics module's median and fmean, and data_shards' overlap summary against every pair, on
random inputs.

    python -m tests.unit.test_check_equivalence --write   # re-record after an intended change
"""

from __future__ import annotations

import hashlib
import json
import random
import statistics
import sys
from pathlib import Path
from typing import Any

import pytest

from distdiag.probes import PROBES
from distdiag.probes.base import ConsolidationView
from distdiag.probes.cluster.bandwidth import BandwidthConfig, format_size, straggler_scores
from distdiag.probes.cluster.bandwidth_stats import bandwidth_rows
from distdiag.probes.data.fingerprint import overlap_summary, overlaps
from distdiag.report.model import ProbeResult
from tests.unit.check_payloads import DATA_SCENARIOS, SCENARIOS, SUITE_SCENARIOS, payloads, rank_infos
from tests.unit.check_suite_payloads import as_collected

GOLDEN = Path(__file__).with_name("check_golden.json")
WORLDS = (3, 48)
CLUSTER = ("env", "gpu", "collectives", "bandwidth")
CASES = {**{p: SCENARIOS for p in CLUSTER}, "data_shards": DATA_SCENARIOS, **SUITE_SCENARIOS}
SUITE_WORLDS = (8, 48)
"""The suite's payloads cycle what 4 real ranks posted: a healthy job has a multiple of 4 ranks."""


def _worlds(probe: str) -> tuple[int, ...]:
    return SUITE_WORLDS if probe in SUITE_SCENARIOS else WORLDS


def _digest(result: ProbeResult) -> dict[str, Any]:
    """Findings, metrics and status in full; each details table by its hash (they hold a row per rank)."""
    data = result.to_dict()
    details = data.pop("details")
    hashed = {k: hashlib.sha256(json.dumps(v, sort_keys=True).encode()).hexdigest()[:16] for k, v in details.items()}
    return {**data, "details": hashed}


def _consolidate(probe: str, world: int, scenario: str, collected: bool = False) -> ProbeResult:
    """One probe's result over its synthetic payloads: as built (every rank its own objects), or
    as the writer has them (`collected`: through the store, shared fields one object for the
    ranks that posted them alike) - then also checked to leave the payloads as they were."""
    cls = PROBES[probe]
    view = ConsolidationView(world, rank_infos(world), cls.Config() if cls.Config else None)
    made = payloads(probe, world, scenario)
    if not collected:
        return cls().consolidate(made, view)
    got = as_collected(cls(), list(PROBES).index(probe), made)
    before = json.dumps(got, sort_keys=True)
    result = cls().consolidate(got, view)
    assert json.dumps(got, sort_keys=True) == before, f"{probe}/{scenario}: consolidation changed a payload"
    return result


def _all_digests() -> dict[str, Any]:
    return {f"{p}/{s}/{w}": _digest(_consolidate(p, w, s)) for p, cases in CASES.items() for w in _worlds(p) for s in cases}


@pytest.mark.parametrize("probe", list(CASES))
def test_consolidation_matches_the_recorded_results(probe):
    """Every scenario at 3 and 48 ranks (8 and 48 for the suite's): the same findings, metrics and
    details as recorded, from the payloads as built and as the writer has them."""
    golden = json.loads(GOLDEN.read_text())
    for world in _worlds(probe):
        for scenario in CASES[probe]:
            key = f"{probe}/{scenario}/{world}"
            assert _digest(_consolidate(probe, world, scenario)) == golden[key], key
            assert _digest(_consolidate(probe, world, scenario, collected=True)) == golden[key], f"{key}, as collected"


def test_the_healthy_twin_is_silent_and_each_fault_is_named():
    """Healthy: no finding from any probe; each fault names its ranks."""
    for probe in CLUSTER:
        assert _consolidate(probe, 48, "healthy").findings == [], probe
    named = {
        ("bandwidth", "straggler"): [[13]],
        ("bandwidth", "bad_link"): [[20, 21]],
        ("bandwidth", "slow_rank"): [[30]],
        ("collectives", "wrong_values"): [[6, 7]],
    }
    for (probe, scenario), ranks in named.items():
        assert [f.ranks for f in _consolidate(probe, 48, scenario).findings] == ranks, (probe, scenario)
    env = _consolidate("env", 48, "env_mismatch").findings
    assert [5] in [f.ranks for f in env] and [16, 17] in [f.ranks for f in env] and len(env) == 6
    gpu = _consolidate("gpu", 48, "gpu_sick").findings
    assert {r for f in gpu for r in f.ranks} == {3, 9, 10, 11, 20, 30}
    assert [f.severity for f in _consolidate("data_shards", 48, "healthy").findings] == ["info"]
    overlapping = _consolidate("data_shards", 48, "overlapping").findings
    assert overlapping[0].cause == "overlapping_data" and overlapping[0].ranks == list(range(48))


SUITE_NAMED = {
    "setup_sync": [[5]], "fsdp_plan": [[4, 5, 6, 7]], "loss_parity": [list(range(48))], "param_sync": [[5]],
    "determinism": [[4], [7]], "sequence_parallel": [[2]], "moe_routing": [list(range(48))], "checkpoint": [[4]],
}
"""The ranks each faulty twin's findings name (a divergence from the reference, tokens lost
between two ranks: the whole job)."""


def test_the_suites_healthy_twins_are_quiet_and_each_fault_is_named():
    """The rest of the default suite at 48 ranks: healthy, nothing above info; each fault, its ranks."""
    for probe, (healthy, fault) in SUITE_SCENARIOS.items():
        assert [f for f in _consolidate(probe, 48, healthy).findings if f.severity != "info"] == [], probe
        named = [f.ranks for f in _consolidate(probe, 48, fault).findings if f.severity != "info"]
        assert named == SUITE_NAMED[probe], probe


def test_overlap_summary_equals_every_pair_compared():
    """Random row hashes, identical groups among them: the same ranks, worst share and first pairs."""
    rng = random.Random(22)
    for _ in range(300):
        world = rng.choice([2, 3, 5, 8, 13])
        pool = rng.choice([6, 12, 40])
        seqs = {r: [[f"{rng.randrange(pool):x}" for _ in range(rng.choice([0, 2, 3]))] for _ in range(2)] for r in range(world)}
        groups: list[list[int]] = []
        for r in range(world):
            if rng.random() < 0.3 and r > 0:  # r joins r-1's data: an identical group
                seqs[r] = seqs[r - 1]
                if groups and groups[-1][-1] == r - 1:
                    groups[-1].append(r)
                else:
                    groups.append([r - 1, r])
        above = rng.choice([0.0, 0.25, 0.5])
        bad = [p for p in overlaps(seqs, groups) if p[2] > above]
        got = overlap_summary(seqs, groups, above, 8)
        assert got.ranks == sorted({r for a, b, _, _ in bad for r in (a, b)})
        assert got.worst == max((p[2] for p in bad), default=0.0)
        assert got.first == bad[:8]


# -- the bandwidth arithmetic against the statistics module (the code before issue 21) ---------
def _reference_scores(payloads_: dict[int, dict[str, Any]]) -> dict[int, dict[str, Any]]:
    by_key: dict[tuple[str, int], dict[int, dict[str, Any]]] = {}
    for rank, payload in payloads_.items():
        for s in payload["samples"]:
            by_key.setdefault((s["op"], s["size"]), {})[rank] = s
    per_rank: dict[int, list[tuple[float, float, str]]] = {r: [] for r in payloads_}
    for (op, size), samples in by_key.items():
        if len(samples) < 2:
            continue
        incalls = sorted(s["incall_s"] for s in samples.values())
        reference = incalls[len(incalls) // 2]
        iteration = statistics.median(s["total_s"] / s["iters"] for s in samples.values())
        for rank, s in samples.items():
            late = max(0.0, reference - s["incall_s"])
            per_rank[rank].append((late / iteration if iteration > 0 else 0.0, late, f"{op} {format_size(size)}"))
    out = {}
    for rank, items in per_rank.items():
        if items:
            worst = max(items)
            out[rank] = {"score": statistics.median(i[0] for i in items), "late_s": statistics.median(i[1] for i in items),
                         "samples": len(items), "worst": f"{worst[2]} (score {worst[0]:.2f}, {worst[1] * 1e3:.2f} ms late)"}
    return out


def _reference_times(payloads_: dict[int, dict[str, Any]]) -> list[tuple[float, float]]:
    by_key: dict[tuple[str, int], list[dict[str, Any]]] = {}
    for _rank, payload in sorted(payloads_.items()):
        for s in payload["samples"]:
            by_key.setdefault((s["op"], s["size"]), []).append(s)
    out = []
    for samples in by_key.values():
        totals = [s.get("totals_s") or [s["total_s"]] for s in samples]
        loops = min(len(t) for t in totals)
        times = sorted(statistics.fmean(t[j] / s["iters"] for t, s in zip(totals, samples, strict=True)) for j in range(loops))
        t = statistics.median(times)
        out.append((round(t * 1e6, 1), round((times[-1] - times[0]) / t * 100, 1) if t else None))
    return out


def _random_payloads(rng: random.Random, world: int) -> dict[int, dict[str, Any]]:
    """Timings with ties, zeros, even and odd counts, ranks missing some timings, one-loop payloads."""
    out = {}
    for r in range(world):
        samples = []
        for op in ("all_reduce", "broadcast"):
            for size in (4096, 65536, 2**20):
                if rng.random() < 0.15:
                    continue
                incall = rng.choice([0.0, 0.001, 0.002, round(rng.random() * 0.003, 6)])
                sample = {"op": op, "size": size, "bytes": size, "iters": rng.choice([4, 8]),
                          "total_s": rng.choice([0.0, 0.01, rng.random() * 0.02]), "incall_s": incall}
                if rng.random() < 0.8:
                    sample["totals_s"] = [rng.random() * 0.02 for _ in range(rng.choice([1, 2, 3]))]
                samples.append(sample)
        out[r] = {"samples": samples, "links": [], "gpu": False}
    return out


def test_bandwidth_arithmetic_equals_the_statistics_module():
    """Straggler scores and row times equal statistics.median / fmean exactly, ragged or not."""
    rng = random.Random(21)
    for trial in range(200):
        world = rng.choice([2, 3, 4, 7, 16])
        data = _random_payloads(rng, world)
        if trial % 3 == 0:  # regular: every rank has every timing
            data = {r: {**p, "samples": data[0]["samples"]} for r, p in data.items()}
        assert straggler_scores(data) == _reference_scores(data)
        reference = _reference_times(data)
        if all(t for t, _ in reference):  # a zero time has no bandwidth (a ZeroDivisionError before and after)
            rows, _ = bandwidth_rows(data, world, BandwidthConfig())
            assert [(row["time_us"], row["spread_pct"]) for row in rows] == reference


if __name__ == "__main__" and "--write" in sys.argv:
    GOLDEN.write_text(json.dumps(_all_digests(), indent=1, sort_keys=True))
    print(f"wrote {GOLDEN}")


def test_group_values_equals_group_ranks():
    """Values taken up front, one group at once when all are equal: the same groups, in order."""
    from distdiag.probes.base import group_ranks, group_values

    rng = random.Random(23)
    for _ in range(300):
        ranks = sorted(rng.sample(range(40), rng.randrange(1, 12)))
        pool = rng.choice([["a"], ["a", "b"], [1, 1.0, True, 2], ["x", "y", "z"]])
        value = {r: rng.choice(pool) for r in ranks}
        got = group_values(ranks, [value[r] for r in ranks])
        want = group_ranks(ranks, value.__getitem__)
        assert got == want and list(got) == list(want) and [type(k) for k in got] == [type(k) for k in want]


# -- sequence_parallel's split walk against the walk by token (the code before issue 21) ---------
class _ReferenceWalk:
    """distdiag/probes/sequence_parallel/checks.py's _SplitWalk at 7a2ebeb: every token walked."""

    def __init__(self, full: dict[str, Any], local: dict[int, dict[str, Any]]) -> None:
        self.ids, self.labels = full["input_ids"], full["labels"]
        self.batch, self.seq = len(self.ids), len(self.ids[0])
        self.mask = full.get("attention_mask")
        full_pos = full.get("position_ids") or [list(range(self.seq)) for _ in range(self.batch)]
        self.where_pos = {b: {p: i for i, p in enumerate(full_pos[b])} for b in range(self.batch)}
        self.owners: dict[tuple[int, int], list[int]] = {}
        self.token_bad: dict[int, list[str]] = {}
        self.target_bad: dict[int, list[str]] = {}
        self.boundary_lost: dict[int, list[int]] = {}
        self.mask_bad: dict[int, list[int]] = {}
        self.restart: list[int] = []
        self.no_shift = [r for r in sorted(local) if local[r].get("shift_labels") is None]
        self.no_pos = [r for r in sorted(local) if local[r].get("position_ids") is None]
        offset = 0
        for r in sorted(local):
            loc = local[r]
            lids = loc["input_ids"]
            width = len(lids[0]) if lids else 0
            pos = loc.get("position_ids") or [list(range(offset, offset + width)) for _ in range(self.batch)]
            if r > 0 and loc.get("position_ids") is not None and width and all(row and row[0] == 0 for row in pos):
                self.restart.append(r)
            if loc.get("shift_labels") is not None:
                tgts = loc["shift_labels"]
            else:
                lab = loc.get("labels") or [[-100] * width for _ in range(self.batch)]
                tgts = [row[1:] + [-100] for row in lab]
            for b in range(self.batch):
                for i in range(width):
                    self._token(r, loc, b, i, pos[b][i], tgts, width)
            offset += width

    def _token(self, r, loc, b, i, p, tgts, width) -> None:
        j = self.where_pos[b].get(p)
        if j is None:
            self.token_bad.setdefault(r, []).append(f"sample {b} index {i}: position {p} is outside 0..{self.seq - 1}")
            return
        self.owners.setdefault((b, j), []).append(r)
        if loc["input_ids"][b][i] != self.ids[b][j]:
            self.token_bad.setdefault(r, []).append(f"position {p} (sample {b}): token {loc['input_ids'][b][i]}, expected {self.ids[b][j]}")
        want = self.labels[b][j + 1] if j + 1 < self.seq else -100
        got = tgts[b][i]
        if got != want:
            if got == -100 and i == width - 1:
                self.boundary_lost.setdefault(r, []).append(p)
            else:
                self.target_bad.setdefault(r, []).append(f"position {p} (sample {b}): target {got}, expected {want}")
        if self.mask is not None:
            lmask = loc.get("attention_mask")
            if lmask is None or lmask[b][i] != self.mask[b][j]:
                self.mask_bad.setdefault(r, []).append(p)

    def missing(self):
        return [(b, j) for b in range(self.batch) for j in range(self.seq) if (b, j) not in self.owners]

    def duplicated(self):
        return {k: v for k, v in self.owners.items() if len(v) > 1}


def _random_split(rng: random.Random) -> tuple[dict[str, Any], dict[int, dict[str, Any]], int]:
    """A full batch and every rank's split of it (contiguous or zigzag), with faults mixed in."""
    world, rows, seq = rng.choice([2, 3, 4]), rng.choice([1, 2]), rng.choice([6, 8, 9, 12])
    ids = [[rng.randrange(20) for _ in range(seq)] for _ in range(rows)]
    labels = [[t if rng.random() > 0.2 else -100 for t in row] for row in ids]
    mask = [[int(t != -100) for t in row] for row in labels] if rng.random() < 0.7 else None
    full = {"input_ids": ids, "labels": labels, "position_ids": None, "attention_mask": mask}
    if rng.random() < 0.2:  # the batch carries its own positions (packed sequences)
        full["position_ids"] = [rng.sample(range(seq), seq) for _ in range(rows)]
    targets = [row[1:] + [-100] for row in labels]
    local, victim, contiguous = {}, rng.randrange(world) if rng.random() < 0.6 else None, rng.random() < 0.5
    for r in range(world):
        if contiguous:
            q, m = divmod(seq, world)
            index = list(range(r * q + min(r, m), (r + 1) * q + min(r + 1, m)))
        else:
            chunks = [list(range(seq))[i::2 * world] for i in (r, 2 * world - 1 - r)]
            index = sorted(chunks[0] + chunks[1])
        pos_of = full["position_ids"] or [list(range(seq))] * rows
        loc = {"input_ids": [[row[i] for i in index] for row in ids],
               "shift_labels": [[row[i] for i in index] for row in targets],
               "labels": None, "position_ids": [[pos_of[b][i] for i in index] for b in range(rows)],
               "attention_mask": [[row[i] for i in index] for row in mask] if mask else None}
        if r == victim:
            _break(rng, loc, index, seq)
        local[r] = loc
    return full, local, world


def _break(rng: random.Random, loc: dict[str, Any], index: list[int], seq: int) -> None:
    """Sometimes one fault of a split: a lost, wrong or duplicated token, a target, the mask, the positions."""
    if not index:
        return
    fault, b, i = rng.randrange(9), 0, rng.randrange(len(index))
    if fault == 0:
        loc["input_ids"][b][i] += 1
    elif fault == 1:
        loc["shift_labels"][b][-1] = -100
    elif fault == 2:
        loc["shift_labels"], loc["labels"] = None, [list(row) for row in loc["input_ids"]]
    elif fault == 3 and loc["attention_mask"]:
        loc["attention_mask"][b][i] ^= 1
    elif fault == 4:
        loc["attention_mask"] = None
    elif fault == 5:
        loc["position_ids"] = None
    elif fault == 6:
        loc["position_ids"] = [list(range(len(row))) for row in loc["position_ids"]]
    elif fault == 7:
        loc["position_ids"][b][i] = seq + 3
    else:
        for key in ("input_ids", "shift_labels", "position_ids"):
            loc[key] = [row[:-1] for row in loc[key]] if rng.random() < 0.5 else [row + row[:1] for row in loc[key]]
        if loc["attention_mask"]:
            loc["attention_mask"] = [row[: len(loc["input_ids"][0])] + [1] * max(0, len(loc["input_ids"][0]) - len(row)) for row in loc["attention_mask"]]


def test_the_split_walk_by_rows_equals_the_walk_by_token(monkeypatch):
    """Random splits, healthy and broken: the same findings as the walk that checked every token."""
    from distdiag.probes.sequence_parallel import checks

    def outcome() -> Any:  # the findings, or what the walk raised (a ragged shard: consolidation reports it)
        try:
            return checks.analyze_split("x", full, local, world)
        except Exception as exc:  # noqa: BLE001
            return f"{type(exc).__name__}: {exc}"

    rng = random.Random(24)
    raised = 0
    for _ in range(800):
        full, local, world = _random_split(rng)
        got = outcome()
        with monkeypatch.context() as m:
            m.setattr(checks, "_SplitWalk", _ReferenceWalk)
            want = outcome()
        assert got == want
        raised += isinstance(want, str)
    assert 0 < raised < 400


def test_grouping_alike_objects_equals_group_values():
    """Values shared as objects by some ranks (as collected) and equal values in other objects:
    alike + group_alike give group_values' groups, in its order."""
    from distdiag.probes.base import alike, group_alike, group_values

    rng = random.Random(25)
    for _ in range(300):
        ranks = sorted(rng.sample(range(40), rng.randrange(1, 14)))
        objects = [{"v": rng.choice("abc")} for _ in range(rng.randrange(1, 5))]
        held = {r: rng.choice(objects) if rng.random() < 0.7 else {"v": rng.choice("abc")} for r in ranks}
        classes = alike(ranks, [held[r] for r in ranks])
        assert sorted(r for _, rs in classes for r in rs) == ranks
        assert all(held[r] is obj for obj, rs in classes for r in rs)
        got = group_alike([(obj["v"], rs) for obj, rs in classes])
        want = group_values(ranks, [held[r]["v"] for r in ranks])
        assert got == want and list(got) == list(want)


def test_param_sync_without_the_shards_one_rank_holds_gives_the_recorded_results():
    """Since issue 21 a rank does not post the sums of its plain-FSDP shards (keys no other rank
    holds, never compared: 8.8 KB of its 9 KB; the recorded results were made with them): the
    results are the recorded ones, healthy and drifting, at 8 and 48 ranks, and every dropped
    key was held by one rank only."""
    from tests.unit.check_suite_payloads import param_sync

    golden = json.loads(GOLDEN.read_text())
    cls = PROBES["param_sync"]
    for world in SUITE_WORLDS:
        for scenario in SUITE_SCENARIOS["param_sync"]:
            full, posted = param_sync(world, scenario, unique=True), param_sync(world, scenario)
            dropped = [k for r in full for k in full[r]["snaps"][0]["sums"] if k not in posted[r]["snaps"][0]["sums"]]
            assert dropped and len(set(dropped)) == len(dropped)
            view = ConsolidationView(world, rank_infos(world), cls.Config())
            assert _digest(cls().consolidate(posted, view)) == golden[f"param_sync/{scenario}/{world}"], (scenario, world)
