"""The `peft.target_modules` shorthands: fnmatch patterns over module names with global layer
numbers. Torch-free (config/), so the planner, the config checks and the trainer match the same modules."""

from __future__ import annotations

_LAYER = "decoder.layers.*."
SHORTHANDS: dict[str, tuple[str, ...]] = {
    # the mixers: attention's linear_* and, in hybrid models, Gated DeltaNet's in_proj / out_proj
    "attention": (
        _LAYER + "self_attention.linear_*",
        _LAYER + "self_attention.in_proj",
        _LAYER + "self_attention.out_proj",
    ),
    "dense_mlp": (_LAYER + "mlp.linear_fc1", _LAYER + "mlp.linear_fc2"),
    "shared_experts": (_LAYER + "mlp.shared_experts.linear_fc1", _LAYER + "mlp.shared_experts.linear_fc2"),
    "experts": (_LAYER + "mlp.experts",),
}
SHORTHANDS["all_linear"] = tuple(p for v in SHORTHANDS.values() for p in v)


def patterns(entry: str) -> tuple[str, ...]:
    """A target entry's patterns: a shorthand's, or the entry itself."""
    return SHORTHANDS.get(entry, (entry,))
