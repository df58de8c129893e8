"""Per-GPU memory of one pipeline stage: weights, grads, optimizer, activations, buffers, overhead.

Every term is written out in docs/planner.md with its source. In short (bf16 training, bytes):

    weights    2 x params of the stage (megatron DDP's bf16 param buffer)
    grads      4 x trainable params (DDP main grads, grad_reduce_in_fp32=True: full, not sharded)
    optimizer  distributed optimizer: (4 fp32 master + 8 Adam m,v) x dense / (DP x CP)
               + the same x expert params / expert-DP; CPU offload of a fraction f moves Adam's
               m,v of that fraction (the fp32 master stays on the GPU without TE's precision-aware
               optimizer, which megatron 0.16.1 only enables with TE)
    activations (saved for backward per micro-batch) x micro-batches in flight (1F1B / interleaved)
               + the larger of two phases that never overlap: one layer's working set during its
                 backward (twice that with full recompute), and the logits and cross entropy on
                 the last stage (freed before the first layer's backward starts)
    overhead   not in torch's allocator counters: CUDA context, NCCL buffers; plus fragmentation

Activations per layer are the tensors autograd saves in our torch-native layer spec (measured
with saved-tensor hooks and matched exactly by tests/cpu/test_plan.py on tiny models).
"""

from __future__ import annotations

from dataclasses import dataclass, field, replace

from moe_sft.kernels import permute
from moe_sft.models.shape import ModelShape
from moe_sft.plan import peft_memory
from moe_sft.plan.layout import Layout, stage_layers
from moe_sft.plan.params import Count, stage_params

GIB = 2**30
# Assumptions beyond the model (docs/planner.md; refine them with benchmarks/gpu/plan_calibration.py).
# reserved / allocated - 1 of torch's caching allocator under MoE churn, with the expandable segments
# the trainer turns on; above what the GPU calibration read (docs/log.md).
FRAGMENTATION = 0.10
# Optimizer offload moves state between host and GPU each step through buffers of varying size,
# which fragments more than FRAGMENTATION covers (docs/log.md).
FRAGMENTATION_OFFLOAD = 0.15
RUNTIME_OVERHEAD_GIB = 1.5  # CUDA context + NCCL communicator buffers, outside torch
LOGITS_BYTES = 4  # per token x padded vocab / TP on the last stage: see logits_bytes()


@dataclass
class Training:
    """What the memory depends on besides model and layout."""

    tokens: int  # tokens per micro-batch (pack_length)
    micro_batches: int  # per data-parallel rank and step (global batch / DP)
    recompute: str | None = None  # None | selective | full
    recompute_method: str = "uniform"
    recompute_num_layers: int = 1
    precision: str = "bf16"
    distributed_optimizer: bool = True
    offload_fraction: float = 0.0  # share of optimizer state on the CPU (0 = none)
    mtp_trained: bool = True  # False: MTP frozen (weights only)
    backend: str = "torch"
    peft: peft_memory.PeftPlan | None = None  # LoRA / DoRA: the base frozen (bf16 or FP8), adapters train
    cuda_graphs: bool = False  # trainer.cuda_graphs: static rows at any micro-batch size
    static_rows_capacity: float = 2.0  # model.moe_static_rows_capacity: the cap on static rows' padding


# ----------------------------------------------------------------------------- activations


def _norm(tokens: int, width: int) -> int:
    """Our RMSNorm (moe_sft/layers/norm.py) keeps its bf16 input and an fp32 1/rms per row; its
    backward recomputes the normalised value. (An input that is a view of a tensor counted
    elsewhere, like k's, is subtracted by the caller.)"""
    return tokens * (2 * width + 4)


