"""Consolidation of `moe_routing`: every rank's payload -> findings (no collectives)."""

from __future__ import annotations

import math
from typing import Any

from distdiag.probes.moe.config import MoeRoutingConfig
from distdiag.probes.moe.dispatch import split_findings
from distdiag.report.model import Finding
from distdiag.report.render import format_ranks

__all__ = ["consolidate_moe", "load_findings", "load_noise", "BUILTIN_ROUTER"]

BUILTIN_ROUTER = "built-in router"
"""The `who` of rank 0's router checks when the target has no route()."""


def _f(severity: str, issue: str, evidence: str, ranks: list[int], fix: str, confidence: float = 0.9) -> Finding:
    return Finding(severity=severity, issue=issue, evidence=evidence, ranks=ranks, fix=fix, confidence=confidence)


NOISE_ALPHA = 0.01
"""A load is judged only when a router sending every token to k of the experts uniformly at
random would show it with a probability below this (a bound over all experts)."""


def _tail_bound(count: int, tokens: int, p: float) -> float:
    """Chernoff bound on P(Binomial(tokens, p) >= count), for count above the mean."""
    a = min(count / tokens, 1.0)
    if a <= p:
        return 1.0
    kl = a * math.log(a / p) + ((1 - a) * math.log((1 - a) / (1 - p)) if a < 1 else 0.0)
    return math.exp(-tokens * kl)


def load_noise(counts: list[int], tokens: int) -> tuple[float, float]:
    """How likely a uniform router's sampling noise alone gives (any idle expert, the busiest count).

    Under uniform top-k routing an expert's count is Binomial(tokens, k / experts); both are
    union bounds over the experts (upper bounds: a small value is real evidence).
    """
    experts, total = len(counts), sum(counts)
    if not experts or not tokens or not total:
        return 1.0, 1.0
    p = min(total / tokens / experts, 1.0)  # k / experts: each token picks k experts
    idle = experts * (1.0 - p) ** tokens
    busy = experts * _tail_bound(max(counts), tokens, p)
    return min(idle, 1.0), min(busy, 1.0)


def load_findings(who: str, indices: list[list[int]], num_experts: int, imbalance_warn: float, tokens: str = "",
                  judge: bool = True) -> list[Finding]:
    """Tokens per expert from [N][k] indices: idle experts and collapse are warnings with numbers.

    `tokens` says what was routed when it is not the user's data (made-up random tokens load
    a router differently than real hidden states do). A warning needs more than a pattern:
    it must be improbable as sampling noise (`load_noise` < NOISE_ALPHA), or 64 made-up
    tokens over 32 experts (4 each on average) would warn on a healthy router. `judge=False`
    (distdiag's own randomly initialised router) only reports the load."""
    counts = [0] * num_experts
    for row in indices:
        for e in row:
            if 0 <= e < num_experts:
                counts[e] += 1
    total = sum(counts)
    mean = total / max(1, num_experts)
    idle = [e for e, c in enumerate(counts) if c == 0]
    ratio = max(counts) / mean if mean else 0.0
    evidence = f"tokens per expert {counts} ({total} assignments, mean {mean:.1f}, max/mean {ratio:.2f}, {num_experts - len(idle)}/{num_experts} experts used)"
    if tokens:
        evidence += f"; routed: {tokens}"
    idle_noise, busy_noise = load_noise(counts, len(indices))
    out = []
    if judge and idle and idle_noise < NOISE_ALPHA:
        out.append(_f("warning", f"{who}: {len(idle)} of {num_experts} experts get no tokens (experts {idle})", evidence, [],
                      "an expert that never gets tokens never learns: check the router init, the load-balancing loss "
                      "and whether num_experts matches the router's output width", 0.7))
    if judge and ratio > imbalance_warn and busy_noise < NOISE_ALPHA:
        busiest = max(range(num_experts), key=lambda e: counts[e])
        out.append(_f("warning", f"{who}: routing collapses onto few experts: expert {busiest} gets {ratio:.1f}x the mean load",
                      evidence, [], "add or raise the auxiliary load-balancing loss; check router logits for a bias", 0.7))
    if not out:
        out.append(_f("info", f"{who}: load per expert", evidence + _unjudged(judge, idle, ratio > imbalance_warn), [], "", 1.0))
    return out


