"""Model FLOPs of a training step, MoE and MLA aware, and the peak used for MFU.

One training step costs 3x the forward matmul FLOPs (forward, plus backward = grad w.r.t. inputs
and grad w.r.t. weights, each as large as the forward; Kaplan et al. 2020, Narayanan et al. 2021).
Recomputation is not counted (model FLOPs, not hardware FLOPs: MFU, not HFU). A matmul of an
[m, k] by a [k, n] matrix is 2mkn FLOPs. Per token, forward (H = hidden size, V = vocabulary):

  GQA attention projections   2H(n_h d + 2 n_kv d) + 2 n_h d H          (q, k, v, o)
  MLA attention projections   q:  2H r_q + 2 r_q n_h (d_nope + d_rope)  (q_lora_rank r_q; or
                                  2H n_h (d_nope + d_rope) without it)
                              kv: 2H (r_kv + d_rope) + 2 r_kv n_h (d_nope + d_v)
                              o:  2 n_h d_v H
  dense MLP (SwiGLU)          3 * 2 H F                                  (gate, up, down)
  MoE MLP                     2 H E (router) + k * 3 * 2 H F_e (the k active experts only)
                              + 3 * 2 H F_s (shared experts, F_s = their summed width)
  LM head                     2 H V
  MTP layer (when run)        2 (2H) H (eh_proj) + one decoder layer + 2 H V (its LM head)

Attention scores, per document of length L (never pack_length^2: documents in a packed row do
not attend to each other) and per attention layer (MTP layers included):
  QK^T and AV                 P(L) * 2 n_h (d_qk + d_v),  d_qk = d (GQA) or d_nope + d_rope (MLA)
  P(L) = L (L + 1) / 2 query-key pairs with the causal mask (what a flash kernel computes);
  L^2 with `causal=False` (what an eager implementation computes; used by the tests).
A 2-layer MLP without a gate (gated_linear_unit false) uses 2 matmuls instead of 3.
Embedding lookups, norms, rotary, softmax and activations are not matmuls and are not counted.
Only real tokens count: the padding segment of a micro-batch is wasted work, not model FLOPs.
The LM head counts every real token, as megatron's formula does, although the trainer runs it
only over the tokens that carry loss (moe_sft/trainer/loss_rows.py): on the benchmark's data that
leaves 11-12% (Qwen3-30B-A3B shape) and 19-21% (reduced DeepSeek-V3, two heads) of these FLOPs
unexecuted; docs/benchmarks.md gives both figures.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Optional, Sequence

from moe_sft.data.packing import document_spans

# Peak dense bf16 tensor-core TFLOP/s per GPU (no sparsity), from the vendors' data sheets.
# Matched in order against torch.cuda.get_device_name(); the first match wins.
PEAK_BF16_TFLOPS: tuple[tuple[str, float], ...] = (
    ("GB200", 2500.0), ("B200", 2250.0),
    ("H100 PCIe", 756.0), ("H100 NVL", 835.0), ("H100", 989.0), ("H200", 989.0), ("H800", 989.0),
    ("H20", 148.0), ("A100", 312.0), ("A800", 312.0), ("L40S", 362.0),
    ("MI300X", 1307.0), ("MI325X", 1307.0),
)


def default_peak_tflops(device_name: str) -> Optional[float]:
    """Peak bf16 dense TFLOP/s for a GPU name (e.g. 'NVIDIA H100 80GB HBM3' -> 989), else None."""
    for key, peak in PEAK_BF16_TFLOPS:
        if key.lower() in device_name.lower():
            return peak
    return None


@dataclass(frozen=True)
class ModelShape:
    """What the FLOP count needs from a megatron TransformerConfig (one definition for all families)."""

    hidden: int
    vocab: int
    moe_layers: tuple[bool, ...]       # per decoder layer: MoE (True) or dense MLP
    heads: int
    kv_heads: int
    head_dim: int                      # GQA head dim (kv_channels)
    ffn: int                           # dense MLP width
    glu: bool = True                   # SwiGLU: 3 matmuls per MLP, else 2
    experts: int = 0
    topk: int = 0
    moe_ffn: int = 0
    shared_ffn: int = 0                # summed width of the shared experts (0: none)
    mla: bool = False
    q_lora_rank: Optional[int] = None
    kv_lora_rank: int = 0
    qk_nope_dim: int = 0
    qk_rope_dim: int = 0
    v_head_dim: int = 0
    mtp_layers: int = 0                # MTP depths that run in the forward (0 when frozen / off)

    @classmethod
    def from_config(cls, config, vocab_size: int, run_mtp: bool = False) -> "ModelShape":
        freq = config.moe_layer_freq
        if not config.num_moe_experts:
            pattern = [False] * config.num_layers
        elif isinstance(freq, int):
            pattern = [i % freq == 0 for i in range(config.num_layers)]
        else:
            pattern = [bool(x) for x in freq]
        mla = bool(getattr(config, "multi_latent_attention", False))
        return cls(
            hidden=config.hidden_size, vocab=vocab_size, moe_layers=tuple(pattern),
            heads=config.num_attention_heads,
            kv_heads=config.num_query_groups or config.num_attention_heads,
            head_dim=config.kv_channels, ffn=config.ffn_hidden_size, glu=bool(config.gated_linear_unit),
            experts=config.num_moe_experts or 0, topk=config.moe_router_topk or 0,
            moe_ffn=config.moe_ffn_hidden_size or 0,
            shared_ffn=config.moe_shared_expert_intermediate_size or 0,
            mla=mla, q_lora_rank=getattr(config, "q_lora_rank", None) if mla else None,
            kv_lora_rank=getattr(config, "kv_lora_rank", 0) if mla else 0,
            qk_nope_dim=getattr(config, "qk_head_dim", 0) if mla else 0,
            qk_rope_dim=getattr(config, "qk_pos_emb_head_dim", 0) if mla else 0,
            v_head_dim=getattr(config, "v_head_dim", 0) if mla else 0,
            mtp_layers=(config.mtp_num_layers or 0) if run_mtp else 0)


def attention_projection_flops(s: ModelShape) -> int:
    """Forward FLOPs per token of one layer's q/k/v/o projections."""
    h = s.hidden
    if not s.mla:
        return 2 * h * (s.heads + 2 * s.kv_heads) * s.head_dim + 2 * s.heads * s.head_dim * h
    q_dim = s.heads * (s.qk_nope_dim + s.qk_rope_dim)
    q = 2 * h * s.q_lora_rank + 2 * s.q_lora_rank * q_dim if s.q_lora_rank else 2 * h * q_dim
    kv = 2 * h * (s.kv_lora_rank + s.qk_rope_dim) + 2 * s.kv_lora_rank * s.heads * (s.qk_nope_dim + s.v_head_dim)
    return q + kv + 2 * s.heads * s.v_head_dim * h


