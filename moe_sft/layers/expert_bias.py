"""Linear biases and gpt-oss's clamped SwiGLU for the grouped experts (moe_sft/layers/experts.py).

megatron's legacy GroupedMLP refuses `add_bias_linear` and accepts only silu/gelu as the gated
activation; gpt-oss's experts have both biases and quick_gelu with a clamp and a +1 on the linear
half. The pieces here add them without touching the grouped GEMMs (and so keep their fused weight
gradient): the biases are added per row after each GEMM, expanded by expert (`per_row`), whose
backward is the segmented sum over each expert's rows, accumulated in fp32.

Parameters (zero at init, params dtype, as megatron's ColumnParallelLinear/RowParallelLinear):
- `bias1` [local experts, fc1 width of this expert-TP rank]: GLU-split like weight1's columns
  (this rank's slice of gate, then of up).
- `bias2` [local experts, hidden]: whole on every expert-TP rank.

Checkpoint: the keys and global shapes of SequentialMLP/TEGroupedMLP (`experts.linear_fc1.bias`
[experts, fc1 width], gate half then up half; `experts.linear_fc2.bias` [experts, hidden]), sharded
over EP and, for fc1, over expert-TP exactly as GroupedMLP shards weight1.
"""

from __future__ import annotations

import torch
from megatron.core import activations
from megatron.core.dist_checkpointing.mapping import ShardedTensor, ShardedTensorFactory
from megatron.core.fusions import fused_bias_geglu
from megatron.core.jit import jit_fuser

from moe_sft.runtime.device import host_to_device

# megatron-core defines x * sigmoid(1.702 x) twice; a config may name either.
_QUICK_GELU = (fused_bias_geglu.quick_gelu, activations.quick_gelu)


def add_expert_biases(experts) -> None:
    """Registers bias1/bias2 on a TorchGroupedMLP, marked the way megatron marks its expert biases."""
    n, hidden = experts.num_local_experts, experts.config.hidden_size
    fc1_local = experts.weight1.shape[1] // n
    kw = dict(device=experts.weight1.device, dtype=experts.config.params_dtype)
    experts.bias1 = torch.nn.Parameter(torch.zeros(n, fc1_local, **kw))
    experts.bias2 = torch.nn.Parameter(torch.zeros(n, hidden, **kw))
    etp_rank = experts.tp_group.rank()
    for bias in (experts.bias1, experts.bias2):
        # As weight1/weight2 (layers/experts.py): the DDP reduces them with the expert weights.
        bias.allreduce = experts.weight1.allreduce
        # Kept in the grad norm whatever the dense TP rank (megatron drops unmarked parameters on
        # dense TP ranks > 0, which are not expert-TP ranks: see moe_sft/peft/parallel.py).
        bias.tensor_model_parallel = True
    experts.bias1.partition_dim, experts.bias1.partition_stride = 1, 1
    # bias2 is replicated over expert TP, with the same gradient on every rank (fc2_bias below):
    # counted once in the grad norm, as megatron counts a tied embedding's second copy.
    experts.bias2.shared = etp_rank > 0
    experts.bias2.sequence_parallel = False  # no TP all-reduce of its gradient: already whole


_SUM_CHUNK_ELEMENTS = 1 << 24  # fp32 copy of the row gradients summed at once: 64 MiB


