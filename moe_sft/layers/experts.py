"""Routed experts for the torch-native spec, computed with `torch.nn.functional.grouped_mm`.

We subclass megatron-core's `GroupedMLP` for its parameter layout and, above all, its
`sharded_state_dict`, which writes per-expert tensors in the same global format as
`SequentialMLP`/`TEGroupedMLP`: a checkpoint converted once loads under either backend and any
expert-parallel layout. Only the compute changes: `GroupedMLP` calls the external `grouped_gemm`
package (bf16 only); torch ships the same kernel as `F.grouped_mm` (CUDA and CPU, any float dtype).
With `add_bias_linear` the experts also get biases, and gpt-oss's clamped SwiGLU (quick_gelu, clamp,
+1 on the linear half) is honoured, neither of which GroupedMLP allows (moe_sft/layers/expert_bias.py).
"""

from __future__ import annotations

import contextlib

import torch
import torch.nn.functional as F
from megatron.core.transformer.moe import experts as mcore_experts

from moe_sft.kernels import bounded_rows, wgrad
from moe_sft.layers import expert_bias
from moe_sft.runtime.device import host_to_device

_HAS_GROUPED_MM = hasattr(F, "grouped_mm")


@contextlib.contextmanager
def _grouped_mlp_init_allowed(config):
    """GroupedMLP.__init__ asserts the `grouped_gemm` package (we never call it), refuses linear
    biases and any gated activation but silu/gelu (we add both ourselves): hide them while it runs.
    Its `glu` reads config.activation_func when called, so it computes act(gate) * up with the
    activation the config names; the clamp and offset go through expert_bias instead."""
    original = mcore_experts.gg.assert_grouped_gemm_is_available
    saved = config.add_bias_linear, config.activation_func
    mcore_experts.gg.assert_grouped_gemm_is_available = lambda: None
    config.add_bias_linear = False
    if config.gated_linear_unit and config.activation_func not in (F.silu, F.gelu):
        config.activation_func = F.silu
    try:
        yield
    finally:
        mcore_experts.gg.assert_grouped_gemm_is_available = original
        config.add_bias_linear, config.activation_func = saved


def _aligned_for_grouped_mm(x: torch.Tensor, w: torch.Tensor) -> bool:
    # grouped_mm needs 16-byte aligned strides (e.g. dims multiple of 8 in bf16, 4 in fp32).
    return all((d * x.element_size()) % 16 == 0 for d in (x.shape[-1], w.shape[-1]))


def grouped_matmul(
    x: torch.Tensor, w_EKN: torch.Tensor, tokens_per_expert: torch.Tensor, weight: torch.nn.Parameter | None = None
):
    """Rows of `x` grouped by expert (counts in tokens_per_expert) times w_EKN[expert].

    `weight`: the parameter w_EKN views; under megatron's DDP on CUDA its gradient then goes
    straight into its fp32 main grad (moe_sft/kernels/wgrad.py)."""
    if _HAS_GROUPED_MM and _aligned_for_grouped_mm(x, w_EKN):
        # The synchronised dispatch (EP x TP > 1) hands the counts over on the host: a pageable
        # copy back would make the host wait for the GPU again (256 waits per step at EP2).
        offs = torch.cumsum(host_to_device(tokens_per_expert, x.device), 0, dtype=torch.int32)
        if weight is not None and wgrad.fuses(x, weight):
            return wgrad.GroupedMatmulIntoMainGrad.apply(x, weight, offs, tuple(w_EKN.shape))
        return F.grouped_mm(x, w_EKN, offs=offs)
    chunks = torch.split(x, tokens_per_expert.tolist())
    return torch.cat([c @ w_EKN[e] for e, c in enumerate(chunks)])


