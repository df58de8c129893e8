"""The one model shape and the one model-FLOP formula: the planner, telemetry and the benchmark read both.

Pure Python (no torch, no transformers): a family's `shape()` (models/<family>.py) builds a
`ModelShape` from an HF config given as a config.json dict or a transformers config object, and
`ModelShape.from_config` reads one from a megatron TransformerConfig (what the trainer built).

FLOPs: one training step costs 3x the forward matmul FLOPs (forward, plus backward = grad w.r.t.
inputs and grad w.r.t. weights, each as large as the forward; Kaplan et al. 2020, Narayanan et al.
2021). Recomputation is not counted (model FLOPs, not hardware FLOPs: MFU, not HFU). A matmul of
an [m, k] by a [k, n] matrix is 2mkn FLOPs. Per token, forward (H = hidden size, V = vocabulary):

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
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

VOCAB_DIVISOR = 128  # Megatron convention: the padded vocab splits evenly for TP in {1,2,4,8,...}

# Peak dense bf16 tensor-core TFLOP/s per GPU (no sparsity), from the vendors' data sheets.
# Matched in order against the device name (torch.cuda.get_device_name()); the first match wins.
PEAK_BF16_TFLOPS: tuple[tuple[str, float], ...] = (
    ("GB200", 2500.0),
    ("B200", 2250.0),
    ("H100 PCIe", 756.0),
    ("H100 NVL", 835.0),
    ("H100", 989.0),
    ("H200", 989.0),
    ("H800", 989.0),
    ("H20", 148.0),
    ("A100", 312.0),
    ("A800", 312.0),
    ("L40S", 362.0),
    ("MI300X", 1307.0),
    ("MI325X", 1307.0),
)


def default_peak_tflops(device_name: str) -> float | None:
    """Peak bf16 dense TFLOP/s for a GPU name (e.g. 'NVIDIA H100 80GB HBM3' -> 989), else None."""
    for key, peak in PEAK_BF16_TFLOPS:
        if key.lower() in device_name.lower():
            return peak
    return None


def padded_vocab_size(vocab_size: int, divisor: int = VOCAB_DIVISOR) -> int:
    return -(-vocab_size // divisor) * divisor


class ConfigView:
    """Attribute access to an HF config given as a config.json dict: absent keys read as None
    (the family's shape() applies transformers' defaults where it needs them)."""

    def __init__(self, d: dict):
        self._d = d

    def __getattr__(self, name: str):
        if name.startswith("__"):
            raise AttributeError(name)
        return self._d.get(name)


def config_view(cfg):
    """A dict (config.json) as a ConfigView; anything else (a transformers config) as it is."""
    return ConfigView(cfg) if isinstance(cfg, dict) else cfg


def field(cfg, *names, default=None):
    """The first of `names` the config sets (not None), else `default`."""
    for n in names:
        value = getattr(cfg, n, None)
        if value is not None:
            return value
    return default


def num_experts_field(cfg) -> int:
    return int(field(cfg, "num_experts", "num_local_experts", "n_routed_experts", default=0))


def common_shape_fields(c, name: str) -> dict:
    """ModelShape fields every family reads the same way (c: a transformers config or a ConfigView)."""
    return dict(
        name=name,
        model_type=c.model_type,
        num_layers=int(c.num_hidden_layers),
        hidden=int(c.hidden_size),
        vocab=int(c.vocab_size),
        num_heads=int(c.num_attention_heads),
        num_experts=num_experts_field(c),
        topk=int(field(c, "num_experts_per_tok", "top_k_experts", default=0)),
        tie_embeddings=bool(c.tie_word_embeddings or False),
    )


@dataclass(frozen=True)
class LinearAttention:
    """Gated DeltaNet sizes of a hybrid model (Qwen3-Next, Qwen3.5) and which layers run it."""

    layers: tuple[bool, ...]  # per decoder layer: Gated DeltaNet (True) or attention
    key_heads: int
    value_heads: int
    key_dim: int
    value_dim: int
    conv_kernel: int
    # transformers' projections in_proj fuses, named by its parts (layers/config.py's
    # linear_attention_projections): Qwen3-Next ("qkvz", "ba"), Qwen3.5 ("qkv", "z", "b", "a")
    projections: tuple[str, ...] = ()

    def projection_widths(self) -> dict[str, int]:
        """Output rows of each of transformers' in_proj projections."""
        qk, v = self.key_heads * self.key_dim, self.value_heads * self.value_dim
        rows = dict(q=qk, k=qk, v=v, z=v, b=self.value_heads, a=self.value_heads)
        return {p: sum(rows[c] for c in rows if c in p) for p in self.projections}

    @property
    def in_proj_width(self) -> int:  # q, k, v, z, b, a
        return 2 * self.key_heads * self.key_dim + 2 * self.value_heads * self.value_dim + 2 * self.value_heads

    @property
    def conv_width(self) -> int:  # q, k, v
        return 2 * self.key_heads * self.key_dim + self.value_heads * self.value_dim


