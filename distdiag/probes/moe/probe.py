"""`moe_routing`: routers that are not deterministic, dispatch that loses tokens, lopsided load.

1. The router (the target's `route(tokens)`, else the built-in top-k router) on the same
   tokens twice and on every rank: identical expert indices, near-ties reported as a risk,
   load per expert.
2. The built-in expert-parallel layer (distdiag.workloads.moe) over all_to_all, in
   expert-parallel groups of up to 8 consecutive ranks (`ep_size`): rows sent equal rows
   received pairwise within each group, no token lost or duplicated, one capacity everywhere,
   dropped assignments counted, output equal to the single-process dense layer, router
   parameters identical on every rank after a few steps.
3. With a target that has `route` and build_model/make_batch/loss_fn: one training step of
   the user's model while distdiag.probes.moe.dispatch records the split sizes of every
   all_to_all_single it issues, and the `capacity` attributes of its modules.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

import torch

from distdiag.errors import ConfigError, exc_line
from distdiag.probes import training as tr
from distdiag.probes.base import ConsolidationView, LocalFinding, Probe, local_finding, merge_local_findings
from distdiag.probes.moe.checks import BUILTIN_ROUTER, consolidate_moe
from distdiag.probes.moe.config import MoeRoutingConfig
from distdiag.probes.moe.dispatch import SplitMismatch, SplitRecorder
from distdiag.report.model import ProbeResult
from distdiag.report.render import format_ranks
from distdiag.workloads.base import batch_on
from distdiag.workloads.moe import DenseMoE, ExpertParallelMoE

if TYPE_CHECKING:
    import torch.distributed as dist

    from distdiag.runtime.context import RankContext

__all__ = ["MoeRoutingProbe", "MoeRoutingConfig"]


def _parse_route(out: Any, num_tokens: int) -> tuple[torch.Tensor | None, torch.Tensor | None, str | None]:
    """(indices [N, k], scores [N, E] or None, problem)."""
    idx: torch.Tensor | None = out if isinstance(out, torch.Tensor) else None
    scores: torch.Tensor | None = None
    if isinstance(out, tuple | list) and out and isinstance(out[0], torch.Tensor):
        idx = out[0]
        for extra in out[1:]:
            if isinstance(extra, torch.Tensor) and extra.dim() == 2 and extra.is_floating_point() and extra.shape[0] == num_tokens and extra.shape[1] > idx.shape[-1]:
                scores = extra
    if idx is None:
        return None, None, f"route must return expert indices [num_tokens, k] (or a tuple starting with them), got {type(out).__name__}"
    if idx.dim() == 1:
        idx = idx[:, None]
    if idx.dim() != 2 or idx.shape[0] != num_tokens or idx.is_floating_point():
        return None, None, f"route(tokens [{num_tokens}, d]) must return integer indices [{num_tokens}, k], got {idx.dtype} {list(idx.shape)}"
    if bool((idx < 0).any()):
        return None, None, f"route returned negative expert indices (min {int(idx.min())})"
    return idx.detach().cpu().long(), (scores.detach().cpu().float() if scores is not None else None), None


def _router_checks(ctx: RankContext, opts: MoeRoutingConfig, route: Any, who: str) -> dict[str, Any]:
    tokens = torch.randn(opts.num_tokens, opts.hidden_dim, generator=torch.Generator().manual_seed(11)).to(ctx.device)
    ctx.seed()
    try:
        first = _parse_route(route(tokens), opts.num_tokens)
        second = _parse_route(route(tokens), opts.num_tokens)
    except Exception as exc:  # noqa: BLE001 - the user's router raising is a finding
        ctx.caught(exc, f"{who} on made-up tokens")  # a router may issue collectives; the dispatch check follows
        return {"who": who, "raised": True, "problem": f"{who}(tokens float32 [{opts.num_tokens}, {opts.hidden_dim}]) raised "
                f"{exc_line(exc)} (set probes.moe_routing.hidden_dim "
                "to your router's input width)"}
    if first[2] or second[2]:
        return {"who": who, "problem": first[2] or second[2]}
    idx, scores = first[0], first[1]
    assert idx is not None and second[0] is not None  # neither parse found a problem
    differ = (idx != second[0]).any(dim=1).nonzero().flatten().tolist() if idx.shape == second[0].shape else list(range(opts.num_tokens))
    res: dict[str, Any] = {"who": who, "indices": idx.tolist(), "twice_differ": differ[:16], "twice_differ_count": len(differ),
                           "second_first": second[0][differ[0]].tolist() if differ and idx.shape == second[0].shape else None}
    if scores is not None:
        k = idx.shape[1]
        top = scores.topk(min(k + 1, scores.shape[1]), dim=-1).values
        if top.shape[1] > k:
            # In log space (= the logit gap for softmax scores): two tiny probabilities
            # 1e-5 apart are not a near-tie when one is three times the other.
            logs = top.clamp_min(torch.finfo(top.dtype).tiny).log()
            gap = logs[:, k - 1] - logs[:, k]
            res["near_ties"] = int((gap < opts.tie_eps).sum())
            res["min_gap"] = float(gap.min())
        res["num_experts"] = int(scores.shape[1])
    return res


EP_GROUP_MAX = 8
"""The built-in layer's expert-parallel group by default: at most this many ranks (a node)."""