class TorchGroupedMLP(mcore_experts.GroupedMLP):
    """megatron's GroupedMLP with torch's grouped_mm instead of the grouped_gemm package."""

    def __init__(self, num_local_experts, config, pg_collection=None):
        with _grouped_mlp_init_allowed(config):
            super().__init__(num_local_experts, config, pg_collection=pg_collection)
        # Expert parameters, reduced over the expert-data-parallel group, also at EP 1 when expert
        # TP differs from TP: megatron marks them so only when EP > 1, and at EP 1 with expert TP <
        # TP (gpt-oss needs expert TP 1) the TP ranks hold the same experts but different sequence
        # shards under SP, so their gradients were never summed (grad norm 7.30 against 7.57 on one
        # rank, tests/dist/test_family_layouts.py). At EP 1 with expert TP = TP the two groups are
        # the same and megatron's marking stays (one optimizer, as the checkpoints hold it).
        if config.expert_tensor_parallel_size != config.tensor_model_parallel_size:
            self.weight1.allreduce = self.weight2.allreduce = False
        self.bias1 = self.bias2 = None
        if config.add_bias_linear:
            expert_bias.add_expert_biases(self)
        self._extended_glu = expert_bias.uses_extended_glu(config)
        self._swiglu = config.gated_linear_unit and config.activation_func is F.silu and not self._extended_glu
        # LoRA beside the grouped weights (moe_sft/peft/experts.py), set when adapters are added:
        # it needs the tokens between fc1 and the activation, which no forward hook sees.
        self.adapter = None

    def forward(self, permuted_local_hidden_states, tokens_per_expert, permuted_probs):
        x = permuted_local_hidden_states
        hidden = self.config.hidden_size
        w1 = self.weight1.view(self.num_local_experts, hidden, -1)
        w2 = self.weight2.view(self.num_local_experts, -1, hidden)
        if x.numel() == 0:
            return self._no_rows(x, w1, w2, permuted_probs), None
        h = grouped_matmul(x, w1, tokens_per_expert, self.weight1)
        if self.bias1 is not None:
            h = h + expert_bias.per_row(self.bias1, tokens_per_expert, h.shape[0])
        if self.adapter is not None:
            h = h + self.adapter.fc1(x, tokens_per_expert)
        probs = permuted_probs.unsqueeze(-1)
        # static rows' padding (moe_sft/kernels/permute.py): the SwiGLU stops at the routed rows
        bound = getattr(x, "_moe_sft_rows_bound", None)
        if self._extended_glu:
            h = expert_bias.extended_glu_with_probs(self.config, h, probs)
        elif bound is not None and self._swiglu and bounded_rows.applies(h):
            h = bounded_rows.swiglu_with_probs(h, probs, bound)
        else:
            # megatron's compiled SwiGLU x probs (one kernel each way on CUDA; the probs product in
            # fp32, rounded once); a separate bf16 multiply is one more pass over the rows (docs/log.md)
            h = self.activation_func_with_probs(h, probs)
        out = grouped_matmul(h, w2, tokens_per_expert, self.weight2)
        if self.adapter is not None:
            out = out + self.adapter.fc2(h, tokens_per_expert)
        if self.bias2 is not None:
            out = expert_bias.fc2_bias(out, self.bias2, tokens_per_expert, permuted_probs, self.tp_group.rank())
        return out, None

    def _no_rows(self, x, w1, w2, permuted_probs):
        """0 rows out, with every expert parameter in the autograd graph so gradients (zeros) exist,
        and the probs too: their all-gather's backward is a collective every EP rank must run (a rank
        whose experts got no token skipped it and EP2 on gloo deadlocked)."""
        out = x @ w1.sum(0)[:, : w2.shape[1]] @ w2.sum(0) + permuted_probs.sum() * 0
        if self.bias1 is not None:
            out = out + (self.bias1.sum() + self.bias2.sum()) * 0
        return out + (self.adapter.zero_contribution() if self.adapter is not None else 0)

    def sharded_state_dict(self, prefix="", sharded_offsets=(), metadata=None):
        """GroupedMLP's entries for weight1/weight2 (and the experts' _extra_state), plus the biases'.

        GroupedMLP's own loop takes every entry of state_dict() but weight1 for a weight2, so it
        runs with the biases hidden from state_dict() (an instance attribute, removed after)."""
        if self.bias1 is None:
            return super().sharded_state_dict(prefix, sharded_offsets, metadata)
        full = type(self).state_dict
        self.state_dict = lambda *a, **kw: {
            k: v for k, v in full(self, *a, **kw).items() if k not in ("bias1", "bias2")
        }
        try:
            out = super().sharded_state_dict(prefix, sharded_offsets, metadata)
        finally:
            del self.state_dict
        out.update(expert_bias.bias_sharded_state_dict(self, prefix, sharded_offsets, metadata))
        return out
