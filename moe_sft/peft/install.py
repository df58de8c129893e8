"""Adding the adapters: freeze the base, place one adapter beside every targeted module (before
megatron's DDP sees the parameters), and draw A the same way at every layout."""

from __future__ import annotations

import fnmatch
import math
import zlib

import torch
from megatron.core import parallel_state
from megatron.core.tensor_parallel.layers import ColumnParallelLinear

from moe_sft.config import ConfigError, PeftConfig
from moe_sft.layers.experts import TorchGroupedMLP
from moe_sft.peft import coverage, targets
from moe_sft.peft.experts import ExpertAdapter
from moe_sft.peft.linear import LinearAdapter, Part, add_adapter_output, norms_once
from moe_sft.peft.state import adapters

ROUTER_PATTERN = "*.mlp.router.*"
EMBEDDING_PATTERNS = ("embedding.*", "output_layer.*")


def initial_a(seed: int, name: str, rows: int, full_in: int, experts: int | None = None) -> torch.Tensor:
    """The starting A of one adapter factor (`name`: global module name + factor), drawn on the CPU
    from its own seed: peft's kaiming-uniform (a=sqrt(5)), bound 1/sqrt(fan_in), for the whole input
    dim (and every expert: experts x full_in x rows), so every layout starts from the same adapters
    and tests can rebuild them."""
    generator = torch.Generator().manual_seed(seed * 1_000_003 + zlib.crc32(name.encode()))
    bound = 1 / math.sqrt(full_in)
    shape = (rows, full_in) if experts is None else (experts, full_in, rows)
    return torch.empty(shape).uniform_(-bound, bound, generator=generator)


