"""Exact parameter counts per rank, by module and by kind (dense / expert), for our megatron model.

The counts follow the modules moe_sft builds (models/builder.py, layers/spec.py) on megatron-core
0.16.1; tests/cpu/test_plan.py builds tiny models per rank (a fake process group in one
process) and requires equality, module by module.

Splits: TP divides attention heads, the dense / shared-expert MLP and the (padded) vocabulary;
EP divides the routed experts, ETP the expert FFN width. Norms and the router are replicated.
With the torch-native spec the MLA down projections are column-parallel (split over TP); with
Transformer Engine they are duplicated on every TP rank (megatron's TELinear 'duplicated').
"""

from __future__ import annotations

from dataclasses import dataclass, field

from moe_sft.models.shape import ModelShape
from moe_sft.plan.layout import Layout, is_first_chunk, is_last_chunk, stage_layers


@dataclass
class Count:
    """Parameters of one rank, split by who shards their optimizer state."""

    dense: int = 0  # replicated over DP x CP: optimizer sharded over the DP x CP group
    expert: int = 0  # routed experts: optimizer sharded over the expert-DP group
    frozen: int = 0  # requires_grad=False (frozen MTP): weights only
    by_module: dict = field(default_factory=dict)

    def add(self, module: str, n: int, expert: bool = False, frozen: bool = False) -> None:
        if frozen:
            self.frozen += n
        elif expert:
            self.expert += n
        else:
            self.dense += n
        self.by_module[module] = self.by_module.get(module, 0) + n

    @property
    def total(self) -> int:
        return self.dense + self.expert + self.frozen


def linear_attention_params(s: ModelShape, tp: int) -> int:
    """One Gated DeltaNet mixer with its input norm: in_proj, conv1d, dt_bias, A_log (split over TP
    by head), the gated output norm (one head's width, whole) and out_proj."""
    la, h = s.linear_attention, s.hidden
    split = h * la.in_proj_width + la.conv_width * la.conv_kernel + 2 * la.value_heads
    return h + split // tp + la.value_dim + la.value_heads * la.value_dim * h // tp


def attention_params(s: ModelShape, tp: int, backend: str = "torch", layer: int | None = None) -> int:
    """One layer's mixer with its input norm; `layer` (a decoder layer index) picks Gated DeltaNet
    for a hybrid model's linear-attention layers."""
    if layer is not None and s.is_linear_layer(layer):
        return linear_attention_params(s, tp)
    h = s.hidden
    norms = h  # input_layernorm
    if s.mla is None:
        a = s.attention_of(layer)  # the layer's own dims where layers differ (Gemma 4)
        q_heads = s.num_heads * (2 if s.attention_gate else 1)
        kv_heads = (1 if a.k_eq_v else 2) * a.num_kv_heads  # k-eq-v: [q, k] per group
        qkv = (h + s.qkv_bias) * (q_heads + kv_heads) * a.head_dim // tp
        proj = s.num_heads * a.head_dim * h // tp
        qk_norm = 2 * a.head_dim if s.qk_norm else 0
        if s.qk_norm_full_width:  # one weight per q and k channel, split over TP with the heads
            qk_norm = (s.num_heads + a.num_kv_heads) * a.head_dim // tp
        proj_bias = h if s.linear_bias else 0  # a row-parallel bias: whole on every TP rank
        sinks = s.num_heads // tp if s.attention_sinks else 0
        out_norm = h if s.attention_output_norm else 0  # replicated
        return norms + qkv + proj + qk_norm + proj_bias + sinks + out_norm
    m = s.mla
    qhd = m.qk_nope + m.qk_rope
    down_tp = 1 if backend == "te" else tp  # TE: down projections duplicated on every TP rank
    if m.q_lora:
        q = h * m.q_lora // down_tp + m.q_lora + m.q_lora * s.num_heads * qhd // tp
    else:
        q = h * s.num_heads * qhd // tp
    kv = h * (m.kv_lora + m.qk_rope) // down_tp + m.kv_lora + m.kv_lora * s.num_heads * (m.qk_nope + m.v_head) // tp
    proj = s.num_heads * m.v_head * h // tp
    return norms + q + kv + proj