def attention_pair_flops(s: ModelShape) -> int:
    """Forward FLOPs of one layer's QK^T and AV per (query, key) pair."""
    d_qk, d_v = (s.qk_nope_dim + s.qk_rope_dim, s.v_head_dim) if s.mla else (s.head_dim, s.head_dim)
    return 2 * s.heads * (d_qk + d_v)


def mlp_flops(s: ModelShape, moe: bool) -> int:
    """Forward FLOPs per token of one layer's MLP: dense, or router + k active + shared experts."""
    mats = 3 if s.glu else 2
    if not moe:
        return mats * 2 * s.hidden * s.ffn
    return (2 * s.hidden * s.experts + s.topk * mats * 2 * s.hidden * s.moe_ffn
            + (3 if s.shared_ffn else 0) * 2 * s.hidden * s.shared_ffn)


def forward_flops_per_token(s: ModelShape) -> dict[str, int]:
    """Forward FLOPs per token by part, excluding the attention scores (see attention_pairs)."""
    attn = attention_projection_flops(s)
    parts = {"attention_projections": attn * len(s.moe_layers),
             "dense_mlp": sum(mlp_flops(s, False) for moe in s.moe_layers if not moe),
             "moe_mlp": sum(mlp_flops(s, True) for moe in s.moe_layers if moe),
             "lm_head": 2 * s.hidden * s.vocab}
    if s.mtp_layers:
        last_moe = s.moe_layers[-1]  # megatron's MTP layer has the last decoder layer's spec
        parts["mtp"] = s.mtp_layers * (2 * 2 * s.hidden * s.hidden + attn + mlp_flops(s, last_moe)
                                       + 2 * s.hidden * s.vocab)
    return parts


def attention_pairs(seqlens: Sequence[int], causal: bool = True) -> int:
    """Query-key pairs of documents attended separately: sum of L(L+1)/2 (causal) or L^2."""
    return sum(n * (n + 1) // 2 if causal else n * n for n in seqlens)


def document_lengths(mb) -> list[int]:
    """Real document lengths of a PackedMicroBatch: its segments less padding."""
    return [n for _, n in document_spans(mb)]


def forward_flops(s: ModelShape, seqlens: Sequence[int], causal: bool = True) -> int:
    """Forward model FLOPs of documents of these lengths (any packing of them gives the same)."""
    tokens = sum(seqlens)
    attn_layers = len(s.moe_layers) + s.mtp_layers
    return (tokens * sum(forward_flops_per_token(s).values())
            + attn_layers * attention_pair_flops(s) * attention_pairs(seqlens, causal))


def train_step_flops(s: ModelShape, micro_batches, causal: bool = True) -> int:
    """Model FLOPs of forward + backward (3x forward) over PackedMicroBatches."""
    total = 0
    for mb in micro_batches:
        total += forward_flops(s, document_lengths(mb), causal)
    return 3 * total
