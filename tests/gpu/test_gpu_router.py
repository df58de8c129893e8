"""The router on CUDA against megatron's torch ops: the logits and gradients from bf16 GEMMs
(moe_sft/kernels/router_gemm.py) at the Qwen3-30B-A3B router shape, and the Triton top-k routing
and aux-loss scores (moe_sft/kernels/router_topk.py) at the shapes of every family's router."""

import pytest
import torch

pytestmark = pytest.mark.gpu


def test_bf16_router_gemms_give_megatron_s_fp32_logits_and_gradients():
    from megatron.core.transformer.moe import moe_utils

    from moe_sft.config import KernelsConfig
    from moe_sft.kernels import install, router_gemm
    from moe_sft.runtime import megatron_fixes

    megatron_fixes.apply_megatron_fixes()
    install.install(KernelsConfig())
    g = torch.Generator(device="cuda").manual_seed(0)
    x = torch.randn(4096, 1, 2048, device="cuda", generator=g).to(torch.bfloat16)
    w = (torch.randn(128, 2048, device="cuda", generator=g) * 0.02).to(torch.bfloat16)
    grad = torch.randn(4096, 1, 128, device="cuda", generator=g) * 1e-3

    def run(fn):
        xi, wi = x.clone().requires_grad_(True), w.clone().requires_grad_(True)
        logits = fn(xi, wi, None, torch.float32)
        logits.backward(grad)
        return logits, xi.grad, wi.grad

    assert router_gemm._uses_bf16_gemms(x, w, None, torch.float32)
    ours, theirs = run(router_gemm.router_gating_linear), run(moe_utils.RouterGatingLinearFunction.apply)
    assert ours[0].dtype == theirs[0].dtype == torch.float32
    torch.testing.assert_close(ours[0], theirs[0], rtol=1e-5, atol=1e-5)  # the same products, other sum order
    for a, b in zip(ours[1:], theirs[1:]):
        assert a.dtype == b.dtype == torch.bfloat16
        # one bf16 rounding of (nearly) the same fp32 value: at most one ulp apart, rarely
        torch.testing.assert_close(a, b, rtol=2**-7, atol=1e-6)
        assert (a != b).float().mean() < 0.05


# (tokens, experts, top-k, score function, pre-softmax, expert bias, scaling factor, groups, groups kept)
ROUTERS = {
    "qwen3_30b": (4096, 128, 8, "softmax", False, False, None, None, None),
    "mixtral": (4096, 8, 2, "softmax", False, False, None, None, None),
    "pre_softmax_60_experts": (1000, 60, 4, "softmax", True, False, None, None, None),
    "deepseek_v3": (4096, 256, 8, "sigmoid", False, True, 2.5, 8, 4),
    "sigmoid_top1": (777, 16, 1, "sigmoid", False, False, None, None, None),
}


@pytest.mark.parametrize("name", sorted(ROUTERS))
def test_triton_routing_matches_megatron_s_routing_and_its_gradient(name):
    from moe_sft.kernels import router_topk

    tokens, experts, k, score, pre, bias, scale, groups, kept = ROUTERS[name]
    g = torch.Generator(device="cuda").manual_seed(1)
    logits = torch.randn(tokens, experts, device="cuda", generator=g) * 2
    expert_bias = torch.randn(experts, device="cuda", generator=g) * 0.1 if bias else None
    grad = torch.randn(tokens, experts, device="cuda", generator=g)
    kwargs = dict(
        use_pre_softmax=pre,
        num_groups=groups,
        group_topk=kept,
        scaling_factor=scale,
        score_function=score,
        expert_bias=expert_bias,
    )

    def run(fn):
        x = logits.clone().requires_grad_(True)
        probs, routing_map = fn(x, k, **kwargs)
        probs.backward(grad)
        return probs, routing_map, x.grad

    assert router_topk._kernel_fits(logits, k) and router_topk._groups_fit(experts, k, groups, kept)
    probs, routing_map, d_logits = run(router_topk.topk_routing_with_score_function)
    ref_probs, ref_map, ref_d_logits = run(router_topk._megatron_topk_routing)
    assert routing_map.dtype == torch.bool and torch.equal(routing_map, ref_map)
    assert routing_map.sum(1).eq(k).all()
    # Triton's exp against torch's: the last bits of an fp32 probability
    torch.testing.assert_close(probs, ref_probs, rtol=1e-6, atol=1e-7)
    torch.testing.assert_close(d_logits, ref_d_logits, rtol=1e-5, atol=1e-6)