@dataclass(frozen=True)
class LayerAttention:
    """One decoder layer's attention dims where layers differ (Gemma 4: full layers have wider
    heads, their own key/value head count and may take V from the key projection)."""

    head_dim: int
    num_kv_heads: int
    k_eq_v: bool = False  # the q/k/v projection holds [q, k] per group; V is the projected K


@dataclass(frozen=True)
class MLA:
    """DeepSeek multi-latent attention sizes (q_lora None: plain q projection)."""

    q_lora: int | None
    kv_lora: int
    qk_nope: int
    qk_rope: int
    v_head: int


@dataclass(frozen=True)
class ModelShape:
    name: str
    model_type: str
    num_layers: int
    hidden: int
    vocab: int
    num_heads: int
    num_kv_heads: int
    head_dim: int  # GQA head dim (kv_channels)
    qk_norm: bool
    ffn: int  # dense MLP intermediate size (dense layers only)
    num_experts: int
    topk: int
    moe_ffn: int
    shared_ffn: int  # summed width of the shared experts (0: none)
    moe_layers: tuple[bool, ...]  # per decoder layer: MoE (True) or dense MLP
    mtp_layers: int  # MTP depths (from_config: those that run in the forward)
    tie_embeddings: bool
    mla: MLA | None = None
    glu: bool = True  # SwiGLU: 3 matmuls per MLP, else 2
    qk_norm_full_width: bool = False  # q/k norms over all heads (MiniMax-M2), not one head's width
    qkv_bias: bool = False  # biases on the q, k and v projections (GLM-4.5 attention_bias)
    # biases on the attention output, the router and the experts' two GEMMs, and a sink logit per
    # attention head (gpt-oss: megatron's add_bias_linear and softmax_type "learnable")
    linear_bias: bool = False
    attention_sinks: bool = False
    # per decoder layer: the most keys a query sees (sliding-window attention), None: all before it
    attention_windows: tuple[int | None, ...] = ()
    # a sigmoid output gate per query channel, made by the q projection (Qwen3-Next, Qwen3.5)
    attention_gate: bool = False
    shared_expert_gate: bool = False  # sigmoid(x @ w) scales the shared expert's output
    linear_attention: LinearAttention | None = None
    # per decoder layer when layers' attention dims differ (Gemma 4), else () (every layer:
    # head_dim, num_kv_heads)
    attention_layers: tuple[LayerAttention, ...] = ()
    attention_output_norm: bool = False  # a norm on the attention output (Gemma 4's post-attention norm)
    # hidden-wide norms of an MoE layer's MLP block: 1, its pre-MLP norm; Gemma 4: 5 around its
    # dense and routed halves (the pre-MLP norm an identity)
    moe_block_norms: int = 1
    router_scales: bool = False  # the router's input scale [hidden] and per-expert scale [experts] (Gemma 4)

    def attention_of(self, layer: int | None) -> LayerAttention:
        """Decoder layer `layer`'s attention dims (None: the shape's own, e.g. an MTP layer)."""
        if layer is not None and self.attention_layers:
            return self.attention_layers[layer]
        return LayerAttention(self.head_dim, self.num_kv_heads)

    def is_linear_layer(self, i: int) -> bool:
        return self.linear_attention is not None and i < self.num_layers and self.linear_attention.layers[i]

    @property
    def padded_vocab(self) -> int:
        return padded_vocab_size(self.vocab)

    @property
    def family(self) -> str:
        return self.model_type

    def describe(self) -> str:
        attn = (
            f"MLA q_lora={self.mla.q_lora} kv_lora={self.mla.kv_lora} heads={self.num_heads}"
            if self.mla
            else f"GQA {self.num_heads}/{self.num_kv_heads} heads x {self.head_dim}"
        )
        dense = self.num_layers - sum(self.moe_layers)
        shared = f" + shared {self.shared_ffn}" if self.shared_ffn else ""
        return (
            f"{self.name} ({self.model_type}): {self.num_layers} layers ({dense} dense), hidden "
            f"{self.hidden}, {attn}, {self.num_experts} experts top-{self.topk} x {self.moe_ffn}"
            f"{shared}, vocab {self.vocab}" + (f", {self.mtp_layers} MTP" if self.mtp_layers else "")
        )

    @classmethod
    def from_config(
        cls, config, vocab_size: int, run_mtp: bool = False, name: str = "model", model_type: str = ""
    ) -> ModelShape:
        """The shape of the model built from a megatron TransformerConfig; MTP layers count only
        when they run in the forward (`run_mtp`)."""
        # Here, not at the top: this module stays pure Python; a megatron config means megatron is loaded.
        from moe_sft.layers.config import is_moe_layer_of_config

        mla = None
        if getattr(config, "multi_latent_attention", False):
            mla = MLA(
                q_lora=getattr(config, "q_lora_rank", None),
                kv_lora=getattr(config, "kv_lora_rank", 0),
                qk_nope=getattr(config, "qk_head_dim", 0),
                qk_rope=getattr(config, "qk_pos_emb_head_dim", 0),
                v_head=getattr(config, "v_head_dim", 0),
            )
        return cls(
            name=name,
            model_type=model_type,
            num_layers=config.num_layers,
            hidden=config.hidden_size,
            vocab=vocab_size,
            num_heads=config.num_attention_heads,
            num_kv_heads=config.num_query_groups or config.num_attention_heads,
            head_dim=config.kv_channels,
            qk_norm=bool(getattr(config, "qk_layernorm", False)),
            qkv_bias=bool(getattr(config, "add_qkv_bias", False)),
            linear_bias=bool(getattr(config, "add_bias_linear", False)),
            attention_sinks=getattr(config, "softmax_type", "vanilla") == "learnable",
            ffn=config.ffn_hidden_size,
            num_experts=config.num_moe_experts or 0,
            topk=config.moe_router_topk or 0,
            moe_ffn=config.moe_ffn_hidden_size or 0,
            shared_ffn=config.moe_shared_expert_intermediate_size or 0,
            moe_layers=tuple(is_moe_layer_of_config(config, i) for i in range(config.num_layers)),
            mtp_layers=(config.mtp_num_layers or 0) if run_mtp else 0,
            tie_embeddings=False,
            mla=mla,
            glu=bool(config.gated_linear_unit),
            attention_windows=_config_windows(config),
            **_config_gemma4_fields(config),
        )


