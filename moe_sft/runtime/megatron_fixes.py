"""Fixes of megatron-core bugs on the paths moe-sft uses, applied explicitly at startup.

Each fix is one function, listed in `FIXES` with the megatron-core versions it was written for (the
bug exists there). On another version the fix is not applied and the startup log says so: check
whether megatron fixed it (its test in tests/cpu/test_megatron_fixes.py runs megatron's own
function on the buggy case and then fails), and widen the range or drop the fix.

Every replacement goes through runtime/patches.py (group "megatron_fixes"), which keeps megatron's
own object: `patches.original(owner, name)` is what the tests run on the buggy case. Speed
replacements of megatron functions are not here: they live in moe_sft/kernels/ (installed by
moe_sft.kernels.install, behind `kernels.fused`).
"""

from __future__ import annotations

import functools
import importlib.util
from collections.abc import Callable
from dataclasses import dataclass

import torch

from moe_sft.runtime import patches
from moe_sft.runtime.logs import get_logger

log = get_logger(__name__)

MCORE_0_16 = ("0.16.",)

GROUP = "megatron_fixes"

_applied = {"done": False}


def _te_absent() -> bool:
    return importlib.util.find_spec("transformer_engine") is None


def _replace(owner, name: str, new, reason: str) -> None:
    patches.swap(owner, name, new, group=GROUP, reason=reason)


def fix_router_gemm_name_without_te() -> str | None:
    """moe_utils imports `te_general_gemm` inside a try block that fails without TE, then the
    router's fp32 GEMM (`router_gating_linear`) reads the name: NameError. None selects its torch.mm
    branch."""
    from megatron.core.transformer.moe import moe_utils

    if hasattr(moe_utils, "te_general_gemm"):
        return None
    _replace(moe_utils, "te_general_gemm", None, "fix_router_gemm_name_without_te")
    return "moe_utils.te_general_gemm = None (router gemm without TE)"


def fix_mla_have_te() -> str | None:
    """Without TE, megatron's TE extension module still imports (with mock classes), so
    multi_latent_attention sets HAVE_TE=True and then calls isinstance(x, <mock>): TypeError when
    building MLA. The flag must say what is true: TE is absent."""
    from megatron.core.transformer import multi_latent_attention as mla

    if not (_te_absent() and mla.HAVE_TE):
        return None
    _replace(mla, "HAVE_TE", False, "fix_mla_have_te")
    return "multi_latent_attention.HAVE_TE = False (TE absent; MLA builds)"


def keep_adam_step(original_set):
    """`_set_main_param_and_optimizer_states` that keeps the existing 'step' tensor when the loaded
    tensors lack one (see `fix_fully_reshardable_step_load`)."""

    @functools.wraps(original_set)
    def _set_main_param_and_optimizer_states(self, model_param, tensors):
        if "step" not in tensors and not self.config.use_precision_aware_optimizer_no_fp8_or_ds_fp8:
            group_index, group_order = self.model_param_group_index_map[model_param]
            main_param = self.optimizer.param_groups[group_index]["params"][group_order]
            state = self.optimizer.state[main_param]
            if "step" in state:
                tensors = dict(tensors, step=state["step"].clone())
        return original_set(self, model_param, tensors)

    return _set_main_param_and_optimizer_states


def fix_fully_reshardable_step_load() -> str | None:
    """Without apex/TE, torch's Adam keeps a per-parameter 'step' tensor. megatron 0.16.1 saves the
    step once (in the common state) but `_set_main_param_and_optimizer_states` copies every state
    key from the loaded tensors, so resuming a fully_reshardable checkpoint dies with KeyError:
    'step'. Keep the existing tensor for that key; load_state_dict restores the step."""
    from megatron.core.optimizer.distrib_optimizer import DistributedOptimizer

    _replace(
        DistributedOptimizer,
        "_set_main_param_and_optimizer_states",
        keep_adam_step(DistributedOptimizer._set_main_param_and_optimizer_states),
        "fix_fully_reshardable_step_load",
    )
    return "DistributedOptimizer: torch Adam's per-parameter 'step' kept when a fully_reshardable load lacks it"


