"""megatron's tensor- and expert-parallel collectives without their autograd Function when the group
has one rank.

With TP = 1 or EP = 1 megatron's `_CopyToModelParallelRegion`, `_ReduceFromModelParallelRegion`
and `_AllToAll` return their input unchanged, forward and backward, but each is still an autograd
Function: a Python forward, a graph node and a Python backward, each costing host time
(benchmarks/gpu/host_overhead.py; figures in docs/log.md), and a Qwen3-MoE layer
passes through six per micro-batch at TP = EP = 1 (the QKV input, the attention output, the
dispatcher's three all-to-alls, the aux loss's token counts), in a host-bound step
(docs/benchmarks.md). The functions below return the input itself in that case, which is what the
Functions computed, and call megatron's otherwise.
"""

from __future__ import annotations

from megatron.core.tensor_parallel import mappings
from megatron.core.utils import get_tensor_model_parallel_group_if_none

from moe_sft.runtime import patches

_megatron = {
    name: getattr(mappings, name)
    for name in ("all_to_all", "copy_to_tensor_model_parallel_region", "reduce_from_tensor_model_parallel_region")
}


def _one_rank(group) -> bool:
    return group is not None and group.size() == 1


def _tp_group(group):
    return group if group is not None else get_tensor_model_parallel_group_if_none(None)


def all_to_all(group, input_, output_split_sizes_=None, input_split_sizes=None):
    if _one_rank(group):
        return input_
    return _megatron["all_to_all"](group, input_, output_split_sizes_, input_split_sizes)


def copy_to_tensor_model_parallel_region(input_, group=None):
    if _one_rank(_tp_group(group)):
        return input_
    return _megatron["copy_to_tensor_model_parallel_region"](input_, group)


def reduce_from_tensor_model_parallel_region(input_, group=None):
    if _one_rank(_tp_group(group)):
        return input_
    return _megatron["reduce_from_tensor_model_parallel_region"](input_, group)


def skip_one_rank_collectives() -> None:
    """The modules that imported megatron's functions by name get these."""
    from megatron.core.tensor_parallel import layers
    from megatron.core.transformer.moe import moe_utils, shared_experts, token_dispatcher

    targets = [(token_dispatcher, "all_to_all"), (moe_utils, "reduce_from_tensor_model_parallel_region")]
    for module in (layers, shared_experts):
        for name in ("copy_to_tensor_model_parallel_region", "reduce_from_tensor_model_parallel_region"):
            if hasattr(module, name):
                targets.append((module, name))
    for module, name in targets:
        patches.swap(module, name, globals()[name], group=patches.KERNELS, reason="one-rank collectives skipped")