def _config_gemma4_fields(config) -> dict:
    """The per-layer attention and the block of a megatron config built for Gemma 4
    (SFTTransformerConfig's gemma4_layers / gemma4_attention_layers); {} for any other."""
    if not getattr(config, "gemma4_layers", False):
        return {}
    kinds = getattr(config, "gemma4_attention_layers", None) or ()
    return dict(
        attention_layers=tuple(LayerAttention(k.head_dim, k.num_query_groups, k.k_eq_v) for k in kinds),
        attention_output_norm=True,
        moe_block_norms=5,
        router_scales=True,
    )


def _config_windows(config) -> tuple[int | None, ...]:
    """megatron's sliding window (`window_size` left + the query itself) on the layers
    `window_attn_skip_freq` picks; () without windows."""
    window = getattr(config, "window_size", None)
    if not window:
        return ()
    from megatron.core.transformer.utils import is_layer_window_attention

    skip = getattr(config, "window_attn_skip_freq", None)
    return tuple(
        window[0] + 1 if is_layer_window_attention(window, skip, i + 1) else None for i in range(config.num_layers)
    )


# ----------------------------------------------------------------------------- FLOPs


def attention_projection_flops(s: ModelShape, layer: int | None = None) -> int:
    """Forward FLOPs per token of one layer's q/k/v/o projections (`layer`: a decoder layer
    index, for shapes whose layers' attention dims differ)."""
    h = s.hidden
    if s.mla is None:
        a = s.attention_of(layer)
        kv = (1 if a.k_eq_v else 2) * a.num_kv_heads
        return 2 * h * (s.num_heads + kv) * a.head_dim + 2 * s.num_heads * a.head_dim * h
    m = s.mla
    q_dim = s.num_heads * (m.qk_nope + m.qk_rope)
    q = 2 * h * m.q_lora + 2 * m.q_lora * q_dim if m.q_lora else 2 * h * q_dim
    kv = 2 * h * (m.kv_lora + m.qk_rope) + 2 * m.kv_lora * s.num_heads * (m.qk_nope + m.v_head)
    return q + kv + 2 * s.num_heads * m.v_head * h


