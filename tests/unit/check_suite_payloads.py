"""Per-rank payloads of the default suite's probes beyond the cluster ones (setup_sync,
fsdp_plan, loss_parity, param_sync, determinism, sequence_parallel, moe_routing, checkpoint) at
any world size: a healthy job and one faulty twin each, deterministic for a given world size.

check_suite_templates.json holds what the real probes posted on 4 ranks (torchrun
--nproc-per-node 4 -m distdiag.check, the built-in workloads); each builder scales it the way
the probe's payload scales with the world, every rank getting its own parsed copy (as the
writer has them, read from the store):
- setup_sync, fsdp_plan, checkpoint, determinism: alike on every rank (the mesh's size in
  fsdp_plan's rows; checkpoint's `removed` on rank 0 only; determinism's losses per rank);
- loss_parity, param_sync: rank r posts what rank r % 4 did (its own losses, gradient shares
  scaled to the world, its shard's sums under its own `[shard dp=r]` keys) - a model big
  enough that every rank holds a shard;
- sequence_parallel: the built-in batch of that world's length (nominal_length, make_lm_batch),
  each rank's contiguous and zigzag split as the probe takes it, the full batch on rank 0;
- moe_routing: 2 x world experts, each rank routing 64 tokens to 2 of them, its sent and
  received counts per rank and its all_to_all calls over the whole world (world-sized lists:
  the payload grows with the world, the whole job's with its square).
"""

from __future__ import annotations

import json
import random
from functools import cache
from pathlib import Path
from typing import Any

TEMPLATES = Path(__file__).with_name("check_suite_templates.json")
CAPTURED = 4
"""The world size the templates were captured at."""
SUITE_SCENARIOS = {
    "setup_sync": ("healthy", "drift"), "fsdp_plan": ("healthy", "imbalance"), "loss_parity": ("healthy", "loss_off"),
    "param_sync": ("healthy", "drift"), "determinism": ("healthy", "nondeterministic"),
    "sequence_parallel": ("healthy", "restart"), "moe_routing": ("healthy", "lost_tokens"),
    "checkpoint": ("healthy", "unequal"),
}
"""Each probe's scenarios: the healthy job and its faulty twin (ranks named below)."""


@cache
def _texts() -> dict[str, str]:
    """Each template's JSON text: parsed anew for every rank."""
    data = json.loads(TEMPLATES.read_text())
    out = {k: json.dumps(v) for k, v in data.items() if not k.startswith("_")}
    for probe in ("loss_parity", "param_sync"):
        out.update({f"{probe}/{r}": json.dumps(p) for r, p in enumerate(data[probe])})
    return out


def _which(world: int, ranks: Any) -> Any:
    """The ranks to build: `ranks` (a client of the scale benchmark plays some), else every rank."""
    return range(world) if ranks is None else ranks


def _copy(name: str) -> Any:
    return json.loads(_texts()[name])


def setup_sync(world: int, scenario: str, ranks: Any = None) -> dict[int, dict[str, Any]]:
    """Every rank built the same model; `drift`: rank 5's qkv weight of layer 0 differs."""
    out = {r: _copy("setup_sync") for r in _which(world, ranks)}
    if scenario == "drift" and 5 in out:
        digest = out[5]["digests"]["layers.0.qkv.weight"]
        digest.update(bits="0badc0de" + digest["bits"][8:], sum=digest["sum"] + 0.25)
    return out


def fsdp_plan(world: int, scenario: str, ranks: Any = None) -> dict[int, dict[str, Any]]:
    """Every parameter sharded over all `world` ranks; `imbalance`: ranks 4-7 hold 8x their share."""
    text = _texts()["fsdp_plan"].replace(f'"mesh": "({CAPTURED},) ', f'"mesh": "({world},) ')
    text = text.replace(f'"mesh_size": {CAPTURED},', f'"mesh_size": {world},')
    out = {r: json.loads(text) for r in _which(world, ranks)}
    if scenario == "imbalance":
        for r in [r for r in range(4, 8) if r in out]:
            for row in out[r]["rows"]:
                row.update(local_numel=row["local_numel"] * 8, local_bytes=row["local_bytes"] * 8)
    return out


def loss_parity(world: int, scenario: str, ranks: Any = None) -> dict[int, dict[str, Any]]:
    """Rank r's losses and gradient share those of captured rank r % 4 (the shares scaled so
    that they still add up to the reference's norm); `loss_off`: rank 6's second loss is off."""
    out = {}
    for r in _which(world, ranks):
        p = _copy(f"loss_parity/{r % CAPTURED}")
        for step in p["steps"]:
            step["grad_sq_share"] *= CAPTURED / world
        out[r] = p
    if scenario == "loss_off" and 6 in out:
        out[6]["steps"][1]["loss"] += 2.0
    return out