# The rules transformers' routers follow where megatron's differ (moe_sft/kernels/routing.py):
# (tokens, experts, top-k, score, pre-softmax, bias, scale, groups, kept, group score top-k, normalise)
HF_RULES = {
    "deepseek_groups_by_top2": (4096, 64, 6, "sigmoid", False, True, 2.5, 8, 4, 2, True),
    "deepseek_unnormalised": (2000, 64, 4, "sigmoid", False, True, 1.0, 4, 2, 2, False),
    "deepseek_top1_normalised": (999, 32, 1, "sigmoid", False, True, 2.5, None, None, None, True),
    "mixtral_top1": (1500, 8, 1, "softmax", True, False, None, None, None, None, True),
}


@pytest.mark.parametrize("name", sorted(HF_RULES))
def test_triton_routing_follows_transformers_rules(name):
    from moe_sft.kernels import router_topk, routing

    tokens, experts, k, score, pre, bias, scale, groups, kept, per_group, normalize = HF_RULES[name]
    g = torch.Generator(device="cuda").manual_seed(2)
    logits = torch.randn(tokens, experts, device="cuda", generator=g) * 2
    expert_bias = torch.randn(experts, device="cuda", generator=g) * 0.1 if bias else None
    grad = torch.randn(tokens, experts, device="cuda", generator=g)
    token = routing._ACTIVE.set((per_group, normalize))
    try:
        rule = routing.routing_rule(k, pre, groups, kept, score)
        assert not rule.is_megatrons and router_topk._kernel_fits(logits, k)
        assert router_topk._groups_fit(experts, k, groups, kept, per_group)

        def run(fn, *args):
            x = logits.clone().requires_grad_(True)
            probs, routing_map = fn(x, k, *args)
            probs.backward(grad)
            return probs, routing_map, x.grad

        probs, routing_map, d_logits = run(
            lambda x, k: router_topk.topk_routing_with_score_function(
                x,
                k,
                use_pre_softmax=pre,
                num_groups=groups,
                group_topk=kept,
                scaling_factor=scale,
                score_function=score,
                expert_bias=expert_bias,
            )
        )
        ref = run(lambda x, k: routing.torch_topk_routing(x, k, rule, groups, kept, scale, score, expert_bias))
    finally:
        routing._ACTIVE.reset(token)
    assert torch.equal(routing_map, ref[1]) and routing_map.sum(1).eq(k).all()
    torch.testing.assert_close(probs, ref[0], rtol=1e-5, atol=1e-6)
    torch.testing.assert_close(d_logits, ref[2], rtol=1e-4, atol=1e-6)


@pytest.mark.parametrize("score", ["softmax", "sigmoid"])
def test_triton_aux_loss_scores_match_megatron_s_and_take_the_aux_loss_s_broadcast_gradient(score):
    from moe_sft.kernels import router_topk

    g = torch.Generator(device="cuda").manual_seed(2)
    logits = torch.randn(4096, 128, device="cuda", generator=g)
    padding = torch.rand(4096, device="cuda", generator=g) < 0.1
    per_expert = torch.randn(128, device="cuda", generator=g)  # d aux / d scores: one value per expert

    def run(fn):
        x = logits.clone().requires_grad_(True)
        routing_map, scores = fn(x, 8, score, padding_mask=padding)
        (scores.sum(0) * per_expert).sum().backward()  # as megatron's aux loss: a [tokens] stride of 0
        return routing_map, scores, x.grad

    ours, ref = run(router_topk.compute_routing_scores_for_aux_loss), run(router_topk._megatron_aux_loss_scores)
    assert torch.equal(ours[0], ref[0]) and ours[0][padding].sum() == 0
    torch.testing.assert_close(ours[1], ref[1], rtol=1e-6, atol=1e-7)
    torch.testing.assert_close(ours[2], ref[2], rtol=1e-5, atol=1e-6)