def _unjudged(judge: bool, idle: list[int], lopsided: bool) -> str:
    """Why a load that looks uneven is not a warning."""
    if not judge:
        return ("; not judged: this is distdiag's own router with random weights (its load says nothing about your "
                "model; give the target a route() to check yours)")
    if idle or lopsided:
        return ("; not judged: too few tokens per expert to tell this from sampling noise "
                "(raise probes.moe_routing.num_tokens)")
    return ""


def _router(payloads: dict[int, dict[str, Any]], opts: MoeRoutingConfig, world: int) -> list[Finding]:
    info = {r: p.get("router") or {} for r, p in payloads.items()}
    who = info.get(0, {}).get("who", "route")
    problems = {r: v["problem"] for r, v in info.items() if v.get("problem")}
    if problems:
        return _router_problems(problems, info, who, world)
    out = _router_twice(info, who, opts, world)
    ref = info.get(0, {}).get("indices")
    if ref is not None:
        out += _router_ranks_differ(info, ref, who, world)
        num = info[0].get("num_experts") or (max((e for row in ref for e in row), default=-1) + 1)
        made_up = f"{len(ref)} random tokens N(0, 1) of width {opts.hidden_dim} that distdiag made up, not your data"
        # The built-in router's gate is random: with many experts in 16 dimensions some rows
        # dominate, so its load is lopsided (max/mean ~3 at 128 experts) however many tokens
        # it routes. Shown, never judged: the user cannot act on it.
        out += load_findings(who, ref, num, opts.imbalance_warn, made_up, judge=who != BUILTIN_ROUTER)
    out += _router_ties(info, who, opts)
    return out


def _router_problems(
    problems: dict[int, str], info: dict[int, dict[str, Any]], who: str, world: int
) -> list[Finding]:
    """The one finding when route() could not be called or checked on some ranks."""
    ranks = sorted(problems)
    if all(info[r].get("raised") for r in problems):
        # The tokens are made up (random, hidden_dim wide): a router that raises on them is
        # most likely one of another width, not a broken router; its checks did not run.
        return [_f("warning", f"{who} was not checked: it raised on the tokens distdiag made up on "
                              f"{format_ranks(ranks, world)}: {problems[ranks[0]]}",
                   "\n".join(f"rank {r}: {p}" for r, p in sorted(problems.items())), ranks,
                   "set probes.moe_routing.hidden_dim to the width of the hidden states your router takes, so route() can "
                   "be called on made-up tokens of that shape", 0.8)]
    return [_f("error", f"{who} cannot be checked on {format_ranks(ranks, world)}: {problems[ranks[0]]}",
               "\n".join(f"rank {r}: {p}" for r, p in sorted(problems.items())), ranks,
               "route(tokens) takes float tokens [num_tokens, hidden_dim] and returns expert indices [num_tokens, k] "
               "(optionally a tuple (indices, ..., scores [num_tokens, num_experts]))", 0.95)]


def _router_twice(info: dict[int, dict[str, Any]], who: str, opts: MoeRoutingConfig, world: int) -> list[Finding]:
    """Ranks where a second call on the same tokens routed some of them differently."""
    twice = {r: v for r, v in info.items() if v.get("twice_differ_count")}
    if not twice:
        return []
    ranks = sorted(twice)
    r0 = ranks[0]
    first = twice[r0]["twice_differ"][0]
    return [_f(
        "error", f"{who} routes the same tokens differently on a second call on {format_ranks(ranks, world)}: "
                 f"{twice[r0]['twice_differ_count']} of {opts.num_tokens} tokens change experts",
        "\n".join(f"rank {r}: tokens {v['twice_differ']}" for r, v in sorted(twice.items()))
        + f"\nrank {r0} token {first}: {info[r0]['indices'][first]} then {twice[r0]['second_first']}",
        ranks, "the router draws random numbers per call (noise, jitter, dropout in train mode, unseeded sampling): "
               "seed it from the step, or disable it where recomputation must route identically", 0.95)]


def _router_ranks_differ(info: dict[int, dict[str, Any]], ref: list[Any], who: str, world: int) -> list[Finding]:
    """Ranks that route the same tokens to other experts than rank 0 does."""
    differ = {}
    for r, v in sorted(info.items()):
        if r and v.get("indices") is not None and v["indices"] != ref:
            toks = [t for t in range(len(ref)) if t >= len(v["indices"]) or v["indices"][t] != ref[t]]
            differ[r] = toks
    if not differ:
        return []
    ranks = sorted(differ)
    r1 = ranks[0]
    t = differ[r1][0]
    return [_f(
        "error", f"{who} routes identical tokens to different experts on {format_ranks(ranks, world)} than on rank 0",
        "\n".join(f"rank {r}: {len(ts)} of {len(ref)} tokens differ, first {ts[:8]}" for r, ts in sorted(differ.items()))
        + f"\ntoken {t}: rank 0 {ref[t]}, rank {r1} {info[r1]['indices'][t] if t < len(info[r1]['indices']) else '-'}",
        ranks, "the router depends on the rank (a per-rank seed or generator, unsynchronised router weights): "
               "seed identically and keep router parameters replicated", 0.95)]