def param_sync(world: int, scenario: str, ranks: Any = None, unique: bool = False) -> dict[int, dict[str, Any]]:
    """Each rank's snapshots as the probe posts them since issue 21 (distdiag.probes.numerics.
    param_sync.comparable: its buffer's sums like every rank's; no sums of the shards only it
    holds); `unique=True`: as captured before, with its shard sums under its own `[shard dp=r]`
    keys. `drift`: rank 5's buffer differs from the second snapshot on."""
    from distdiag.probes.numerics.param_sync import comparable

    out = {}
    for r in _which(world, ranks):
        k = r % CAPTURED
        out[r] = json.loads(_texts()[f"param_sync/{k}"].replace(f"[shard dp={k}]", f"[shard dp={r}]"))
        if not unique:
            out[r]["snaps"] = [comparable(snap) for snap in out[r]["snaps"]]
    if scenario == "drift" and 5 in out:
        for snap in out[5]["snaps"][1:]:
            kind, bits, total = snap["sums"]["buffer scale"]
            snap["sums"]["buffer scale"] = [kind, "0badc0de" + bits[8:], total + 1.0]
    return out


def determinism(world: int, scenario: str, ranks: Any = None) -> dict[int, dict[str, Any]]:
    """Each rank's loss twice alike (captured rank r % 4's); `nondeterministic`: rank 4's parallel
    step is not repeatable, rank 7's reference loss differs from every other rank's."""
    losses = json.loads(_texts()["determinism_losses"])
    out = {}
    for r in _which(world, ranks):
        p = _copy("determinism")
        p["par_losses"] = [losses[r % CAPTURED]] * 2
        out[r] = p
    if scenario == "nondeterministic" and 4 in out:
        out[4]["par_losses"][1] += 1e-3
        out[4]["par_diff"] = ["loss", "grad layers.0.qkv.weight"]
    if scenario == "nondeterministic" and 7 in out:
        out[7]["ref"]["loss"] = float.hex(float.fromhex(out[7]["ref"]["loss"]) + 1e-6)  # its reference step's bits differ
    return out


def checkpoint(world: int, scenario: str, ranks: Any = None) -> dict[int, dict[str, Any]]:
    """A round trip that gave every key back (rank 0 removed the directory); `unequal`: rank 4
    read one tensor back different."""
    out = {}
    for r in _which(world, ranks):
        p = _copy("checkpoint")
        if r:
            del p["removed"]
        out[r] = p
    if scenario == "unequal" and 4 in out:
        out[4]["unequal"] = ["model.layers.0.weight"]
    return out


def _chunk(length: int, parts: int, i: int) -> range:
    """torch.tensor_split(arange(length), parts)[i] (distdiag/workloads/sequence.py's splits)."""
    q, m = divmod(length, parts)
    start = i * q + min(i, m)
    return range(start, start + q + (i < m))


def _split_index(splitter: str, length: int, rank: int, world: int) -> list[int]:
    if splitter == "built-in contiguous":
        return list(_chunk(length, world, rank))
    return [*_chunk(length, 2 * world, rank), *_chunk(length, 2 * world, 2 * world - 1 - rank)]