def attention_activation(s: ModelShape, lay: Layout, t: int, recompute: str | None, layer: int | None = None) -> int:
    """Saved bytes of one layer's attention block for t tokens (after CP) on one rank; `layer` (a
    decoder layer index) picks that layer's own head dims where layers differ (Gemma 4)."""
    tsp = t // lay.tp if lay.tp > 1 else t  # sequence-parallel region (norms, linear inputs)
    heads = s.num_heads // lay.tp
    lse = 0 if recompute == "selective" else t * heads * 4  # selective recomputes core attention
    out = _norm(tsp, s.hidden) + tsp * 2 * s.hidden  # input norm; first linear's input
    if s.mla is None:
        a = s.attention_of(layer)
        groups = a.num_kv_heads // lay.tp
        d = a.head_dim
        out += t * (heads + (1 if a.k_eq_v else 2) * groups) * d * 2  # QKV output, kept alive by v (a view)
        if s.qk_norm:  # q is reshaped into its own storage; k's input is a view of the QKV output
            out += _norm(t * heads, d) + _norm(t * groups, d) - t * groups * d * 2
        out += 4 * t * d * 2  # RoPE cos/sin for q and k
        out += t * (heads + groups) * d * 2  # q, k after RoPE (kernel inputs)
        return out + t * heads * d * 2 + lse  # attention output (= proj input)
    m = s.mla
    qhd = m.qk_nope + m.qk_rope
    # the compressed q / kv stay in the sequence-parallel region (megatron gathers after the up-proj)
    if m.q_lora:  # under TP, the q norm's input is a slice of the gathered q_down output (all t tokens)
        out += (t if lay.tp > 1 else tsp) * m.q_lora * 2 + _norm(tsp, m.q_lora) - tsp * m.q_lora * 2
        out += tsp * m.q_lora * 2  # q_up input
    out += _norm(tsp, m.kv_lora) + tsp * m.kv_lora * 2  # kv norm; kv_up input
    out += 4 * t * m.qk_rope * 2  # RoPE cos/sin
    out += 2 * t * heads * qhd * 2  # q, k (nope ++ rope)
    if m.v_head != qhd:  # the varlen kernels need one head dim: v and the output are padded to qhd
        out += t * heads * qhd * 2 * 2 + t * heads * m.v_head * 2  # padded v, padded out, out slice
    else:
        out += 2 * t * heads * m.v_head * 2
    return out + lse


# fla's chunk size (chunk_gated_delta_rule's default): its intra-chunk matrix A is [T, H, 64].
FLA_CHUNK = 64


def gdn_activation(s: ModelShape, lay: Layout, t: int) -> int:
    """Saved bytes of one Gated DeltaNet mixer (moe_sft/layers/gated_delta_net.py) for t tokens on
    one rank, on the CUDA path: fla-core 0.6.0's kernels, bf16 activations. What each keeps:

    - in_proj (ColumnParallelLinear): its input, after the input norm (un-gathered under SP); its
      output [t, 2qk + 2v + 2Hv] is not kept: only slices of it are, copied by fla's input guard;
    - causal_conv1d: its input, the concatenated q, k, v [t, 2qk + v] (the SiLU output is recomputed);
    - chunk_gated_delta_rule (ChunkGatedDeltaRuleFunction.save_for_backward): q and k after its
      in-kernel L2 norm (bf16, key heads: the GVA sharing stays in the kernel) and their fp32
      1/norm per head, a contiguous v, the fp32 cumulative decay g [t, Hv], raw b and a (bf16)
      and beta = sigmoid(b) (fp32), the intra-chunk matrix A [t, Hv, 64] (bf16); the chunk states
      h [t/64, Hv, Dk, Dv] are not saved: the backward recomputes them (working set, not here);
    - the gated RMSNorm (fla's rms_norm_gated): its input (the delta rule's output), a contiguous
      z, an fp32 1/rms per head;
    - out_proj (RowParallelLinear): its input, the norm's output in [s, b, v] order.

    The torch path (CPU; fp32 runs; fla absent or refusing its backward) keeps more: megatron's
    torch chunked rule in fp32 with its per-chunk tensors; not modelled.
    """
    la = s.linear_attention
    tsp = t // lay.tp if lay.tp > 1 else t
    qk, v = la.key_heads * la.key_dim // lay.tp, la.value_heads * la.value_dim // lay.tp
    hk, hv = la.key_heads // lay.tp, la.value_heads // lay.tp
    out = _norm(tsp, s.hidden) + tsp * 2 * s.hidden  # input norm; in_proj's input
    out += t * (2 * qk + v) * 2  # the convolution's input
    out += t * (2 * qk * 2 + 2 * hk * 4)  # normalised q, k and their 1/norm
    out += t * v * 2  # v
    out += t * hv * (4 + 2 + 2 + 4 + FLA_CHUNK * 2)  # g, b, a, beta, A
    out += t * v * 2 * 3 + t * hv * 4  # norm input, z, out_proj input; the norm's 1/rms
    return out