def _router_ties(info: dict[int, dict[str, Any]], who: str, opts: MoeRoutingConfig) -> list[Finding]:
    """Rank 0's near-tie count among the top-k scores, as a warning over opts.tie_warn_share."""
    ties = info.get(0, {}).get("near_ties")
    if not ties:
        return []
    share = ties / max(1, opts.num_tokens)
    return [_f("warning" if share > opts.tie_warn_share else "info",
               f"{who}: {ties} of {opts.num_tokens} tokens ({share:.1%}) are near-ties (top-k log-score gap < {opts.tie_eps:g})",
               f"smallest gap {info[0].get('min_gap', 0):.3g}; routed: {opts.num_tokens} random tokens N(0, 1) that "
               "distdiag made up (real hidden states may tie more or less often)", [],
               "near-ties flip under recomputation or another reduction order (activation checkpointing, "
               "different parallelism): break ties deterministically or add a small fixed bias", 0.6)]


def _lost_in_dispatch(stats: dict[int, dict[str, Any]], groups: dict[int, list[int] | None]) -> list[str]:
    """Each (sender, receiver) pair of an expert-parallel group whose counts disagree: what i
    sent to its group's j-th member against what that member received from i. `groups`: each
    rank's group (None: a payload without one, its peers are every rank, in rank order); a
    rank's lists are indexed by its group's members. Linear in the ranks times the group."""
    everyone = sorted(stats)
    lines = []
    for i in everyone:
        members = groups.get(i) or everyone
        at = members.index(i)
        for pos, j in enumerate(members):
            if j in stats and (sent := stats[i]["sent_valid"][pos]) != (got := stats[j]["recv_valid"][at]):
                lines.append(f"rank {i} sent {sent} tokens to rank {j}, which received {got}")
    return lines


def _dispatch(where: str, res: dict[int, dict[str, Any]], world: int) -> list[Finding]:
    out = split_findings(where, {r: v.get("calls", []) for r, v in res.items()})
    stats = {r: v["stats"] for r, v in res.items() if v.get("stats")}
    if len(stats) == len(res) and stats:
        caps = {r: s["capacity"] for r, s in stats.items()}
        if len(set(caps.values())) > 1:
            out.append(_f("error", f"{where}: capacity differs across ranks", ", ".join(f"rank {r}: {c}" for r, c in sorted(caps.items())),
                          sorted(caps), "compute capacity from the global token count, the same on every rank"))
        lines = _lost_in_dispatch(stats, {r: v.get("group") for r, v in res.items()})
        if lines:
            out.append(_f("error", f"{where}: tokens lost or duplicated in dispatch", "\n".join(lines[:8]), sorted(stats),
                          "the all_to_all transport corrupts data: rerun the collectives probe"))
        lost = sorted(r for r, s in stats.items() if not s["round_trip_ok"])
        if lost:
            out.append(_f("error", f"{where}: tokens did not come back to their rank exactly once on {format_ranks(lost, world)}",
                          "", lost, "the combine all_to_all must mirror the dispatch splits"))
        dropped = sum(s["dropped"] for s in stats.values())
        if dropped:
            total = sum(s["assignments"] for s in stats.values())
            out.append(_f("info", f"{where}: {dropped} of {total} token assignments dropped at capacity {caps[min(caps)]}",
                          ", ".join(f"rank {r}: {s['dropped']}" for r, s in sorted(stats.items())), [], "", 1.0))
        errs = {r: v["max_err"] for r, v in res.items() if v.get("max_err", 0.0) > 1e-5 * max(1.0, v.get("scale", 1.0))}
        if errs:
            out.append(_f("error", f"{where}: expert-parallel output differs from the single-process dense layer on "
                                   f"{format_ranks(sorted(errs), world)}",
                          ", ".join(f"rank {r}: max abs error {e:.3g}" for r, e in sorted(errs.items())), sorted(errs),
                          "tokens reach the wrong expert or the combine uses the wrong gates"))
    return out