@cache
def _sp_batches(world: int) -> tuple[tuple[str, dict[str, Any]], ...]:
    """The built-in batch of this world's length and its one-longer variant, as lists (with
    each position's target, shifted before the split), built by the probe's own functions."""
    from distdiag.probes.sequence_parallel.probe import _lists, _one_longer, _rows, nominal_length
    from distdiag.workloads import sequence as seqw

    seq = nominal_length(32, world)
    batch = seqw.make_lm_batch(2, seq, 64, pad=seq // (2 * world) + 1, seed=0)
    out = []
    for variant, b in (("batch", batch), ("seq+1", _one_longer(batch))):
        full = {k: _lists(_rows(b.get(k))) for k in ("input_ids", "labels", "position_ids", "attention_mask")}
        full["shift_labels"] = _lists(seqw.shift_labels(b["labels"]))
        out.append((variant, full))
    return tuple(out)


def _sp_split(splitter: str, variant: str, full: dict[str, Any], rank: int, world: int) -> dict[str, Any]:
    length = len(full["input_ids"][0])
    index = _split_index(splitter, length, rank, world)
    local = {k: [[row[i] for i in index] for row in full[k]] for k in ("input_ids", "shift_labels")}
    local["labels"] = None
    local["position_ids"] = [list(index) for _ in full["input_ids"]]
    local["attention_mask"] = [[row[i] for i in index] for row in full["attention_mask"]]
    entry = {"splitter": splitter, "variant": variant, "seq_len": length, "origin": "the built-in batch",
             "local": local, "problem": None}
    if rank == 0:
        entry["full"] = {k: full[k] for k in ("input_ids", "labels", "position_ids", "attention_mask")}
    return entry


def sequence_parallel(world: int, scenario: str, ranks: Any = None) -> dict[int, dict[str, Any]]:
    """Each rank's split of the built-in batch (the full batch on rank 0), Ulysses and the
    end-to-end step as captured rank r % 4's; `restart`: rank 2's contiguous positions restart at 0."""
    batches = _sp_batches(world)
    templ = _copy("sequence_parallel")
    out = {}
    for r in _which(world, ranks):
        splits = [_sp_split(s, v, full, r, world) for s in ("built-in contiguous", "built-in zigzag") for v, full in batches]
        out[r] = {"findings": [], "splits": splits, "ulysses": dict(templ["ulysses"]),
                  "e2e": json.loads(json.dumps(templ["e2e"][r % CAPTURED]))}
    if scenario == "restart" and 2 in out:
        local = out[2]["splits"][0]["local"]
        local["position_ids"] = [list(range(len(row))) for row in local["position_ids"]]
    return out


def moe_routing(world: int, scenario: str, ranks: Any = None, ep: int | None = None) -> dict[int, dict[str, Any]]:
    """The built-in router (the same on every rank) and expert-parallel layer over 2 x ep
    experts in groups of `ep` consecutive ranks (None: the whole world, one group, as the
    payloads recorded for the equivalence test); `lost_tokens`: rank 5 received one token fewer
    from rank 3 (its group's 4th member, or rank 3 when 3 is not in its group) than was sent."""
    ep = ep or world
    experts, tokens, k = 2 * ep, 64, 2
    templ = _copy("moe_routing")
    rng = random.Random(11)
    templ["router"].update(indices=[rng.sample(range(experts), k) for _ in range(tokens)], num_experts=experts)
    capacity = -(-tokens * k * 2 // experts)
    sent, per_expert = {}, {}
    for r in range(world):
        rng = random.Random(100 + r)
        chosen = [e for _ in range(tokens) for e in rng.sample(range(experts), k)]
        counts = [0] * experts
        for e in chosen:
            counts[e] += 1
        per_expert[r] = counts
        sent[r] = [min(counts[2 * j], capacity) + min(counts[2 * j + 1], capacity) for j in range(ep)]
    rows = [capacity * 2] * ep
    out = {}
    for r in _which(world, ranks):
        start = r - r % ep
        group = list(range(start, start + ep))
        calls = [{"call": c, "group": group, "send": rows, "recv": rows, "mismatch": []} for c in range(1, 5)]
        stats = {"capacity": capacity, "sent_valid": sent[r], "recv_valid": [sent[j][r - start] for j in group],
                 "assignments": tokens * k, "dropped": tokens * k - sum(sent[r]), "tokens_per_expert": per_expert[r],
                 "round_trip_ok": True}
        builtin = {"stats": stats, "max_err": 0.0, "scale": templ["scale"], "calls": calls, "router_sums": templ["router_sums"]}
        if ep != world:
            builtin["group"] = group
        out[r] = json.loads(json.dumps({"findings": [], "router": templ["router"], "builtin": builtin}))
    if scenario == "lost_tokens" and 5 in out:
        out[5]["builtin"]["stats"]["recv_valid"][3 % ep] -= 1
    return out


SUITE_BUILDERS = {
    "setup_sync": setup_sync, "fsdp_plan": fsdp_plan, "loss_parity": loss_parity, "param_sync": param_sync,
    "determinism": determinism, "sequence_parallel": sequence_parallel, "moe_routing": moe_routing,
    "checkpoint": checkpoint,
}


def as_collected(probe: Any, index: int, made: dict[int, dict[str, Any]], store: Any = None) -> dict[int, dict[str, Any]]:
    """The payloads as the writer has them: each rank's entry posted as distdiag/check/run.py
    posts it (its probe's shared fields stored once, distdiag/check/shared_values.py) into a
    store (an in-process HashStore unless given), collected and resolved by the writer's code."""
    from torch.distributed import HashStore

    from distdiag.check.shared_values import resolve_shared, share_fields
    from distdiag.runtime.exchange import Exchange
    from distdiag.runtime.keys import Keys

    store = store if store is not None else HashStore()
    world = len(made)
    for r, payload in made.items():
        ex = Exchange(store, r, world)
        ex.post(Keys.result(index), share_fields(ex, index, {"status": "ok", "payload": payload}, probe.shared_fields))
    ex = Exchange(store, 0, world)
    posted = resolve_shared(ex, index, ex.collect(Keys.result(index)))
    return {r: e["payload"] for r, e in sorted(posted.items())}