def ep_size_for(world: int, asked: int = 0) -> int:
    """Ranks per expert-parallel group of the built-in layer (MoeRoutingConfig.ep_size)."""
    if asked:
        if world % asked:
            raise ConfigError(f"probes.moe_routing.ep_size ({asked}) must divide the world size {world}")
        return asked
    return next((d for d in range(min(world, EP_GROUP_MAX), 1, -1) if world % d == 0), world)


def _layer_shape(opts: MoeRoutingConfig, world: int) -> tuple[int, int]:
    """(ranks per expert-parallel group, experts) of the built-in layer; ConfigError if impossible."""
    ep = ep_size_for(world, opts.ep_size)
    experts = opts.num_experts or 2 * ep
    if experts % ep:
        raise ConfigError(f"probes.moe_routing.num_experts ({experts}) must divide by the expert-parallel group size {ep}")
    if opts.top_k > experts:
        raise ConfigError(f"probes.moe_routing.top_k ({opts.top_k}) must be <= num_experts ({experts})")
    return ep, experts


def _ep_group(members: list[int], world: int) -> dist.ProcessGroup | None:
    """This rank's expert-parallel group: the default group when it is the whole world, else
    made by its members only (no barrier of the whole job: 2,048 groups at 16k ranks)."""
    if len(members) == world:
        return None
    import torch.distributed as dist

    return dist.new_group(members, use_local_synchronization=True)