def unshare_step_tensors(torch_optimizer) -> None:
    """Give every parameter's Adam state its own 'step' tensor."""
    for param_state in torch_optimizer.state.values():
        if torch.is_tensor(param_state.get("step")):
            param_state["step"] = param_state["step"].clone()


def fix_shared_step_after_load() -> str | None:
    """The same load path gives every parameter's state the *same* 'step' tensor, and torch's Adam
    increments it in place once per parameter, so after a resume the bias correction runs with a
    step count ~#params too high (tests/dist/test_quickstart_e2e.py's resume equivalence)."""
    from megatron.core.optimizer.distrib_optimizer import DistributedOptimizer

    original_load = DistributedOptimizer.load_state_dict

    @functools.wraps(original_load)
    def load_state_dict(self, state_dict):
        result = original_load(self, state_dict)
        unshare_step_tensors(self.optimizer)
        return result

    _replace(DistributedOptimizer, "load_state_dict", load_state_dict, "fix_shared_step_after_load")
    return "DistributedOptimizer.load_state_dict: one 'step' tensor per parameter (Adam's bias correction)"


def fix_hybrid_optimizer_main_params() -> str | None:
    """Optimizer CPU offload (megatron's HybridDeviceOptimizer, HDO) without the precision-aware
    optimizer: the HDO steps the distributed optimizer's fp32 main-param shards, and copies the
    offloaded share to CPU when it is built. megatron 0.16.1 then loses loaded weights twice:
    `_copy_model_params_to_main_params` (reload_model_params, after loading a checkpoint's weights)
    returns early for an HDO, so the main params keep the values they had when the optimizer was
    built and the first step writes those back into the model; and after a resume loads the main
    params, the HDO refreshes only precision-aware fp32 copies, not the CPU copies it steps (a
    KeyError here). Copy model -> main params as without offload, then main -> each CPU copy."""
    from megatron.core.optimizer.cpu_offloading import HybridDeviceOptimizer
    from megatron.core.optimizer.distrib_optimizer import DistributedOptimizer

    original_copy = DistributedOptimizer._copy_model_params_to_main_params

    @functools.wraps(original_copy)
    def _copy_model_params_to_main_params(self, state_dict=None):
        hdo = self.optimizer
        if not isinstance(hdo, HybridDeviceOptimizer) or self.config.use_precision_aware_optimizer_no_fp8_or_ds_fp8:
            return original_copy(self, state_dict)
        self.optimizer = None  # megatron's path without an HDO: model params -> fp32 main shards
        try:
            original_copy(self, state_dict)
        finally:
            self.optimizer = hdo
        hdo.refresh_cpu_copies()

    def refresh_cpu_copies(self):
        for main_param, cpu_copy in self.gpu_params_map_cpu_copy.items():
            if main_param not in self.param_to_fp32_param:  # precision-aware copies: original path
                cpu_copy.data.copy_(main_param.data)

    def _update_fp32_params_by_new_state(self):
        if self.param_update_in_fp32:
            for param, state in self.state.items():
                if param in self.param_to_fp32_param:
                    self.param_to_fp32_param[param].data.copy_(state["master_param"])
        self.refresh_cpu_copies()

    _replace(
        DistributedOptimizer,
        "_copy_model_params_to_main_params",
        _copy_model_params_to_main_params,
        "fix_hybrid_optimizer_main_params",
    )
    _replace(HybridDeviceOptimizer, "refresh_cpu_copies", refresh_cpu_copies, "fix_hybrid_optimizer_main_params")
    _replace(
        HybridDeviceOptimizer,
        "_update_fp32_params_by_new_state",
        _update_fp32_params_by_new_state,
        "fix_hybrid_optimizer_main_params",
    )
    return "HybridDeviceOptimizer (optimizer CPU offload): main params and their CPU copies follow loaded weights"