def _differ_from_rank0(res: dict[int, dict[str, Any]], key: str) -> dict[int, list[str]]:
    """Ranks whose checksums under `key` differ from rank 0's: rank -> names."""
    sums = {r: v[key] for r, v in res.items() if v.get(key)}
    if not sums or 0 not in sums:
        return {}
    differ = {}
    for r, s in sums.items():
        names = [n for n in s if s[n] != sums[0].get(n)]
        if names:
            differ[r] = names
    return differ


def _router_sync(where: str, res: dict[int, dict[str, Any]], world: int) -> list[Finding]:
    """Router parameters, and router buffers (a load-balancing bias), that differ across ranks after training."""
    out = []
    differ = _differ_from_rank0(res, "router_sums")
    if differ:
        ranks = sorted(differ)
        out.append(_f("error", f"{where}: router parameters differ from rank 0's on {format_ranks(ranks, world)} after training steps",
                      "\n".join(f"rank {r}: {', '.join(n[:6])}" for r, n in sorted(differ.items())), ranks,
                      "replicated router weights need their gradients averaged over every rank (and identical init)"))
    differ = _differ_from_rank0(res, "router_buffers")
    if differ:
        ranks = sorted(differ)
        out.append(_f(
            "error", f"{where}: router buffers differ from rank 0's on {format_ranks(ranks, world)} after training steps: "
                     f"{', '.join(differ[ranks[0]][:4])}",
            "\n".join(f"rank {r}: {', '.join(n[:6])}" for r, n in sorted(differ.items())),
            ranks, "a router buffer updated during training (a load-balancing bias from the expert load, running "
                   "statistics) is updated from each rank's own tokens: update it from the load summed over every "
                   "rank (all_reduce the counts before the update), or broadcast it", 0.85))
    return out


def _routing_after(payloads: dict[int, dict[str, Any]], world: int) -> list[Finding]:
    """route() on the same tokens after the target model's training steps, across ranks."""
    after = {r: p["router_after"] for r, p in payloads.items() if p.get("router_after")}
    before = [p.get("router", {}).get("indices") for p in payloads.values()]
    ref = after.get(0, {}).get("indices")
    if ref is None or any(b != before[0] for b in before):
        return []  # routing that differed before training is said by the first router check
    differ = {r: v["indices"] for r, v in sorted(after.items()) if r and v.get("indices") is not None and v["indices"] != ref}
    if not differ:
        return []
    ranks = sorted(differ)
    toks = [t for t in range(len(ref)) if differ[ranks[0]][t] != ref[t]]
    moved = "; before training every rank routed these tokens alike" + (", as rank 0 still does" if before[0] == ref else "")
    return [_f("error", f"route sends identical tokens to different experts on {format_ranks(ranks, world)} than on "
                        "rank 0 after the target model's training steps",
               f"rank {ranks[0]}: {len(toks)} of {len(ref)} tokens differ, first {toks[:8]}; token {toks[0]}: rank 0 "
               f"{ref[toks[0]]}, rank {ranks[0]} {differ[ranks[0]][toks[0]]}" + moved, ranks,
               "the router's state drifted apart across ranks while training (see the router parameter or buffer "
               "finding): every rank must update it identically", 0.9)]


def consolidate_moe(payloads: dict[int, dict[str, Any]], opts: MoeRoutingConfig, world: int) -> list[Finding]:
    findings = _router(payloads, opts, world)
    builtin = {r: p.get("builtin") or {} for r, p in payloads.items()}
    findings += _dispatch("built-in expert-parallel layer", builtin, world)
    findings += _router_sync("built-in expert-parallel layer", builtin, world)
    user = {r: p["user"] for r, p in payloads.items() if p.get("user")}
    if user:
        findings += _dispatch("target model", user, world)
        if not any(v.get("calls") for v in user.values()):
            findings.append(_f("info", "the target model's forward issued no all_to_all_single: its dispatch was not checked",
                               "", [], "distdiag records torch.distributed.all_to_all_single called by its module path"))
        caps = {r: v.get("capacity", {}) for r, v in user.items()}
        for key in sorted({k for c in caps.values() for k in c}):
            values = {r: c.get(key) for r, c in caps.items()}
            if len(set(values.values())) > 1:
                findings.append(_f("error", f"target model: {key} differs across ranks",
                                   ", ".join(f"rank {r}: {v}" for r, v in sorted(values.items())), sorted(values),
                                   "compute capacity from the global token count, the same on every rank"))
        findings += _router_sync("target model", user, world)
        findings += _routing_after(payloads, world)
    return findings