def mlp_params(s: ModelShape, moe: bool, lay: Layout) -> tuple[int, int]:
    """(dense, expert) parameters of one layer's MLP block including its pre-MLP norm."""
    h = s.hidden
    if not moe:
        return h + 3 * h * s.ffn // lay.tp, 0
    dense = s.moe_block_norms * h + s.num_experts * h  # norm(s) + router (replicated)
    if s.router_scales:  # Gemma 4's router: input scale [H], per-expert scale [E]
        dense += h + s.num_experts
    if s.shared_ffn:
        dense += 3 * h * s.shared_ffn // lay.tp + (h if s.shared_expert_gate else 0)
    expert = (s.num_experts // lay.ep) * 3 * h * s.moe_ffn // lay.etp
    if s.linear_bias:  # router bias; fc1 bias split like fc1, fc2 bias whole on every expert-TP rank
        dense += s.num_experts
        expert += (s.num_experts // lay.ep) * (2 * s.moe_ffn // lay.etp + h)
    return dense, expert


def mtp_extra_params(s: ModelShape, lay: Layout) -> int:
    """One MTP layer besides its transformer layer: enorm, hnorm, eh_proj, final norm."""
    return 3 * s.hidden + 2 * s.hidden * s.hidden // lay.tp


def chunk_params(
    s: ModelShape,
    lay: Layout,
    pp_rank: int,
    vp_stage: int,
    backend: str = "torch",
    mtp_frozen: bool = False,
    count: Count | None = None,
) -> Count:
    """Parameters of one model chunk (pipeline rank, virtual stage) on any of its ranks."""
    c = count or Count()
    first, last = is_first_chunk(lay, pp_rank, vp_stage), is_last_chunk(lay, pp_rank, vp_stage)
    vocab_part = s.padded_vocab // lay.tp * s.hidden
    mtp_here = last and s.mtp_layers > 0
    if first or mtp_here:  # GPTModel builds the embedding with pre_process or an MTP block
        c.add("embedding", vocab_part)
    if last:
        c.add("final_norm", s.hidden)
        if not (s.tie_embeddings and first):
            c.add("output_layer", vocab_part)
    for i in stage_layers(s.num_layers, lay, pp_rank)[vp_stage]:
        _add_layer(c, s, lay, s.moe_layers[i], backend, "layer", index=i)
    if mtp_here:
        for _ in range(s.mtp_layers):  # megatron: the MTP layer has the spec of the last layer
            c.add("mtp", mtp_extra_params(s, lay), frozen=mtp_frozen)
            _add_layer(c, s, lay, s.moe_layers[-1], backend, "mtp", frozen=mtp_frozen)
    return c


def _add_layer(
    c: Count, s: ModelShape, lay: Layout, moe: bool, backend: str, prefix: str, frozen: bool = False, index=None
) -> None:
    c.add(f"{prefix}.attention", attention_params(s, lay.tp, backend, index), frozen=frozen)
    dense, expert = mlp_params(s, moe, lay)
    c.add(f"{prefix}.mlp", dense, frozen=frozen)
    if expert:
        c.add(f"{prefix}.experts", expert, expert=True, frozen=frozen)


def stage_params(s: ModelShape, lay: Layout, pp_rank: int, backend: str = "torch", mtp_frozen: bool = False) -> Count:
    """All chunks of one pipeline rank (what one GPU of that stage holds)."""
    c = Count()
    for v in range(lay.vp):
        chunk_params(s, lay, pp_rank, v, backend, mtp_frozen, count=c)
    return c


def total_params(s: ModelShape) -> int:
    """The whole model (TP=PP=EP=1), MTP included."""
    one = Layout(world=1, tp=1, pp=1, vpp=None, cp=1, ep=1, etp=1)
    return stage_params(s, one, 0).total


def active_params_per_token(s: ModelShape) -> int:
    """Matmul parameters one token passes through (for FLOPs): top-k experts, not all of them."""
    h, total = s.hidden, 0
    one = Layout(world=1, tp=1, pp=1, vpp=None, cp=1, ep=1, etp=1)
    for i, moe in enumerate(list(s.moe_layers) + [s.moe_layers[-1]] * s.mtp_layers):
        total += attention_params(s, 1, layer=i) - h - (h if s.attention_output_norm else 0)  # less norms
        if moe:
            total += s.num_experts * h + 3 * h * s.shared_ffn + s.topk * 3 * h * s.moe_ffn
        else:
            total += 3 * h * s.ffn
    total += s.mtp_layers * (mtp_extra_params(s, one) - 3 * h)
    return total + (1 + s.mtp_layers) * s.padded_vocab * h  # LM head per prediction depth