def fix_expert_bias_padding_mask() -> str | None:
    """`TopKRouter._apply_expert_bias` masks the [tokens, experts] routing map with the [tokens]
    padding mask (`routing_map & ~padding_mask`), which broadcasts over the wrong dimension: any
    expert-bias model (DeepSeek-V3) with padded micro-batches (pipeline parallel, the allgather
    dispatcher) crashes. Padding rows must simply not count towards the bias update."""
    from megatron.core.transformer.moe.router import TopKRouter

    def _apply_expert_bias(self, routing_map, padding_mask=None):
        if self.enable_expert_bias and torch.is_grad_enabled():
            with torch.no_grad():
                if padding_mask is not None:
                    routing_map = routing_map & ~padding_mask.reshape(-1, 1)
                self.local_tokens_per_expert += routing_map.sum(dim=0)

    _replace(TopKRouter, "_apply_expert_bias", _apply_expert_bias, "fix_expert_bias_padding_mask")
    return "TopKRouter: expert-bias token counts exclude padding (mask broadcast per expert)"


def fix_mtp_full_recompute_with_packed_sequences() -> str | None:
    """`MultiTokenPredictionLayer._checkpointed_forward` hands every keyword argument, the
    `PackedSeqParams` of THD batches included, to `tensor_parallel.checkpoint` as a positional input,
    whose `save_for_backward` accepts tensors only: DeepSeek-V3 with MTP, full recompute and packed
    sequences died on the first step with "save_for_backward can only save variables". Non-tensor
    arguments are bound in a closure instead (recomputation gets the same objects); tensors still go
    through the checkpoint. FP8 (TE's checkpoint, which takes keywords) keeps megatron's own path."""
    from megatron.core.transformer.multi_token_prediction import MultiTokenPredictionLayer

    original_forward = MultiTokenPredictionLayer._checkpointed_forward

    @functools.wraps(original_forward)
    def _checkpointed_forward(self, forward_func, *args, **kwargs):
        if self.config.fp8:
            return original_forward(self, forward_func, *args, **kwargs)
        tensor_names = [k for k, v in kwargs.items() if isinstance(v, torch.Tensor)]
        bound = {k: v for k, v in kwargs.items() if k not in tensor_names}

        def run(*tensors):
            return forward_func(*args, **bound, **dict(zip(tensor_names, tensors)))

        return original_forward(self, run, *(kwargs[k] for k in tensor_names))

    _replace(
        MultiTokenPredictionLayer,
        "_checkpointed_forward",
        _checkpointed_forward,
        "fix_mtp_full_recompute_with_packed_sequences",
    )
    return "MTP layer full recompute: packed-sequence params kept out of save_for_backward"


_MTP_PADDING = "_moe_sft_padding_mask"  # the decoder's padding mask, handed to the GPTModel's MTP layers


def record_padding_for_mtp(original_preprocess):
    """`GPTModel._preprocess` that hands the padding mask it gives the decoder (sequence-parallel
    share on the first stage, as the trainer cut it on later ones) to this model's MTP layers."""

    @functools.wraps(original_preprocess)
    def _preprocess(self, *args, **kwargs):
        out = original_preprocess(self, *args, **kwargs)
        for layer in self.mtp.layers if getattr(self, "mtp_process", False) else ():
            setattr(layer, _MTP_PADDING, out[5])
        return out

    return _preprocess


def mtp_layer_with_padding(original_forward, original_proj):
    """`MultiTokenPredictionLayer.forward` whose transformer layer gets the recorded padding mask.
    The mask is bound to this call's `_proj_and_transformer_layer`, which full recompute keeps and
    re-runs in backward: the recomputed router sees the same mask, whatever ran in between."""

    @functools.wraps(original_forward)
    def forward(self, *args, **kwargs):
        mask = self.__dict__.pop(_MTP_PADDING, None)
        if mask is None:
            return original_forward(self, *args, **kwargs)

        def proj_and_layer(**layer_kwargs):
            layer = self.transformer_layer
            own = layer.__dict__.get("forward")  # a forward set on the instance (kept, then restored)
            layer.forward = functools.partial(layer.forward, padding_mask=mask)
            try:
                return original_proj(self, **layer_kwargs)
            finally:
                if own is None:
                    del layer.forward
                else:
                    layer.forward = own

        self._proj_and_transformer_layer = proj_and_layer
        try:
            return original_forward(self, *args, **kwargs)
        finally:
            del self._proj_and_transformer_layer

    return forward