class MoeRoutingProbe(Probe):
    name = "moe_routing"
    checks_a_model = True
    summary = "MoE routers that differ between calls or ranks, all_to_all dispatch that loses tokens, lopsided expert load"
    min_world_size = 2
    Config = MoeRoutingConfig

    def options_problem(self, options: MoeRoutingConfig, world_size: int) -> str | None:
        if world_size < self.min_world_size:  # not run there (world_problem says so): its options do not matter
            return None
        try:
            _layer_shape(options, world_size)
        except ConfigError as exc:
            return str(exc)
        return None

    def skip_reason(self, ctx: RankContext) -> str | None:
        """A target without a router hook has nothing of the user's to check: only the built-in
        router and layer would run, and a PASS would say nothing of the target."""
        target = getattr(ctx, "target", None)
        if target is not None and not target.has("route"):
            return (f"nothing of yours to check: target {target.spec} has no route() hook "
                    "(without --target the probe checks its built-in router and layer)")
        return None

    def run(self, ctx: RankContext) -> dict[str, Any]:
        opts: MoeRoutingConfig = self.options(ctx)
        findings: list[LocalFinding] = []
        ep, experts = _layer_shape(opts, ctx.world_size)
        ctx.seed()
        dense = DenseMoE(opts.hidden_dim, 2 * opts.hidden_dim, experts, opts.top_k).to(ctx.device)
        target = ctx.target
        payload: dict[str, Any] = {"findings": findings}
        if target is not None and target.has("route"):
            payload["router"] = _router_checks(ctx, opts, target.route, "route")
        else:
            payload["router"] = _router_checks(ctx, opts, dense.router, BUILTIN_ROUTER)
        payload["builtin"] = self._builtin(ctx, opts, dense, ep)
        if target is not None and target.has("route"):
            payload["user"] = self._user_model(ctx, opts, findings)
            if payload["user"] and "router_sums" in payload["user"]:
                # the same tokens again, once the target's model trained: a router whose state
                # (weights, a load-balancing bias) drifted apart across ranks now routes apart
                payload["router_after"] = _route_indices(ctx, opts, target.route)
        return payload

    def _builtin(self, ctx: RankContext, opts: MoeRoutingConfig, dense: DenseMoE, size: int) -> dict[str, Any]:
        rank, world = ctx.rank, ctx.world_size
        x = torch.randn(opts.num_tokens, opts.hidden_dim, generator=torch.Generator().manual_seed(100 + rank)).to(ctx.device)
        start = rank - rank % size
        members = list(range(start, start + size))
        ep = ExpertParallelMoE.from_dense(dense, rank - start, size, a2a=ctx.comm.all_to_all_single,
                                          group=_ep_group(members, world))
        res: dict[str, Any] = {"group": members}
        with SplitRecorder() as rec:
            try:
                with torch.no_grad():
                    out = ep(x)
                    ref = dense(x)
                res["stats"] = ep.stats
                res["max_err"] = float((out - ref).abs().max())
                res["scale"] = float(ref.abs().max())
            except SplitMismatch as exc:
                res["mismatch"] = str(exc)
            res["calls"] = rec.calls
        if "mismatch" in res:
            return res
        # Plain SGD by hand: the first torch.optim step imports torch._dynamo (seconds here).
        for step in range(opts.steps):
            xs = torch.randn(opts.num_tokens, opts.hidden_dim, generator=torch.Generator().manual_seed(1000 * step + rank)).to(ctx.device)
            ep.router.zero_grad()
            ep(xs).pow(2).mean().backward()
            # One all_reduce per step over all router grads, not one per parameter.
            params = list(ep.router.parameters())
            flat = torch.cat([(p.grad if p.grad is not None else torch.zeros_like(p)).reshape(-1) for p in params])
            ctx.comm.all_reduce(flat)
            with torch.no_grad():
                offset = 0
                for p in params:
                    grad = flat[offset:offset + p.numel()].view_as(p)
                    offset += p.numel()
                    p.sub_(0.5 * grad / world)
        res["router_sums"] = {n: _sums(p) for n, p in ep.router.named_parameters()}
        return res

    def _user_model(self, ctx: RankContext, opts: MoeRoutingConfig, findings: list[LocalFinding]) -> dict[str, Any] | None:
        target = ctx.target
        needed = [h for h in ("build_model", "make_batch", "loss_fn") if not target.has(h)]
        if needed:
            findings.append(local_finding("info", f"dispatch of the target's own model not checked: no {', '.join(needed)}()",
                                          fix="define build_model, make_batch and loss_fn to check the all_to_all of your MoE forward"))
            return None

        res: dict[str, Any] = {"calls": [], "capacity": {}}
        # Built inside the recorder too, so a model that keeps a reference to
        # all_to_all_single from construction time still calls the recording one.
        model = None
        with SplitRecorder() as rec:
            try:
                ctx.seed()
                model = target.build_model().to(ctx.device)
                if target.has("parallelize"):
                    model = target.parallelize(model, tr.make_mesh(ctx, "ep"))
                opt = target.build_optimizer(model.parameters()) if target.has("build_optimizer") else None
                for step in range(max(1, opts.steps if opt is not None else 1)):
                    batch = target.make_batch(step + 1)
                    if target.has("shard_batch"):
                        batch = target.shard_batch(batch, ctx.rank, ctx.world_size)
                    loss = target.loss_fn(model, batch_on(model, batch))  # the device contract (docs/targets.md)
                    loss.backward()
                    if opt is not None:
                        opt.step()
                        opt.zero_grad()
            except SplitMismatch as exc:
                res["mismatch"] = str(exc)
            finally:
                res["calls"] = rec.calls
        for name, module in (model.named_modules() if model is not None else []):
            for attr in ("capacity", "expert_capacity"):
                value = getattr(module, attr, None)
                if isinstance(value, int) and not isinstance(value, bool):
                    res["capacity"][f"{name or '(model)'}.{attr}"] = value
        if "mismatch" in res or model is None:
            return res
        res["router_sums"] = {n: _sums(p) for n, p in model.named_parameters() if _router_state(n, p)}
        res["router_buffers"] = {n: _sums(b) for n, b in model.named_buffers() if _router_state(n, b)}
        return res

    def consolidate(self, payloads: dict[int, dict[str, Any]], view: ConsolidationView) -> ProbeResult:
        opts = self.options(view)
        findings = merge_local_findings(payloads) + consolidate_moe(payloads, opts, view.world_size)
        metrics = {}
        b0 = payloads.get(0, {}).get("builtin", {})
        if b0.get("stats"):
            metrics["builtin_capacity"] = b0["stats"]["capacity"]
            metrics["builtin_dropped"] = sum(p["builtin"].get("stats", {}).get("dropped", 0) for p in payloads.values())
            metrics["builtin_max_err"] = max(p["builtin"].get("max_err", 0.0) for p in payloads.values())
        r0 = payloads.get(0, {}).get("router", {})
        if "near_ties" in r0:
            metrics["near_tie_share"] = r0["near_ties"] / max(1, len(r0.get("indices", [])))
        return ProbeResult.from_findings(self.name, findings, metrics=metrics, details=_tables(payloads))


