"""Selecting parameters by name: freezing (before DDP and the optimizer see them) and weight-decay
exclusions (param-group overrides for the optimizer).

Names are megatron's parameter names with *global* layer numbers (`decoder.layers.{i}` counts
from the first layer of the model, whichever pipeline stage holds it), so a pattern means the same
thing at every layout. A pattern that matches nothing on any rank is an error (a typo would
otherwise train everything silently).
"""

from __future__ import annotations

import fnmatch
import re

import torch
import torch.distributed as dist

_LOCAL_LAYER = re.compile(r"^decoder\.layers\.(\d+)\.")
ROUTER_PATTERN = "*.mlp.router.*"


def global_named_parameters(chunk):
    """(name with global layer numbers, parameter) of one model chunk."""
    layers = chunk.decoder.layers if getattr(chunk, "decoder", None) is not None else []
    for name, param in chunk.named_parameters():
        if match := _LOCAL_LAYER.match(name):
            global_index = layers[int(match.group(1))].layer_number - 1  # layer_number is 1-based
            name = f"decoder.layers.{global_index}." + name[match.end() :]
        yield name, param


def match_parameters(chunks, patterns: list[str], field: str, device: str) -> list[tuple[str, torch.nn.Parameter]]:
    """(global name, parameter) of every parameter matching one of `patterns` (fnmatch). A
    pattern that matches nothing on any rank is an error naming `field` (the recipe key)."""
    hits = torch.zeros(len(patterns), device=device)
    found = []
    for chunk in chunks:
        for name, param in global_named_parameters(chunk):
            matched = [i for i, p in enumerate(patterns) if fnmatch.fnmatchcase(name, p)]
            for i in matched:
                hits[i] += 1
            if matched:
                found.append((name, param))
    dist.all_reduce(hits)
    unmatched = [p for p, n in zip(patterns, hits.tolist()) if n == 0]
    if unmatched:
        example = next(iter(global_named_parameters(chunks[0])), ("?", None))[0]
        from moe_sft.config import ConfigError

        raise ConfigError(
            f"{field} {unmatched} match no parameter on any rank; names "
            f"look like {example!r} (global layer numbers; fnmatch: * matches dots too)"
        )
    return found


def freeze(chunks, patterns: list[str], device: str) -> tuple[int, list[str]]:
    """requires_grad=False for every parameter matching a pattern; (frozen elements here, names)."""
    if not patterns:
        return 0, []
    frozen, names = 0, []
    for name, param in match_parameters(chunks, patterns, "model.freeze_patterns", device):
        if param.requires_grad:
            param.requires_grad_(False)
            frozen += param.numel()
            names.append(name)
    return frozen, names


def weight_decay_overrides(optimizer_config, chunks, patterns: list[str], device: str) -> tuple[dict, int]:
    """megatron's standard param-group overrides (no decay on biases and 1-D parameters) plus no
    decay on parameters matching `patterns`; and how many tensors here the patterns matched."""
    from megatron.core.optimizer import get_standard_config_overrides
    from megatron.core.optimizer.optimizer_config import ParamKey, ParamPredicate

    overrides = get_standard_config_overrides(config=optimizer_config)
    if not patterns:
        return overrides, 0
    found = match_parameters(chunks, patterns, "optimizer.no_weight_decay_patterns", device)
    ids = {id(param) for _, param in found}
    # the predicate's name keys the param group; it is the same on every rank
    overrides[ParamKey(predicate=ParamPredicate(name="no_weight_decay_patterns", fn=lambda p: id(p) in ids))] = {
        "wd_mult": 0.0
    }
    return overrides, len(found)