def fix_mtp_router_padding() -> str | None:
    """megatron 0.16.1's GPTModel passes `padding_mask` to the decoder's layers, so their routers
    leave padding out of the aux losses and the expert-bias token counts, but not to the MTP block
    (`MultiTokenPredictionBlock.forward` has no such argument): the MTP layer's router counted every
    padding row. Padding depends on the layout (the allgather dispatcher pads micro-batches to one
    length, PP pads them, CP pads documents), so the MTP router's aux loss and bias counts did too:
    DeepSeek-V3 at CP2 x EP2, aux loss 3e-4 and grad norm 7e-6 from one rank's (tests/dist/
    test_upstream_bug_classes.py).
    MTP row i joins the main model's state at token i with the embedding of token i + 1; it is a
    padding row when token i is, so the layer gets the decoder's mask unshifted."""
    from megatron.core.models.gpt.gpt_model import GPTModel
    from megatron.core.transformer.multi_token_prediction import MultiTokenPredictionLayer

    _replace(GPTModel, "_preprocess", record_padding_for_mtp(GPTModel._preprocess), "fix_mtp_router_padding")
    _replace(
        MultiTokenPredictionLayer,
        "forward",
        mtp_layer_with_padding(
            MultiTokenPredictionLayer.forward, MultiTokenPredictionLayer._proj_and_transformer_layer
        ),
        "fix_mtp_router_padding",
    )
    return "MTP layers: the decoder's padding mask reaches their routers (aux losses, expert-bias counts)"


def fix_output_discarding_checkpoint_without_te() -> str | None:
    """`CheckpointWithoutOutput(fp8=False)` sets `self.fp8 = fp8 is not None`, i.e. True, and its
    forward then asks TE's FP8GlobalStateManager, a NameError without TE: selective recompute of
    `layernorm` or `moe_act` crashed. Without TE there is no FP8, so the flag is False."""
    from megatron.core.tensor_parallel import random as mrandom

    if not _te_absent():
        return None
    cls = mrandom.CheckpointWithoutOutput
    original_init = cls.__init__

    @functools.wraps(original_init)
    def __init__(self, *args, **kwargs):
        original_init(self, *args, **kwargs)
        self.fp8 = False

    _replace(cls, "__init__", __init__, "fix_output_discarding_checkpoint_without_te")
    return "CheckpointWithoutOutput: no FP8 query without TE (layernorm/moe_act recompute)"


class _SumRopeKeyGrad(torch.autograd.Function):
    """Identity forward; backward all-reduces the gradient of the last `width` columns over `group`."""

    @staticmethod
    def forward(ctx, x, width, group):
        ctx.width, ctx.group = width, group
        return x.view_as(x)

    @staticmethod
    def backward(ctx, grad):
        grad = grad.clone()
        rope = grad[..., -ctx.width :].contiguous()
        torch.distributed.all_reduce(rope, group=ctx.group)
        grad[..., -ctx.width :] = rope
        return grad, None, None


_MLA_CALL = "megatron_fixes.mla_rope_key_gather"  # the group of the one swap inside an MLA call