class _PerRow(torch.autograd.Function):
    """bias[e] for each row of expert e's group, whose backward sums each group's row gradients in
    fp32 and rounds once, as TE's grouped linear does. torch's own backward of the expansion
    (index_select's index_add) adds hundreds of bf16 rows into a bf16 sum one atomic add at a time:
    off by a visible margin, and different on every run (docs/log.md)."""

    @staticmethod
    def forward(ctx, bias, counts, rows):
        experts = torch.arange(bias.shape[0], device=bias.device)
        expert_of_row = torch.repeat_interleave(experts, counts, output_size=rows)
        ctx.save_for_backward(expert_of_row)
        ctx.bias_shape, ctx.bias_dtype = bias.shape, bias.dtype
        return bias.index_select(0, expert_of_row)

    @staticmethod
    def backward(ctx, grad):
        (expert_of_row,) = ctx.saved_tensors
        total = torch.zeros(ctx.bias_shape, dtype=torch.float32, device=grad.device)
        step = max(1, _SUM_CHUNK_ELEMENTS // max(1, grad.shape[1]))
        for start in range(0, grad.shape[0], step):
            total.index_add_(0, expert_of_row[start : start + step], grad[start : start + step].float())
        return total.to(ctx.bias_dtype), None, None


def per_row(bias: torch.Tensor, tokens_per_expert: torch.Tensor, rows: int) -> torch.Tensor:
    """bias[e] for each row of expert e's group: no host sync (output_size) and no loop over experts."""
    counts = host_to_device(tokens_per_expert, bias.device)
    return _PerRow.apply(bias, counts, rows)


def fc2_bias(out, bias2, tokens_per_expert, probs, etp_rank: int) -> torch.Tensor:
    """out + probs * bias2[expert] per row, added exactly once over expert TP.

    The probs scale the activation before fc2 (megatron's probs semantics), so for the expert's whole
    output (gpt-oss: routing weight x (fc2(h) + bias)) to be weighted the bias must be scaled too.
    Under expert TP the fc2 outputs are partial sums the token dispatcher adds over the expert-TP
    ranks: rank 0 adds the bias. The other ranks add `t - t.detach()`, exactly 0 in the forward, whose
    backward still hands bias2 the gradient rank 0 computes (every expert-TP rank receives the same
    output gradient: the reduce-scatter's backward is an all-gather), so the replicas stay equal
    without a collective. Their `t` uses detached probs: the probs' gradient is summed over expert
    TP (the backward of the dispatcher's all-gather of probs), and rank 0 already counts the bias term.
    """
    b = per_row(bias2, tokens_per_expert, out.shape[0])
    p = probs.unsqueeze(-1)
    if etp_rank == 0:
        # The sum in fp32 (the probs' dtype), rounded once, as TEGroupedMLP._apply_bias does.
        return (out + b * p).to(out.dtype)
    t = b * p.detach()
    return (out + (t - t.detach())).to(out.dtype)


def uses_extended_glu(config) -> bool:
    """Whether the gated activation needs more than GroupedMLP's act(gate) * up."""
    return bool(config.gated_linear_unit) and (
        config.activation_func in _QUICK_GELU
        or config.glu_linear_offset != 0.0
        or config.activation_func_clamp_value is not None
    )


@jit_fuser
def _clamped_quick_geglu_with_probs(h: torch.Tensor, probs: torch.Tensor, offset: float, clamp: float):
    gate, up = torch.chunk(h, 2, dim=-1)
    gate, up = gate.clamp(max=clamp), up.clamp(min=-clamp, max=clamp)
    return (gate * torch.sigmoid(gate * 1.702) * (up + offset) * probs).to(h.dtype)


def extended_glu_with_probs(config, h: torch.Tensor, probs: torch.Tensor) -> torch.Tensor:
    """act(clamp(gate, max=c)) * (clamp(up, -c, c) + offset) * probs, rounded to h's dtype once.

    The clamp bounds are gpt-oss's (HF GptOssExperts._apply_gate) and megatron's TEGroupedMLP's
    unfused path: the gate only from above, the linear half on both sides. Not megatron's
    weighted_bias_quick_geglu_impl: it clamps before adding its bias argument, and it makes a
    device tensor of the offset from a Python float on every call (a pageable copy: the host waits
    for the GPU). gpt-oss's case (quick_gelu and a clamp) is compiled as megatron compiles its
    SwiGLU (one kernel each way on CUDA, eager on CPU); any other combination runs plain torch ops."""
    clamp, offset = config.activation_func_clamp_value, float(config.glu_linear_offset)
    if config.activation_func in _QUICK_GELU and clamp is not None:
        return _clamped_quick_geglu_with_probs(h, probs, offset, float(clamp))
    gate, up = torch.chunk(h, 2, dim=-1)
    if clamp is not None:
        gate, up = gate.clamp(max=clamp), up.clamp(min=-clamp, max=clamp)
    return (config.activation_func(gate) * (up + offset) * probs).to(h.dtype)


def bias_sharded_state_dict(experts, prefix: str, sharded_offsets: tuple, metadata: dict | None) -> dict:
    """bias1/bias2 in the per-expert global format of SequentialMLP's linear_fc1/linear_fc2 biases.

    As GroupedMLP.sharded_state_dict does for the weights: the expert axis follows the prepended
    `sharded_offsets` axes and is split over EP; bias1's gate and up halves are placed apart over
    expert TP (rank r holds gate piece r and up piece etp + r of 2 x etp); bias2 is replicated over
    expert TP (replica id (0, etp rank, expert-DP rank)). With `singleton_local_shards` each expert is
    a tensor of its own (`experts.{e}.linear_fc1.bias_w`/`_v`, `experts.{e}.linear_fc2.bias`)."""
    singleton = (metadata or {}).get("singleton_local_shards", False)
    glu = bool(experts.config.gated_linear_unit)
    ep_size, ep_rank = experts.ep_group.size(), experts.ep_group.rank()
    tp_size, tp_rank = experts.tp_group.size(), experts.tp_group.rank()
    dp_rank = experts.dp_group.rank()
    axis = len(sharded_offsets)
    first = ep_rank * experts.num_local_experts

    def sharded(key, t, tp_offset, replica_id):
        if singleton:  # one key per global expert; its tensor has no expert axis
            return [
                ShardedTensor.from_rank_offsets(
                    key.replace(f"{prefix}experts.", f"{prefix}experts.{first + i}."),
                    row.contiguous(),
                    *sharded_offsets,
                    *([(axis, *tp_offset)] if tp_offset else []),
                    replica_id=replica_id,
                    prepend_axis_num=axis,
                )
                for i, row in enumerate(t)
            ]
        offsets = [(axis, ep_rank, ep_size)] + ([(axis + 1, *tp_offset)] if tp_offset else [])
        return ShardedTensor.from_rank_offsets(
            key, t.contiguous(), *sharded_offsets, *offsets, replica_id=replica_id, prepend_axis_num=axis
        )

    @torch.no_grad()
    def build_fc1(key, t, replica_id, flattened_range):
        assert flattened_range is None, "flattened expert biases are not supported"
        if not glu:
            return sharded(key, t, (tp_rank, tp_size), replica_id)
        gate, up = torch.chunk(t, 2, dim=-1)
        if singleton:
            return {
                "w": sharded(f"{key}_w", gate, (tp_rank, tp_size), replica_id),
                "v": sharded(f"{key}_v", up, (tp_rank, tp_size), replica_id),
            }
        return [
            sharded(key, gate, (tp_rank, 2 * tp_size), replica_id),
            sharded(key, up, (tp_size + tp_rank, 2 * tp_size), replica_id),
        ]

    @torch.no_grad()
    def build_fc2(key, t, replica_id, flattened_range):
        assert flattened_range is None, "flattened expert biases are not supported"
        return sharded(key, t, None, replica_id)

    @torch.no_grad()
    def merge(loaded):
        if isinstance(loaded, dict):  # singleton GLU halves
            return torch.cat((torch.stack(loaded["w"]), torch.stack(loaded["v"])), dim=-1)
        if isinstance(loaded, list):
            return torch.stack(loaded) if singleton else torch.cat(loaded, dim=-1)
        return loaded

    return {
        f"{prefix}bias1": ShardedTensorFactory(
            f"{prefix}experts.linear_fc1.bias", experts.bias1, build_fc1, merge, (0, 0, dp_rank)
        ),
        f"{prefix}bias2": ShardedTensorFactory(
            f"{prefix}experts.linear_fc2.bias", experts.bias2, build_fc2, merge, (0, tp_rank, dp_rank)
        ),
    }
