"""Parameters and bytes of a LoRA / DoRA run on one pipeline stage (peft.method != none).

Everything of the base is frozen: it costs its weights only, in bf16, or with peft.fp8_base in
FP8 (1 byte per value + a 4-byte fp32 scale per 128x128 block of every FP8 matrix; per expert for
the grouped experts). The embedding, the LM head, norms and routers stay bf16. What trains (the
adapters, plus the routers / embeddings on request) costs bf16 weights, fp32 main grads and the
distributed optimizer's fp32 master + Adam moments, sharded over DP x CP (dense) or expert DP
(the per-expert factors), exactly as megatron's DDP and optimizer treat them.

Per module (tests/cpu/test_plan.py compares with a real adapted model, module by module):
- a linear (out x in on its rank): one A (r x in_local) and B (out_part x r) per fused part
  (q/k/v of GQA's linear_qkv, gate/up of a gated fc1), DoRA adds one magnitude per output row;
- the grouped experts: A1 (n x h x r), B1 per gate/up (n x r x ffn/etp), A2 (n x ffn/etp x r),
  B2 (n x r x h), n the local experts (1 for a factor shared by the layer's experts: dense).
The FP8 dequantisation adds one layer's largest dequantised weight (bf16) plus at most 256 MiB of
fp32 temporaries to the backward working set (moe_sft/peft/fp8_base.py).
"""

from __future__ import annotations

import fnmatch
from dataclasses import dataclass, field

from moe_sft.config.peft_shorthands import patterns
from moe_sft.models.shape import ModelShape
from moe_sft.plan.layout import Layout, is_last_chunk, stage_layers

FP8_BLOCK = 128
DEQUANT_TEMP_BYTES = 2**28  # fp8_base._CHUNK_ELEMENTS x 4 bytes (fp32)


@dataclass(frozen=True)
class PeftPlan:
    """What the memory of an adapted run depends on (from the recipe's peft section)."""

    method: str = "lora"
    rank: int = 16
    target_modules: tuple[str, ...] = ("attention", "experts")
    share_expert_factor: str = "none"
    fp8_base: bool = False
    train_router: bool = False
    train_embeddings: bool = False


@dataclass(frozen=True)
class Linear:
    """One Column/RowParallelLinear of a layer on one rank (megatron's local weight: out x in)."""

    name: str  # e.g. self_attention.linear_qkv (after decoder.layers.{i}.)
    out_local: int
    in_local: int
    column: bool
    parts: int = 1  # fused projections: q/k/v, gate/up


@dataclass
class PeftStage:
    base_bytes: float = 0.0  # frozen base weights (bf16 or FP8 + scales) incl. embedding/head/norms
    fp8_values: int = 0  # base values held in FP8
    fp8_scales: int = 0  # their fp32 block scales
    dense: int = 0  # trainable, optimizer sharded over DP x CP
    expert: int = 0  # trainable per-expert factors, optimizer sharded over expert DP
    adapters: int = 0  # adapter parameters (dense + expert, routers / embeddings excluded)
    trained_base: int = 0  # base parameters trained all the same: routers, embeddings on request
    dequant_peak: float = 0.0  # transient bytes of one dequantised weight (fp8_base)
    by_module: dict = field(default_factory=dict)


