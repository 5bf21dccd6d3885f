"""The moe_routing probe's options (the `[probes.moe_routing]` table), apart from the probe so
that its consolidation helpers (checks.py) can name them."""

from __future__ import annotations

from dataclasses import dataclass

from distdiag.errors import ConfigError

__all__ = ["MoeRoutingConfig"]


@dataclass
class MoeRoutingConfig:
    """Options of the moe_routing probe, the `[probes.moe_routing]` table."""

    num_tokens: int = 64
    """Tokens routed per rank."""
    hidden_dim: int = 16
    """Width of the tokens passed to route(tokens) and of the built-in layer."""
    num_experts: int = 0
    """Experts of the built-in layer; 0 means 2 x its expert-parallel group's size (must divide by it)."""
    ep_size: int = 0
    """Ranks per expert-parallel group of the built-in layer (consecutive ranks; must divide the
    world size); 0: the largest divisor of the world size up to 8, the whole world up to 8
    ranks (or when no divisor from 2 to 8 exists). Each group exchanges its tokens over its own
    all_to_all: what a rank posts and the split tables it gathers grow with its group, not the job."""
    top_k: int = 2
    """Experts per token of the built-in layer."""
    tie_eps: float = 1e-4
    """A token whose k-th and (k+1)-th router scores differ by less than this in log space
    (the logit gap of softmax scores) is a near-tie."""
    tie_warn_share: float = 0.1
    """Warn when more than this share of tokens are near-ties."""
    imbalance_warn: float = 3.0
    """Warn when the busiest expert gets more than this many times the mean load (and too many
    tokens for a uniform router's sampling noise to explain, see checks.load_noise)."""
    steps: int = 3
    """Training steps before comparing router parameters across ranks."""

    def __post_init__(self) -> None:
        def integer(key: str, low: int, high: int) -> None:
            v = getattr(self, key)
            if isinstance(v, bool) or not isinstance(v, int) or not low <= v <= high:
                raise ConfigError(f"probes.moe_routing.{key} must be an integer in [{low}, {high}], got {v!r}")

        def number(key: str, low: float, high: float) -> None:
            v = getattr(self, key)
            if isinstance(v, bool) or not isinstance(v, int | float) or not low < v < high:
                raise ConfigError(f"probes.moe_routing.{key} must be a number in ({low}, {high}), got {v!r}")

        integer("num_tokens", 1, 1 << 20)
        integer("hidden_dim", 1, 1 << 16)
        integer("num_experts", 0, 4096)
        integer("ep_size", 0, 1 << 20)
        integer("top_k", 1, 64)
        integer("steps", 0, 100)
        number("tie_eps", 0.0, 1.0)
        number("tie_warn_share", 0.0, 1.0)
        number("imbalance_warn", 1.0, 1e6)
