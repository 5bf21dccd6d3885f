"""MonitorConfig: the thresholds of distdiag.TrainingMonitor, validated on construction."""

from __future__ import annotations

from dataclasses import dataclass

from distdiag.errors import ConfigError

__all__ = ["MonitorConfig", "TRACE_MODES"]

TRACE_MODES = ("auto", "always", "off")


@dataclass
class MonitorConfig:
    every: int = 10
    """Look every this many steps: norms, cross-rank agreement (one all_reduce), the log line."""
    trace: str = "auto"
    """Non-finite tracing: auto (arm the module hooks for `trace_steps` steps after a
    non-finite loss or gradient is seen), always (every step: slow, for hunting), off."""
    nan_scan_every: int = 100
    """Steps whose forward is scanned for a NaN made inside a module (also one replaced before
    the module's output, which no hook sees): step 0 and every this many steps (0: never; off
    with trace="off"). One scanned step costs about 2x a plain forward on a small model, so
    100 keeps the average near 1% (benchmarks/bench_nan_scan.py)."""
    trace_steps: int = 5
    """auto: how many steps the hooks stay armed after a detection, unless an origin is found."""
    depth: int = 2
    """Gradient norms per module group: the first `depth` parts of parameter names."""
    vanish_below: float = 1e-8
    """A gradient norm (total or of a module group) below this is vanishing."""
    explode_above: float = 1e3
    """A gradient norm (total or of a module group) above this is exploding."""
    imbalance_ratio: float = 100.0
    """Among parameters of the same kind (the same name but for layer indices, and shape: one
    projection in each layer), one gradient norm this many times another's is an imbalance."""
    spike_factor: float = 2.0
    """A loss this many times the median of the `spike_window` steps before is a spike."""
    spike_window: int = 20
    """Steps of loss history that form the spike baseline."""
    update_ratio_high: float = 0.1
    """Update norm / parameter norm of a step above this: the learning rate is too high."""
    update_ratio_low: float = 1e-7
    """Update norm / parameter norm below this: parameters are (nearly) not updated."""
    component_ratio: float = 100.0
    """Loss components, each divided by its own first non-zero value after step 0: one fallen
    this many times further than another that has not halved from its own: reported (info)."""
    zero_looks: int = 3
    """A loss component exactly 0 at this many looks in a row after step 0 is a dead path; also
    the looks a component needs after its reference before dominance is judged."""
    num_codes: int = 0
    """Size of the codebook / number of experts when `codes=` is passed (0: codes not used)."""
    code_use_low: float = 0.1
    """Fewer than this fraction of the codes a look's assignments could use (min(num_codes,
    assignments)) is a collapse."""
    code_monopoly: float = 0.5
    """One code taking this share of all assignments monopolises them."""
    entropy_high: float = 0.9
    """Output entropy above this fraction of log(vocab): near-uniform, gibberish."""
    entropy_low: float = 0.02
    """Entropy of all positions' predictions together (the marginal) below this fraction of
    log(vocab): collapsed onto few tokens (a low entropy per position alone is a confident model)."""
    entropy_grace_steps: int = 100
    """Near-uniform output is expected at initialisation: judge it only after this step."""
    rank_rtol: float = 1e-4
    """Replicated quantities (DDP gradients, parameters) agree across ranks within this."""
    loss_outlier_factor: float = 10.0
    """A rank whose loss is this many times the others' median is named."""
    max_components: int = 8
    """Capacity for loss components in the cross-rank vector (the layout must be fixed)."""

    def __post_init__(self) -> None:
        def need(ok: bool, key: str, value: object, rule: str) -> None:
            if not ok:
                raise ConfigError(f"monitor.{key} must be {rule}, got {value!r}")

        need(isinstance(self.every, int) and self.every >= 1, "every", self.every, "an int >= 1")
        need(self.trace in TRACE_MODES, "trace", self.trace, f"one of {', '.join(TRACE_MODES)}")
        need(isinstance(self.nan_scan_every, int) and self.nan_scan_every >= 0, "nan_scan_every", self.nan_scan_every, "an int >= 0")
        need(self.trace_steps >= 1, "trace_steps", self.trace_steps, ">= 1")
        need(self.depth >= 1, "depth", self.depth, ">= 1")
        need(0 < self.vanish_below < self.explode_above, "vanish_below", self.vanish_below, f"within (0, explode_above={self.explode_above})")
        need(self.imbalance_ratio > 1, "imbalance_ratio", self.imbalance_ratio, "> 1")
        need(self.spike_factor > 1, "spike_factor", self.spike_factor, "> 1")
        need(self.spike_window >= 5, "spike_window", self.spike_window, ">= 5")
        need(0 < self.update_ratio_low < self.update_ratio_high, "update_ratio_low", self.update_ratio_low, f"within (0, update_ratio_high={self.update_ratio_high})")
        need(self.component_ratio > 1, "component_ratio", self.component_ratio, "> 1")
        need(isinstance(self.zero_looks, int) and self.zero_looks >= 1, "zero_looks", self.zero_looks, "an int >= 1")
        need(self.num_codes >= 0, "num_codes", self.num_codes, ">= 0")
        need(0 < self.code_use_low < 1, "code_use_low", self.code_use_low, "within (0, 1)")
        need(0 < self.code_monopoly <= 1, "code_monopoly", self.code_monopoly, "within (0, 1]")
        need(0 < self.entropy_low < self.entropy_high < 1, "entropy_high", self.entropy_high, f"within (entropy_low={self.entropy_low}, 1)")
        need(self.entropy_grace_steps >= 0, "entropy_grace_steps", self.entropy_grace_steps, ">= 0")
        need(0 < self.rank_rtol < 1, "rank_rtol", self.rank_rtol, "within (0, 1)")
        need(self.loss_outlier_factor > 1, "loss_outlier_factor", self.loss_outlier_factor, "> 1")
        need(self.max_components >= 0, "max_components", self.max_components, ">= 0")
