"""The checkpoint entries of an adapted model: the base alone (loaded from the converted
checkpoint) and the trainable part (adapters, and anything else left trainable such as the
routers) that a LoRA run saves and resumes, resharding to any layout like megatron's own."""

from __future__ import annotations

import torch
from megatron.core import parallel_state
from megatron.core.dist_checkpointing import ShardedTensor
from megatron.core.dist_checkpointing.mapping import ShardedTensorFactory
from megatron.core.transformer.utils import make_sharded_tensors_for_checkpoint

from moe_sft.peft.experts import ExpertAdapter
from moe_sft.peft.linear import LinearAdapter
from moe_sft.peft.targets import global_module_name

ADAPTER = ".adapter."


def adapters(chunk):
    """(global module name, local module name, adapter) of one model chunk."""
    for name, module in chunk.named_modules():
        if isinstance(module, (LinearAdapter, ExpertAdapter)):
            parent = name[: -len(".adapter")]
            yield global_module_name(chunk, parent), parent, module


def _linear_entries(local: str, global_name: str, adapter: LinearAdapter, dp_cp_group) -> dict:
    state = adapter.state_dict(keep_vars=True)
    axis = {k: (0 if adapter.column else None) for k in state if k.startswith(("lora_B", "lora_magnitude"))}
    if not adapter.column:
        axis = {k: 1 for k in state if k.startswith("lora_A")}
    axis = {k: v for k, v in axis.items() if v is not None}
    prefix = f"{global_name}.adapter."
    sharded = make_sharded_tensors_for_checkpoint(
        state, prefix, axis, tp_group=adapter.tp_group, dp_cp_group=dp_cp_group
    )
    return {f"{local}.adapter.{k[len(prefix) :]}": v for k, v in sharded.items()}


def _expert_entries(local: str, global_name: str, adapter: ExpertAdapter) -> dict:
    ep, ep_rank = parallel_state.get_expert_model_parallel_world_size(), parallel_state.get_expert_model_parallel_rank()
    etp, etp_rank = adapter._etp_size(), parallel_state.get_expert_tensor_parallel_rank()
    edp_rank = parallel_state.get_expert_data_parallel_rank()
    tp_rank = parallel_state.get_tensor_model_parallel_rank()
    dp_rank = parallel_state.get_data_parallel_rank(with_context_parallel=True)
    entries = {}
    for name, param in adapter.named_parameters():
        key = f"{global_name}.adapter.{name}"
        split_axis = 1 if name == "lora_A2" else 2 if name.startswith("lora_B1") else None
        offsets = [] if adapter._shared(name) else [(0, ep_rank, ep)]
        if split_axis is not None and etp > 1:
            offsets.append((split_axis, etp_rank, etp))
        if adapter._shared(name):
            replica = (0, tp_rank, dp_rank)
        else:
            replica = (0, etp_rank if split_axis is None else 0, edp_rank)
        entries[f"{local}.adapter.{name}"] = ShardedTensor.from_rank_offsets(key, param, *offsets, replica_id=replica)
    return entries


def adapter_entries(chunk, dp_cp_group) -> dict:
    entries = {}
    for global_name, local, adapter in adapters(chunk):
        if isinstance(adapter, LinearAdapter):
            entries.update(_linear_entries(local, global_name, adapter, dp_cp_group))
        else:
            entries.update(_expert_entries(local, global_name, adapter))
    return entries


def _data(entry):
    return entry.data if isinstance(entry, (ShardedTensor, ShardedTensorFactory)) else None


def base_entries(full: dict) -> dict:
    """megatron's sharded state dict of an adapted chunk without the adapters (whose entries
    megatron's linears would write as if unsplit)."""
    return {k: v for k, v in full.items() if ADAPTER not in k}


def trainable_entries(chunk, full: dict, dp_cp_group) -> dict:
    """What a LoRA checkpoint holds: the adapters, plus every base tensor still trainable."""
    trainable = {id(p) for p in chunk.parameters() if p.requires_grad}
    kept = {k: v for k, v in base_entries(full).items() if id(_data(v)) in trainable}
    return {**kept, **adapter_entries(chunk, dp_cp_group)}


def load_partial(chunk, state: dict, allowed_missing) -> None:
    """load_state_dict of a part of the chunk's tensors; anything else missing is an error."""
    result = chunk.load_state_dict(state, strict=False)
    missing = [k for k in result.missing_keys if not allowed_missing(k) and not k.endswith("_extra_state")]
    if missing or result.unexpected_keys:
        raise RuntimeError(
            f"checkpoint does not fit the model: missing {missing[:8]}, unexpected {result.unexpected_keys[:8]}"
        )


def is_adapter_key(key: str) -> bool:
    return ADAPTER in key


def frozen_key(chunk) -> callable:
    frozen = {k for k, p in chunk.named_parameters() if not p.requires_grad}
    frozen |= {k for k, _ in chunk.named_buffers()}
    return lambda key: key in frozen


@torch.no_grad()
def merged_weights(chunk):
    """(local name of a base weight, its merged value) for every adapted weight of the chunk."""
    for _, local, adapter in adapters(chunk):
        base = chunk.get_submodule(local)
        if isinstance(adapter, LinearAdapter):
            yield (
                f"{local}.weight",
                _dora_merged(base, adapter) if adapter.dora else base.weight + adapter.delta_weight(),
            )
        else:
            d1, d2 = adapter.delta_weights()
            # weight1/weight2 are the (experts x in x out) stacks flattened in memory order
            yield f"{local}.weight1", base.weight1 + d1.reshape(base.weight1.shape)
            yield f"{local}.weight2", base.weight2 + d2.reshape(base.weight2.shape)


def _dora_merged(base, adapter: LinearAdapter) -> torch.Tensor:
    weight = base.weight.float() + adapter.delta_weight().float()
    return (weight * (adapter.magnitude().float() / adapter._row_norm(weight)).unsqueeze(1)).to(base.weight.dtype)