def _blocks(rows: int, cols: int) -> int:
    return -(-rows // FP8_BLOCK) * -(-cols // FP8_BLOCK)


def layer_linears(s: ModelShape, lay: Layout, moe: bool, layer: int | None = None) -> list[Linear]:
    """The Column/RowParallelLinear of one decoder layer on one rank (torch-native spec); `layer`
    (its global index) picks Gated DeltaNet for a hybrid model's linear-attention layers."""
    h, tp = s.hidden, lay.tp
    out: list[Linear] = []
    if layer is not None and s.is_linear_layer(layer):
        la = s.linear_attention  # in_proj: one LoRA A per transformers projection (peft/install.py)
        out.append(Linear("self_attention.in_proj", la.in_proj_width // tp, h, True, len(la.projections)))
        out.append(Linear("self_attention.out_proj", h, la.value_heads * la.value_dim // tp, False))
    elif s.mla is None:
        a = s.attention_of(layer)  # the layer's own dims where layers differ (Gemma 4)
        q_heads = s.num_heads * (2 if s.attention_gate else 1)  # a gated attention's q: query and gate
        parts = 2 if a.k_eq_v else 3  # k-eq-v: [q, k] per group, one LoRA A each (peft/install.py)
        qkv = (q_heads + (parts - 1) * a.num_kv_heads) * a.head_dim // tp
        out.append(Linear("self_attention.linear_qkv", qkv, h, True, parts))
        out.append(Linear("self_attention.linear_proj", h, s.num_heads * a.head_dim // tp, False))
    else:
        m = s.mla
        qhd = m.qk_nope + m.qk_rope
        if m.q_lora:
            out.append(Linear("self_attention.linear_q_down_proj", m.q_lora // tp, h, True))
            out.append(Linear("self_attention.linear_q_up_proj", s.num_heads * qhd // tp, m.q_lora, True))
        else:
            out.append(Linear("self_attention.linear_q_proj", s.num_heads * qhd // tp, h, True))
        out.append(Linear("self_attention.linear_kv_down_proj", (m.kv_lora + m.qk_rope) // tp, h, True))
        kv_up = s.num_heads * (m.qk_nope + m.v_head) // tp
        out.append(Linear("self_attention.linear_kv_up_proj", kv_up, m.kv_lora, True))
        out.append(Linear("self_attention.linear_proj", h, s.num_heads * m.v_head // tp, False))
    if not moe:
        out.append(Linear("mlp.linear_fc1", 2 * s.ffn // tp, h, True, 2))
        out.append(Linear("mlp.linear_fc2", h, s.ffn // tp, False))
    elif s.shared_ffn:
        out.append(Linear("mlp.shared_experts.linear_fc1", 2 * s.shared_ffn // tp, h, True, 2))
        out.append(Linear("mlp.shared_experts.linear_fc2", h, s.shared_ffn // tp, False))
    return out


def targeted(name: str, entries: tuple[str, ...]) -> bool:
    """`name`: global module name (decoder.layers.{i}.…), matched as moe_sft/peft/targets.py does."""
    return any(fnmatch.fnmatchcase(name, pat) for e in entries for pat in patterns(e))


def adapts_experts(p: PeftPlan) -> bool:
    """Whether the routed experts get adapters (any layer: the targets name modules, not layers)."""
    return targeted("decoder.layers.0.mlp.experts", p.target_modules)


def linear_adapter(lin: Linear, p: PeftPlan) -> int:
    column_in = lin.in_local
    n = p.rank * column_in * lin.parts + lin.out_local * p.rank
    return n + (lin.out_local if p.method == "dora" else 0)


def expert_adapter(s: ModelShape, lay: Layout, p: PeftPlan) -> tuple[int, int]:
    """(dense, expert) adapter parameters of one layer's grouped experts on one rank."""
    n, h, r = s.num_experts // lay.ep, s.hidden, p.rank
    f = s.moe_ffn // lay.etp
    a = (h * r + f * r) * (1 if p.share_expert_factor == "a" else n)
    b = (2 * r * f + r * h) * (1 if p.share_expert_factor == "b" else n)  # gated: gate and up
    dense = (a if p.share_expert_factor == "a" else 0) + (b if p.share_expert_factor == "b" else 0)
    return dense, a + b - dense


def _add_layer(st: PeftStage, s: ModelShape, lay: Layout, moe: bool, p: PeftPlan, layer: int | None) -> None:
    """One decoder layer (global index `layer`; None: an MTP layer, which no adapter reaches)."""
    tag = f"decoder.layers.{layer}" if layer is not None else "mtp"
    for lin in layer_linears(s, lay, moe, layer):
        numel = lin.out_local * lin.in_local
        if p.fp8_base:
            st.fp8_values += numel
            st.fp8_scales += _blocks(lin.out_local, lin.in_local)
            st.dequant_peak = max(st.dequant_peak, 2 * numel + min(4 * numel, DEQUANT_TEMP_BYTES))
        if layer is not None and targeted(f"{tag}.{lin.name}", p.target_modules):
            n = linear_adapter(lin, p)
            st.dense += n
            st.adapters += n
            st.by_module[f"{tag}.{lin.name}"] = n
    if not moe:
        return
    n_local, h, f = s.num_experts // lay.ep, s.hidden, s.moe_ffn // lay.etp
    if p.fp8_base:
        st.fp8_values += n_local * 3 * h * f
        st.fp8_scales += n_local * (_blocks(h, 2 * f) + _blocks(f, h))
        w1 = n_local * h * 2 * f
        st.dequant_peak = max(st.dequant_peak, 2 * w1 + min(4 * w1, DEQUANT_TEMP_BYTES))
    if p.train_router:  # peft/install.py's router pattern reaches the MTP layer's router too
        st.dense += s.num_experts * h
        st.trained_base += s.num_experts * h
    if layer is not None and targeted(f"{tag}.mlp.experts", p.target_modules):
        dense, expert = expert_adapter(s, lay, p)
        st.dense, st.expert, st.adapters = st.dense + dense, st.expert + expert, st.adapters + dense + expert
        st.by_module[f"{tag}.mlp.experts"] = dense + expert


def stage(s: ModelShape, lay: Layout, pp_rank: int, p: PeftPlan, total_params: int, embedding_params: int) -> PeftStage:
    """The PEFT terms of one pipeline stage. `total_params`: all its base parameters (params.py);
    `embedding_params`: those of its embedding and LM head (trainable with train_embeddings)."""
    st = PeftStage()
    for chunk in stage_layers(s.num_layers, lay, pp_rank):
        for i in chunk:
            _add_layer(st, s, lay, s.moe_layers[i], p, i)
    if is_last_chunk(lay, pp_rank, lay.vp - 1):
        for _ in range(s.mtp_layers):  # MTP: frozen (no adapter pattern reaches mtp.*), FP8 like the decoder
            _add_layer(st, s, lay, s.moe_layers[-1], p, None)
            if p.fp8_base:  # eh_proj (2h -> h, column-parallel)
                st.fp8_values += 2 * s.hidden * s.hidden // lay.tp
                st.fp8_scales += _blocks(s.hidden // lay.tp, 2 * s.hidden)
    if p.train_embeddings:
        st.dense += embedding_params
        st.trained_base += embedding_params
    bf16 = total_params - st.fp8_values - st.trained_base  # frozen, not FP8: 2 bytes
    st.base_bytes = bf16 * 2 + st.fp8_values + st.fp8_scales * 4
    return st


def from_config(peft) -> PeftPlan | None:
    if peft.method == "none":
        return None
    return PeftPlan(
        method=peft.method,
        rank=peft.rank,
        target_modules=tuple(peft.target_modules),
        share_expert_factor=peft.share_expert_factor,
        fp8_base=peft.fp8_base,
        train_router=peft.train_router,
        train_embeddings=getattr(peft, "train_embeddings", False),
    )
