"""Where adapters go: `peft.target_modules` entries (shorthands or fnmatch patterns) resolved to
the model's adaptable modules, named with global layer numbers so a pattern means the same module
at every pipeline layout."""

from __future__ import annotations

import fnmatch
import re

import torch
import torch.distributed as dist
from megatron.core.tensor_parallel.layers import ColumnParallelLinear, RowParallelLinear

from moe_sft.config import ConfigError
from moe_sft.config.peft_shorthands import SHORTHANDS, patterns
from moe_sft.layers.experts import TorchGroupedMLP

_LOCAL_LAYER = re.compile(r"^decoder\.layers\.(\d+)\.")


def is_adaptable(module: torch.nn.Module) -> bool:
    return isinstance(module, (ColumnParallelLinear, RowParallelLinear, TorchGroupedMLP))


def global_module_name(chunk, name: str) -> str:
    """`decoder.layers.{local}.…` → `decoder.layers.{global}.…` (global = the model's layer index)."""
    if match := _LOCAL_LAYER.match(name):
        global_index = chunk.decoder.layers[int(match.group(1))].layer_number - 1
        return f"decoder.layers.{global_index}." + name[match.end() :]
    return name


def adaptable_modules(chunk):
    """(global name, local name, module) of every module an adapter can sit beside (the LM head
    and embeddings excluded: their adapters would not be peft's either)."""
    for name, module in chunk.named_modules():
        if is_adaptable(module) and not name.startswith(("output_layer", "embedding")):
            yield global_module_name(chunk, name), name, module


def resolve(chunks, entries: list[str], device: str) -> list[tuple[str, str, int, torch.nn.Module]]:
    """(global name, local name, chunk index, module) of every targeted module. An entry that matches
    nothing on any rank is an error listing the module names that exist (per kind)."""
    hits = torch.zeros(len(entries), device=device)
    found, names = [], set()
    for index, chunk in enumerate(chunks):
        for global_name, local_name, module in adaptable_modules(chunk):
            names.add(re.sub(r"layers\.\d+\.", "layers.*.", global_name))
            matched = [
                i for i, e in enumerate(entries) if any(fnmatch.fnmatchcase(global_name, p) for p in patterns(e))
            ]
            for i in matched:
                hits[i] += 1
            if matched:
                found.append((global_name, local_name, index, module))
    dist.all_reduce(hits)
    unmatched = [e for e, n in zip(entries, hits.tolist()) if n == 0]
    if unmatched:
        raise ConfigError(
            f"peft.target_modules: {unmatched} match no module of this model. Shorthands: "
            f"{', '.join(SHORTHANDS)}; the adaptable modules here are {sorted(names)} "
            f"(patterns are fnmatch over these names with global layer numbers){_transformers_hint(unmatched)}"
        )
    return found


# transformers' projection names → the megatron module that holds them (fused with others where
# the module lists several): an entry names megatron's modules, and adapts a fused one whole
HF_PROJECTIONS = {
    "q_proj": "self_attention.linear_qkv",
    "k_proj": "self_attention.linear_qkv",
    "v_proj": "self_attention.linear_qkv",
    "o_proj": "self_attention.linear_proj",
    "in_proj_qkvz": "self_attention.in_proj",
    "in_proj_ba": "self_attention.in_proj",
    "in_proj_qkv": "self_attention.in_proj",
    "in_proj_z": "self_attention.in_proj",
    "in_proj_b": "self_attention.in_proj",
    "in_proj_a": "self_attention.in_proj",
    "gate_proj": "mlp.linear_fc1",
    "up_proj": "mlp.linear_fc1",
    "down_proj": "mlp.linear_fc2",
}


def _transformers_hint(unmatched: list[str]) -> str:
    named = {e: HF_PROJECTIONS[e.rpartition(".")[2]] for e in unmatched if e.rpartition(".")[2] in HF_PROJECTIONS}
    if not named:
        return ""
    return (
        ". Entries name megatron's modules, not transformers': "
        + "; ".join(f"{e} is (part of) decoder.layers.*.{m}" for e, m in named.items())
        + ". A fused module is adapted whole, with one adapter per transformers projection it holds "
        "(the PEFT export writes them under transformers' names); one projection of a fused module "
        "alone cannot be targeted"
    )


# Gated DeltaNet's gate projections: Qwen3.5's in_proj_b / in_proj_a (one output row per value
# head: 32 in Qwen3.5-35B-A3B, 16 per rank at TP2), Qwen3-Next's in_proj_ba (two). A rank above
# their width is exact, only redundant there (the update B @ A cannot exceed it; peft accepts it
# too), so they do not cap peft.rank for the whole attention; every other width still does.
GDN_GATE_PARTS = frozenset("ba")


def is_gdn_gate(projection: str) -> bool:
    """Whether an in_proj projection ("b", "a", "ba"; the family's linear_attention_projections)
    holds only gate rows."""
    return bool(projection) and set(projection) <= GDN_GATE_PARTS


def smallest_dims(shape) -> dict[str, int]:
    """Per shorthand, the smallest input or output width among its projections (a ModelShape),
    the Gated DeltaNet's gate projections left out (see GDN_GATE_PARTS)."""
    if shape.mla is not None:
        attention = min(d for d in (shape.hidden, shape.mla.q_lora, shape.mla.kv_lora) if d)
    else:
        attention = min(shape.hidden, shape.num_kv_heads * shape.head_dim)
    if (la := shape.linear_attention) is not None and any(la.layers):
        # Gated DeltaNet: each of transformers' in_proj projections but the gates, and out_proj's input
        widths = [w for p, w in la.projection_widths().items() if not is_gdn_gate(p)]
        attention = min(attention, la.value_heads * la.value_dim, *widths)
    dims = {"attention": attention}
    if not all(shape.moe_layers):
        dims["dense_mlp"] = min(shape.hidden, shape.ffn)
    if shape.shared_ffn:
        dims["shared_experts"] = min(shape.hidden, shape.shared_ffn)
    if shape.num_experts:
        dims["experts"] = min(shape.hidden, shape.moe_ffn)
    dims["all_linear"] = min(dims.values())
    return dims


def rank_errors(rank: int, entries: list[str], shape) -> list[str]:
    """peft.rank against the model's widths, from its shape alone (before the model is built);
    the exact per-module check runs again when the adapters are added."""
    dims = smallest_dims(shape)
    return [
        f"peft.rank={rank} exceeds the smallest projection width of '{entry}' in this model ({dims[entry]}); "
        f"lower peft.rank to <= {dims[entry]} (typical: 8-64)"
        for entry in entries
        if entry in dims and rank > dims[entry]
    ]