def sum_rope_key_grad(original_qkv):
    """`get_query_key_value_tensors` whose gathered kv down projection sums the gradient of its rope
    columns (k_pos_emb) over TP (see `fix_mla_rope_key_grad_over_tp`)."""
    from megatron.core.transformer import multi_latent_attention as mla
    from megatron.core.utils import get_pg_size

    @functools.wraps(original_qkv)
    def get_query_key_value_tensors(self, *args, **kwargs):
        if get_pg_size(self.tp_group) == 1:
            return original_qkv(self, *args, **kwargs)
        kv_down = {}  # linear_kv_down_proj's output: the only gather to fix (not q_compressed's)
        hook = self.linear_kv_down_proj.register_forward_hook(lambda _m, _i, out: kv_down.update(out=out[0]))
        gather = mla.gather_from_tensor_model_parallel_region

        def gather_kv(x, *gather_args, **gather_kwargs):
            full = gather(x, *gather_args, **gather_kwargs)
            if x is kv_down.get("out"):  # [s, b, kv_lora_rank + qk_pos_emb_head_dim], rope columns last
                full = _SumRopeKeyGrad.apply(full, self.config.qk_pos_emb_head_dim, self.tp_group)
            return full

        # for this call only: megatron's function reads the name from its module
        patches.swap(mla, "gather_from_tensor_model_parallel_region", gather_kv, group=_MLA_CALL, reason=_MLA_CALL)
        try:
            return original_qkv(self, *args, **kwargs)
        finally:
            patches.restore(_MLA_CALL)
            hook.remove()

    return get_query_key_value_tensors


def fix_mla_rope_key_grad_over_tp() -> str | None:
    """MLA with a column-parallel kv down projection (our torch-native spec) at TP > 1:
    megatron's `MLASelfAttention.get_query_key_value_tensors` (transformer/multi_latent_attention.py)
    gathers `kv_combined` over TP with `gather_from_tensor_model_parallel_region` and splits off its
    last qk_pos_emb_head_dim columns as `k_pos_emb`, the rope key that every head shares. Each TP rank
    uses the whole k_pos_emb with its own heads only, so its gradient is partial per rank, and the
    gather's backward (`_split_along_last_dim`) keeps this rank's columns of it without summing over
    TP. (kv_compressed is fine: linear_kv_up_proj, column parallel, reduces its input gradient; so is
    q_compressed through linear_q_up_proj.) DeepSeek-V3 at TP2 + SP was then not equal to one rank
    even for full-parameter training. Sum those columns' gradient over TP before the split."""
    from megatron.core.transformer.multi_latent_attention import MLASelfAttention

    _replace(
        MLASelfAttention,
        "get_query_key_value_tensors",
        sum_rope_key_grad(MLASelfAttention.get_query_key_value_tensors),
        "fix_mla_rope_key_grad_over_tp",
    )
    return "MLASelfAttention: the rope key's (k_pos_emb) gradient summed over TP (column-parallel kv down projection)"


@dataclass(frozen=True)
class Fix:
    apply: Callable[[], str | None]  # the log line when applied; None when this machine does not need it
    versions: tuple[str, ...]  # megatron-core version prefixes that have the bug


FIXES: tuple[Fix, ...] = (
    Fix(fix_router_gemm_name_without_te, MCORE_0_16),
    Fix(fix_mla_have_te, MCORE_0_16),
    Fix(fix_fully_reshardable_step_load, MCORE_0_16),
    Fix(fix_shared_step_after_load, MCORE_0_16),
    Fix(fix_hybrid_optimizer_main_params, MCORE_0_16),
    Fix(fix_expert_bias_padding_mask, MCORE_0_16),
    Fix(fix_mtp_full_recompute_with_packed_sequences, MCORE_0_16),
    Fix(fix_mtp_router_padding, MCORE_0_16),
    Fix(fix_output_discarding_checkpoint_without_te, MCORE_0_16),
    Fix(fix_mla_rope_key_grad_over_tp, MCORE_0_16),
)


def apply_megatron_fixes(version: str | None = None) -> list[str]:
    """Apply every fix written for this megatron-core version (once per process); returns the log lines."""
    if _applied["done"]:
        return []
    version = version or patches.mcore_version()
    lines = []
    for fix in FIXES:
        if not version.startswith(fix.versions):
            line = (
                f"{fix.apply.__name__} not applied: written for megatron-core {'/'.join(fix.versions)}x, "
                f"found {version} (check whether it still has the bug)"
            )
            log.warning(line)
            lines.append(line)
            continue
        line = fix.apply()
        if line:
            lines.append(line)
    _applied["done"] = True
    return lines


def remove_megatron_fixes() -> int:
    """Put back megatron's own objects for every fix applied; returns how many attributes."""
    _applied["done"] = False
    return patches.restore(GROUP)