def mlp_activation(s: ModelShape, lay: Layout, t: int, moe: bool, imbalance: float = 1.0) -> int:
    """Saved bytes of one layer's MLP block (pre-MLP norm included)."""
    tsp = t // lay.tp if lay.tp > 1 else t
    h = s.hidden
    out = _norm(tsp, h) + tsp * 2 * h  # pre-MLP norm; MLP / router input
    if not moe:
        return out + t * 5 * s.ffn // lay.tp * 2  # fc1 out (2f), act parts, fc2 input
    if s.shared_ffn:
        out += t * 5 * s.shared_ffn // lay.tp * 2
    e, k = s.num_experts, s.topk
    out += tsp * (e * (4 + 1 + 4) + k * (8 + 4 + 8 + 8 + 8))  # scores, routing map, probs, indices, row places
    routed = int(tsp * k * lay.etp * imbalance)  # tokens this rank's experts process
    # input, fc1 out (gate and up); the compiled SwiGLU x probs saves only its fp32 probs and its
    # output (fc2's input)
    return out + routed * (2 * h + 6 * s.moe_ffn // lay.etp + 4)


def layer_activation(
    s: ModelShape,
    lay: Layout,
    t: int,
    moe: bool,
    recompute: str | None = None,
    imbalance: float = 1.0,
    linear: bool = False,
    layer: int | None = None,
) -> int:
    """One decoder layer; `linear`: its mixer is Gated DeltaNet (ModelShape.is_linear_layer);
    `layer`: its index, for per-layer attention dims (None: the shape's own)."""
    mixer = gdn_activation(s, lay, t) if linear else attention_activation(s, lay, t, recompute, layer)
    return mixer + mlp_activation(s, lay, t, moe, imbalance)


def mtp_activation(s: ModelShape, lay: Layout, t: int, imbalance: float = 1.0) -> int:
    """One MTP depth: enorm, hnorm, eh_proj input (2h), its gathered output, a layer, final norm."""
    tsp = t // lay.tp if lay.tp > 1 else t
    h = s.hidden
    return 3 * _norm(tsp, h) + tsp * 4 * h + t * 2 * h + layer_activation(s, lay, t, s.moe_layers[-1], None, imbalance)


def logits_bytes(s: ModelShape, lay: Layout, t: int, depths: int = 0) -> int:
    """Logits + vocab-parallel cross entropy of one micro-batch, main head plus `depths` MTP heads.

    The fused cross entropy (moe_sft/kernels/cross_entropy.py) keeps the bf16 logits (2 bytes) for
    its backward and writes their bf16 gradient (2): LOGITS_BYTES x t x vocab / TP at the peak, in
    backward; padded vocab columns cost nothing extra.
    """
    return LOGITS_BYTES * t * (s.padded_vocab // lay.tp) * (1 + depths)


def in_flight(lay: Layout, pp_rank: int, micro_batches: int) -> float:
    """Forward passes whose activations one pipeline rank holds at its peak, in units of the
    rank's whole stage (all its virtual chunks). megatron 0.16.1 schedules: warmup = pp-rank-1
    (1F1B) or 2(pp-rank-1) + (vpp-1)pp chunk-forwards (interleaved), plus the one in flight."""
    if lay.pp == 1:
        return 1.0
    if not lay.vpp:
        return float(min(lay.pp - pp_rank, micro_batches))
    chunks = min(2 * (lay.pp - pp_rank - 1) + (lay.vpp - 1) * lay.pp + 1, micro_batches * lay.vpp)
    return chunks / lay.vpp


@dataclass
class StageMemory:
    pp_rank: int
    params: Count
    weights: float
    grads: float
    optimizer: float
    optimizer_offloaded: float  # on the CPU (host memory), not counted in the GPU total
    activations: float  # saved for backward, all in-flight micro-batches
    working: float  # backward working set (+ recomputed layers)
    logits: float
    pipeline_buffers: float
    layers: list = field(default_factory=list)
    in_flight: float = 1.0
    peft: peft_memory.PeftStage | None = None  # the adapted run's terms (weights above include them)

    @property
    def allocated(self) -> float:
        """Peak bytes in torch's allocator (compare with torch.cuda.max_memory_allocated).

        The loss phase (logits, their fp32 copy, their gradient) ends before the last layer's
        backward begins, so only the larger of the two counts (the GPU calibration: docs/log.md)."""
        return (
            self.weights
            + self.grads
            + self.optimizer
            + self.activations
            + max(self.working, self.logits)
            + self.pipeline_buffers
        )

    @property
    def fragmentation(self) -> float:
        return FRAGMENTATION_OFFLOAD if self.optimizer_offloaded > 0 else FRAGMENTATION

    @property
    def total(self) -> float:
        """What the GPU must have: allocated x (1 + fragmentation) + context and NCCL."""
        return self.allocated * (1 + self.fragmentation) + RUNTIME_OVERHEAD_GIB * GIB


def _opt_bytes(train: Training) -> tuple[float, float]:
    """(bytes per sharded param on the GPU, on the CPU) of the optimizer state."""
    if train.precision == "bf16":
        master, moments = 4.0, 8.0
    else:  # fp32 params are their own master copy
        master, moments = 0.0, 8.0
    f = train.offload_fraction
    return master + moments * (1 - f), moments * f


def static_rows_padding(s: ModelShape, lay: Layout, train: Training) -> float:
    """The routed rows a rank's experts hold over the expected ones when the allgather dispatcher's
    local permutation has a static size (`Layout.static_rows`; moe_sft/kernels/permute.py
    `enable_static_rows` leaves out experts with biases or adapters); 1 where it has not."""
    if not s.num_experts or s.linear_bias:
        return 1.0
    if train.peft is not None and peft_memory.adapts_experts(train.peft):
        return 1.0
    if not replace(lay, topk=s.topk, tokens=train.tokens, graphed=train.cuda_graphs).static_rows:
        return 1.0
    return permute.static_rows_bound(lay.ep, s.topk, s.num_experts // lay.ep, train.static_rows_capacity)


def stage_memory(s: ModelShape, lay: Layout, pp_rank: int, train: Training, imbalance: float = 1.0) -> StageMemory:
    # static rows: every rank's experts hold their bound whatever the routing (no further imbalance)
    imbalance = max(imbalance, static_rows_padding(s, lay, train))
    count = stage_params(s, lay, pp_rank, train.backend, mtp_frozen=not train.mtp_trained)
    wbytes = 2 if train.precision == "bf16" else 4
    trainable, weights, dequant = count.dense + count.expert, count.total * wbytes, 0.0
    dense, expert = count.dense, count.expert
    adapted = None
    if train.peft is not None:  # docs/planner.md, "LoRA and an FP8 base"
        embeddings = count.by_module.get("embedding", 0) + count.by_module.get("output_layer", 0)
        adapted = peft_memory.stage(s, lay, pp_rank, train.peft, count.total, embeddings)
        dense, expert = adapted.dense, adapted.expert
        trainable = dense + expert
        weights = adapted.base_bytes + (adapted.adapters + adapted.trained_base) * wbytes
        if wbytes == 4:  # fp32 runs: the frozen non-FP8 base in fp32 too
            weights += adapted.base_bytes - adapted.fp8_values - adapted.fp8_scales * 4
        dequant = adapted.dequant_peak
    gpu_opt, cpu_opt = _opt_bytes(train)
    dense_shard = lay.dp * lay.cp if train.distributed_optimizer else 1
    expert_shard = lay.edp if train.distributed_optimizer else 1
    sharded = dense / dense_shard + expert / expert_shard
    t = train.tokens // lay.cp
    tsp = t // lay.tp if lay.tp > 1 else t
    chunks = stage_layers(s.num_layers, lay, pp_rank)
    layer_ids = [i for r in chunks for i in r]
    acts = [
        layer_activation(s, lay, t, s.moe_layers[i], train.recompute, imbalance, s.is_linear_layer(i), i)
        for i in layer_ids
    ]
    last = pp_rank == lay.pp - 1
    mtp_depths = s.mtp_layers if (last and train.mtp_trained) else 0
    mtp = [mtp_activation(s, lay, t, imbalance)] * mtp_depths  # not recomputed
    biggest = max(acts + mtp, default=0)
    flight = in_flight(lay, pp_rank, train.micro_batches)
    if train.recompute == "full":
        n = max(1, train.recompute_num_layers)
        if train.recompute_method == "block":  # the first n layers of each chunk recomputed
            kept = sum(a for c in _split(acts, chunks) for a in c[n:])
            saved = kept + sum(min(n, len(c)) for c in chunks) * tsp * 2 * s.hidden
            working = biggest * 2
        else:  # uniform: every group of n layers stores its input only
            saved = -(-len(acts) // n) * tsp * 2 * s.hidden
            working = biggest * (n + 1)
    else:
        saved, working = sum(acts), biggest
    saved += sum(mtp)
    logit = logits_bytes(s, lay, t, mtp_depths) if last else 0
    return StageMemory(
        pp_rank=pp_rank,
        params=count,
        weights=weights,
        grads=trainable * 4,
        optimizer=sharded * gpu_opt,
        optimizer_offloaded=sharded * cpu_opt,
        activations=saved * flight,
        working=working + dequant,
        logits=logit,
        pipeline_buffers=(2 * tsp * s.hidden * wbytes * flight * lay.vp) if lay.pp > 1 else 0.0,
        layers=layer_ids,
        in_flight=flight,
        peft=adapted,
    )


def _split(acts: list, chunks: list) -> list:
    out, i = [], 0
    for r in chunks:
        out.append(acts[i : i + len(r)])
        i += len(r)
    return out


def all_stages(s: ModelShape, lay: Layout, train: Training, imbalance: float = 1.0) -> list[StageMemory]:
    return [stage_memory(s, lay, r, train, imbalance) for r in range(lay.pp)]