def attention_pair_flops(s: ModelShape, layer: int | None = None) -> int:
    """Forward FLOPs of one layer's QK^T and AV per (query, key) pair."""
    d = s.attention_of(layer).head_dim
    d_qk, d_v = (s.mla.qk_nope + s.mla.qk_rope, s.mla.v_head) if s.mla else (d, d)
    return 2 * s.num_heads * (d_qk + d_v)


def mlp_flops(s: ModelShape, moe: bool) -> int:
    """Forward FLOPs per token of one layer's MLP: dense, or router + k active + shared experts."""
    mats = 3 if s.glu else 2
    if not moe:
        return mats * 2 * s.hidden * s.ffn
    return (
        2 * s.hidden * s.num_experts
        + s.topk * mats * 2 * s.hidden * s.moe_ffn
        + (3 if s.shared_ffn else 0) * 2 * s.hidden * s.shared_ffn
    )


def forward_flops_per_token(s: ModelShape) -> dict[str, int]:
    """Forward FLOPs per token by part, excluding the attention scores (see attention_pairs)."""
    attn = attention_projection_flops(s)
    parts = {
        "attention_projections": sum(attention_projection_flops(s, i) for i in range(len(s.moe_layers))),
        "dense_mlp": sum(mlp_flops(s, False) for moe in s.moe_layers if not moe),
        "moe_mlp": sum(mlp_flops(s, True) for moe in s.moe_layers if moe),
        "lm_head": 2 * s.hidden * s.vocab,
    }
    if s.mtp_layers:
        last_moe = s.moe_layers[-1]  # megatron's MTP layer has the last decoder layer's spec
        parts["mtp"] = s.mtp_layers * (
            2 * 2 * s.hidden * s.hidden + attn + mlp_flops(s, last_moe) + 2 * s.hidden * s.vocab
        )
    return parts


def attention_pairs(seqlens: Sequence[int], causal: bool = True, window: int | None = None) -> int:
    """Query-key pairs of documents attended separately: sum of L(L+1)/2 (causal) or L^2; with a
    causal sliding window of W keys, a query sees min(its position + 1, W)."""
    if causal and window:
        return sum(
            n * (n + 1) // 2 if n <= window else window * (window + 1) // 2 + (n - window) * window for n in seqlens
        )
    return sum(n * (n + 1) // 2 if causal else n * n for n in seqlens)


def attention_layer_pairs(s: ModelShape, seqlens: Sequence[int], causal: bool = True) -> int:
    """Query-key pairs over every attention layer (decoder layers with their windows, then MTP)."""
    windows = s.attention_windows or (None,) * len(s.moe_layers)
    full = attention_pairs(seqlens, causal)
    per_layer = sum(attention_pairs(seqlens, causal, w) if w else full for w in windows)
    return per_layer + s.mtp_layers * full


def attention_score_flops(s: ModelShape, seqlens: Sequence[int], causal: bool = True) -> int:
    """Forward FLOPs of QK^T and AV over every attention layer (decoder layers with their windows
    and head dims, then MTP) for documents of these lengths."""
    if not s.attention_layers:
        return attention_pair_flops(s) * attention_layer_pairs(s, seqlens, causal)
    windows = s.attention_windows or (None,) * len(s.moe_layers)
    per_layer = sum(attention_pair_flops(s, i) * attention_pairs(seqlens, causal, w) for i, w in enumerate(windows))
    return per_layer + s.mtp_layers * attention_pair_flops(s) * attention_pairs(seqlens, causal)


def forward_flops(s: ModelShape, seqlens: Sequence[int], causal: bool = True) -> int:
    """Forward model FLOPs of documents of these lengths (any packing of them gives the same)."""
    return sum(seqlens) * sum(forward_flops_per_token(s).values()) + attention_score_flops(s, seqlens, causal)