ROUTER_WORDS = ("router", "gate", "route")
"""A parameter or buffer whose name holds one of these is router state (a gate's weight, an
aux-loss-free load-balancing bias such as DeepSeek's gate.e_score_correction_bias)."""


def _router_state(name: str, t: torch.Tensor) -> bool:
    """Router state compared across ranks: replicated (a DTensor is sharded by design) and named like a router's."""
    return any(w in name for w in ROUTER_WORDS) and not hasattr(t, "full_tensor")


def _route_indices(ctx: RankContext, opts: MoeRoutingConfig, route: Any) -> dict[str, Any]:
    """route() on the router check's tokens once more: its expert indices, or what went wrong."""
    tokens = torch.randn(opts.num_tokens, opts.hidden_dim, generator=torch.Generator().manual_seed(11)).to(ctx.device)
    ctx.seed()
    try:
        idx, _, problem = _parse_route(route(tokens), opts.num_tokens)
    except Exception as exc:  # noqa: BLE001 - said by the first router check already
        ctx.caught(exc, "route on made-up tokens after training")
        return {"problem": exc_line(exc)}
    return {"problem": problem} if idx is None else {"indices": idx.tolist()}


def _sums(p: torch.Tensor) -> list[float]:
    """Two float64 checksums of a parameter (order-sensitive), comparable across ranks."""
    t = p.detach().double().reshape(-1)
    return [float(t.sum()), float((t * torch.arange(t.numel(), dtype=torch.float64, device=t.device)).sum())]


def _tables(payloads: dict[int, dict[str, Any]]) -> dict[str, Any]:
    rows = []
    for r, p in sorted(payloads.items()):
        st = p.get("builtin", {}).get("stats")
        if st:
            rows.append({"rank": r, "capacity": st["capacity"], "sent": st["sent_valid"], "received": st["recv_valid"],
                         "dropped": st["dropped"], "tokens_per_expert": st["tokens_per_expert"]})
            group = p["builtin"].get("group")
            if group and len(group) != len(payloads):  # sent/received are by its group's members
                rows[-1]["group"] = format_ranks(group)
    return {"table:moe_dispatch": rows} if rows else {}