def _parts(name: str, module, tconfig) -> tuple[list[Part], int]:
    """The projections a fused linear holds (as transformers keeps them apart), and how their
    rows interleave (query groups of linear_qkv)."""
    out_local = module.weight.shape[0]
    if name.endswith("self_attention.linear_qkv"):
        tp = parallel_state.get_tensor_model_parallel_world_size()
        config = getattr(module, "config", tconfig)  # a Gemma 4 layer's own head dim and kv heads
        groups = config.num_query_groups // tp
        # a gated attention's q_proj emits each head's query and output gate: per query group
        # megatron holds [queries, gates] where q_proj interleaves them per head (the export's
        # transform reorders B's rows as it does the weight's)
        q = config.num_attention_heads // tp * config.kv_channels * (2 if config.attention_output_gate else 1)
        kv = groups * config.kv_channels
        # a k-eq-v layer (Gemma 4's full layers) holds [queries, key] per group: its key is its value
        value = [] if out_local == q + kv else [Part("v", kv)]
        return [Part("q", q), Part("k", kv), *value], groups
    if name.endswith("self_attention.in_proj") and getattr(tconfig, "linear_attention_layers", None):
        return _in_proj_parts(name, tconfig), 1
    if name.endswith("linear_fc1") and tconfig.gated_linear_unit:
        return [Part("gate", out_local // 2), Part("up", out_local // 2)], 1
    return [Part("", out_local)], 1


def _in_proj_parts(name: str, tconfig) -> list[Part]:
    """Gated DeltaNet's in_proj: [q, k, v, z, b, a], each split over TP, with one A per
    transformers projection (the family's `linear_attention_projections`)."""
    tp = parallel_state.get_tensor_model_parallel_world_size()
    qk = tconfig.linear_num_key_heads * tconfig.linear_key_head_dim // tp
    v = tconfig.linear_num_value_heads * tconfig.linear_value_head_dim // tp
    heads = tconfig.linear_num_value_heads // tp
    rows = dict(q=qk, k=qk, v=v, z=v, b=heads, a=heads)
    projections = tuple(getattr(tconfig, "linear_attention_projections", None) or ())
    if "".join(projections) != "".join(rows):
        raise ConfigError(
            f"{name}: a LoRA needs the transformers projections that make up this Gated DeltaNet's in_proj "
            f"(linear_attention_projections={projections!r}, which must name its parts {''.join(rows)!r} in "
            "order); the model family sets it. Leave the Gated DeltaNet out of peft.target_modules meanwhile"
        )
    # the parts of each projection, in row order: "qkv" -> q, k, v; "ba" -> b, a
    names, owner = list(rows), {}
    for projection in projections:
        taken = ""
        while taken != projection:
            part = names.pop(0)
            taken += part
            owner[part] = projection
    return [Part(p, rows[p], owner[p]) for p in rows]


def _check_rank(cfg: PeftConfig, name: str, dims: dict[str, int]) -> None:
    too_small = {k: v for k, v in dims.items() if v < cfg.rank}
    if too_small:
        raise ConfigError(
            f"peft.rank={cfg.rank} exceeds {name}'s {', '.join(f'{k}={v}' for k, v in too_small.items())}: "
            f"a rank above a projection's dims adds nothing; lower peft.rank to <= {min(dims.values())} "
            "or leave this module out of peft.target_modules"
        )


def _linear_adapter(cfg: PeftConfig, global_name: str, module, tconfig, capped: dict[str, int]) -> LinearAdapter:
    """`capped` collects the Gated DeltaNet gate projections (transformers' name: rows) narrower
    than the rank, left out of the rank check (targets.GDN_GATE_PARTS)."""
    column = isinstance(module, ColumnParallelLinear)
    parts, groups = _parts(global_name, module, tconfig)
    tp_group = getattr(module, "tp_group", None) or parallel_state.get_tensor_model_parallel_group()
    tp = torch.distributed.get_world_size(tp_group)
    in_local = module.weight.shape[1]
    full_in = in_local if column else in_local * tp
    outs = {}  # per A: the rows of the transformers projection it serves
    for p in parts:
        key = f"out[{p.a}]" if p.a else "out"
        outs[key] = outs.get(key, 0) + p.out_local * (tp if column else 1)
    if global_name.endswith("self_attention.in_proj"):
        for a in list(dict.fromkeys(p.a for p in parts)):
            if targets.is_gdn_gate(a) and outs[f"out[{a}]"] < cfg.rank:
                capped[f"in_proj_{a}"] = outs.pop(f"out[{a}]")
    _check_rank(cfg, global_name, {"in": full_in, **outs})
    adapter = LinearAdapter(
        module,
        column=column,
        parts=parts,
        groups=groups,
        # one DoRA magnitude per part where the parts are concatenated (each split over TP on its
        # own); linear_qkv's rows interleave per query group, which TP splits whole
        split_magnitude=not global_name.endswith("self_attention.linear_qkv"),
        rank=cfg.rank,
        alpha=cfg.alpha,
        dropout=cfg.dropout,
        dora=cfg.method == "dora",
        tp_group=tp_group,
        sequence_parallel=bool(getattr(module, "sequence_parallel", False)),
    )
    in_offset = 0 if column else torch.distributed.get_rank(tp_group) * in_local
    adapter.reset_a(lambda part: initial_a(cfg.init_seed, f"{global_name}:{part}", cfg.rank, full_in), in_offset)
    module.register_forward_hook(add_adapter_output)
    return adapter


def _expert_adapter(cfg: PeftConfig, global_name: str, module: TorchGroupedMLP) -> ExpertAdapter:
    if cfg.method == "dora":
        raise ConfigError(
            "peft.method=dora on routed experts is not supported (nor by peft for fused expert parameters); "
            "use peft.method=lora, or leave 'experts' out of peft.target_modules (DoRA then covers the "
            "attention, dense MLPs and shared experts)"
        )
    hidden = module.config.hidden_size
    ffn = (
        module.weight2.numel()
        // module.num_local_experts
        // hidden
        * parallel_state.get_expert_tensor_parallel_world_size()
    )
    _check_rank(cfg, global_name, {"hidden": hidden, "expert ffn": ffn})
    adapter = ExpertAdapter(module, rank=cfg.rank, alpha=cfg.alpha, dropout=cfg.dropout, share=cfg.share_expert_factor)
    ep_rank = parallel_state.get_expert_model_parallel_rank()
    ep = parallel_state.get_expert_model_parallel_world_size()
    experts = 1 if cfg.share_expert_factor == "a" else ep * module.num_local_experts
    adapter.reset_a(
        lambda name, full_in: initial_a(cfg.init_seed, f"{global_name}:{name}", cfg.rank, full_in, experts),
        parallel_state.get_expert_tensor_parallel_rank(),
        ep_rank * module.num_local_experts,
    )
    return adapter


def add_adapters(chunks, cfg: PeftConfig, tconfig, device: str) -> list[str]:
    """Freezes every base parameter, adds the adapters, unfreezes the routers if asked; the log lines."""
    for chunk in chunks:
        chunk.is_adapted = True  # checkpoints then hold the trained part only (moe_sft/peft/state.py)
        for param in chunk.parameters():
            param.requires_grad_(False)
    # The aux-loss-free expert bias is base state (a buffer): an adapters-only checkpoint and the
    # exported adapter do not hold it, so its updates would be lost on resume and export. Frozen.
    tconfig.moe_router_bias_update_rate = 0.0
    found = targets.resolve(chunks, list(cfg.target_modules), device)
    capped: dict[str, int] = {}
    for global_name, _, _, module in found:
        if isinstance(module, TorchGroupedMLP):
            module.adapter = _expert_adapter(cfg, global_name, module)
        else:
            module.adapter = _linear_adapter(cfg, global_name, module, tconfig, capped)
    trained_in_full = ((ROUTER_PATTERN,) if cfg.train_router else ()) + (
        EMBEDDING_PATTERNS if cfg.train_embeddings else ()
    )
    for chunk in chunks:
        for name, param in chunk.named_parameters():
            if any(fnmatch.fnmatchcase(name, p) for p in trained_in_full):
                param.requires_grad_(True)
    for chunk in chunks:
        if getattr(chunk, "pre_process", False) and not cfg.train_embeddings:
            chunk.embedding.register_forward_hook(_activations_require_grad)
    trained = sum(p.numel() for c in chunks for p in c.parameters() if p.requires_grad)
    kinds = sorted({targets_kind(n) for n, *_ in found})
    lines = [
        f"peft: {cfg.method} rank {cfg.rank} alpha {cfg.alpha:g} on {len(found)} modules ({', '.join(kinds)}); "
        f"{trained / 1e6:.3f}M trainable parameters on this rank, the base frozen"
    ]
    lines.append(coverage.coverage_line(chunks, {n for n, *_ in found}, cfg, tconfig, device))
    if capped:
        lines.append(
            f"peft: the Gated DeltaNet gate projections {', '.join(f'{k} ({v} rows)' for k, v in capped.items())} "
            f"are narrower than rank {cfg.rank}: their updates' rank is capped by their widths (exact, the "
            "extra rank is redundant there)"
        )
    return lines


def _activations_require_grad(module, args, output):
    """The frozen embedding's output as a tensor that requires grad: megatron's full recompute
    (`tensor_parallel.checkpoint`) passes gradients only through inputs that require them, so behind
    a frozen embedding every adapter's gradient was silently zero."""
    return output if output.requires_grad else output.detach().requires_grad_(True)


def targets_kind(global_name: str) -> str:
    return global_name.split(".", 3)[-1]


def dora_norms_once(chunks):
    """Context: inside, each DoRA adapter of `chunks` computes its weight norm once (peft/linear.py
    `norms_once`); for one step's forward-backward or an evaluation, where the weights stay put."""
    return norms_once(adapter for chunk in chunks for _, _, adapter in adapters(chunk))


def init_dora_magnitudes(chunks) -> None:
    """DoRA's magnitude starts as each output row's norm of the loaded base weight (peft)."""
    for chunk in chunks:
        for _, local, adapter in adapters(chunk):
            if isinstance(adapter, LinearAdapter) and adapter.dora:
                base = chunk.get_submodule(local)
                with torch.no_grad():
                    adapter.set_magnitude(adapter._row_norm(base.weight.float()))
