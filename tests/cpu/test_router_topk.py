"""moe_sft/kernels/router_topk.py on CPU: where it is installed and when megatron's code runs instead
(the Triton kernels run on CUDA only: tests/gpu/test_gpu_router.py compares them with megatron's)."""

import torch
from megatron.core.transformer.moe import router

from moe_sft.kernels import router_topk


def test_the_router_uses_both_functions_after_megatron_fixes():
    from moe_sft.config import KernelsConfig
    from moe_sft.kernels import install
    from moe_sft.runtime import megatron_fixes

    megatron_fixes.apply_megatron_fixes()
    install.install(KernelsConfig())
    assert router.topk_routing_with_score_function is router_topk.topk_routing_with_score_function
    assert router.compute_routing_scores_for_aux_loss is router_topk.compute_routing_scores_for_aux_loss


def test_cpu_logits_take_megatron_s_path_with_the_same_results():
    logits = torch.randn(12, 8, generator=torch.Generator().manual_seed(0)).requires_grad_(True)
    assert not router_topk._kernel_fits(logits, 2)
    probs, routing_map = router_topk.topk_routing_with_score_function(logits, 2, score_function="softmax")
    ref_probs, ref_map = router_topk._megatron_topk_routing(logits, 2, score_function="softmax")
    assert torch.equal(routing_map, ref_map) and torch.equal(probs, ref_probs)
    assert routing_map.sum(1).eq(2).all()
    padding = torch.zeros(12, dtype=torch.bool)
    padding[-3:] = True
    aux_map, scores = router_topk.compute_routing_scores_for_aux_loss(logits, 2, "sigmoid", padding_mask=padding)
    assert aux_map[-3:].sum() == 0 and scores[-3:].abs().sum() == 0 and aux_map[:-3].sum(1).eq(2).all()


def test_the_kernel_s_grouped_choice_needs_power_of_two_groups_tiling_the_experts():
    assert router_topk._groups_fit(256, 8, 8, 4)  # DeepSeek-V3
    assert router_topk._groups_fit(60, 4, None, None)  # no groups: any expert count
    assert not router_topk._groups_fit(160, 6, 8, 3)  # 160 experts: not a power of two
    assert not router_topk._groups_fit(256, 8, 6, 4)  # 6 groups
    assert not router_topk._groups_fit(256, 6, 8, 4)  # top-k not a multiple of the groups kept
