"""State-dict key sets: wrapper names normalised, rename maps suggested (no torch needed)."""

from __future__ import annotations

__all__ = ["WRAPPER_TOKENS", "normalize_key", "compare_keys", "KeyDiff"]

from dataclasses import dataclass, field

WRAPPER_TOKENS = ("_orig_mod.", "_checkpoint_wrapped_module.", "_fsdp_wrapped_module.", "module.")
"""Name parts that wrappers add (torch.compile, activation checkpointing, FSDP1, DDP/DataParallel)."""


def normalize_key(key: str) -> str:
    """The key without wrapper parts: `module._orig_mod.fc.weight` -> `fc.weight`."""
    parts = key.split(".")
    tokens = {t.rstrip(".") for t in WRAPPER_TOKENS}
    return ".".join(p for p in parts if p not in tokens)


@dataclass
class KeyDiff:
    missing: list[str] = field(default_factory=list)
    """Keys the model expects that the checkpoint lacks (after any rename)."""
    unread: list[str] = field(default_factory=list)
    """Keys in the checkpoint that nothing reads (DCP ignores them silently)."""
    rename: dict[str, str] = field(default_factory=dict)
    """checkpoint key -> model key, for keys that differ only by wrapper names."""
    by_shape: dict[str, str] = field(default_factory=dict)
    """checkpoint key -> model key guesses among the rest: the only pair with that shape."""


def compare_keys(model_keys: dict[str, tuple[int, ...]], ckpt_keys: dict[str, tuple[int, ...]]) -> KeyDiff:
    """Compare {key: shape} of the model's state and of the checkpoint."""
    diff = KeyDiff()
    exact = set(model_keys) & set(ckpt_keys)
    rest_model = [k for k in model_keys if k not in exact]
    rest_ckpt = [k for k in ckpt_keys if k not in exact]
    by_norm: dict[str, list[str]] = {}
    for k in rest_ckpt:
        by_norm.setdefault(normalize_key(k), []).append(k)
    still_model = []
    for k in rest_model:
        cands = by_norm.get(normalize_key(k), [])
        if len(cands) == 1:
            diff.rename[cands.pop()] = k
        else:
            still_model.append(k)
    still_ckpt = [k for ks in by_norm.values() for k in ks]
    # Among what is left, a pair alone with its shape, first and last name part (model vs
    # optim, weight vs exp_avg) is probably a rename.
    def kind(k: str, shape: tuple[int, ...]) -> tuple[tuple[int, ...], str, str]:
        parts = k.split(".")
        return (tuple(shape), parts[0], parts[-1])

    shapes_m: dict[tuple[tuple[int, ...], str, str], list[str]] = {}
    shapes_c: dict[tuple[tuple[int, ...], str, str], list[str]] = {}
    for k in still_model:
        shapes_m.setdefault(kind(k, model_keys[k]), []).append(k)
    for k in still_ckpt:
        shapes_c.setdefault(kind(k, ckpt_keys[k]), []).append(k)
    for key, ks in shapes_m.items():
        cs = shapes_c.get(key, [])
        if len(ks) == 1 and len(cs) == 1 and key[0] != ():
            diff.by_shape[cs[0]] = ks[0]
    diff.missing = sorted(still_model)
    diff.unread = sorted(still_ckpt)
    return diff
