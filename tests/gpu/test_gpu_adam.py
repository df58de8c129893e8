"""The clip + Adam Triton kernel (moe_sft/kernels/adam.py) against Adam in fp64 and against
what it replaces (the foreach multiply by the clip coefficient, then torch's fused AdamW / Adam):
at least as close to fp64 as torch's kernel. (The whole trainer with it: tests/gpu/test_gpu_parity.py.)"""

import math

import pytest
import torch

pytestmark = pytest.mark.gpu


def _adam_fp64(param, grad, exp_avg, exp_avg_sq, step, group, decoupled, coeff):
    """Adam/AdamW in fp64 from fp32 inputs (the clip multiply in fp32, as the foreach op does it),
    with each result's scale: the sum of its terms' magnitudes (a result from cancelling terms is
    only as exact as the terms)."""
    lr, (b1, b2), eps, wd = group["lr"], group["betas"], group["eps"], group["weight_decay"]
    g = (grad * coeff if coeff is not None else grad).double()
    p, m, v = param.double(), exp_avg.double(), exp_avg_sq.double()
    decay = torch.zeros_like(p)
    if wd and decoupled:
        decay = lr * wd * p
    elif wd:
        g = g + wd * p
    m_scale, v_scale = (b1 * m).abs() + ((1 - b1) * g).abs(), b2 * v + (1 - b2) * g * g
    m, v = b1 * m + (1 - b1) * g, b2 * v + (1 - b2) * g * g
    denom = v.sqrt() / math.sqrt(1 - b2**step) + eps
    step_size = lr / (1 - b1**step)
    p_scale = p.abs() + decay.abs() + step_size * m_scale / denom
    return (p - decay - step_size * m / denom, p_scale), (m, m_scale), (v, v_scale)


def _error(x: torch.Tensor, exact: torch.Tensor, scale: torch.Tensor) -> float:
    """Largest |x - exact| in fp32 ulps of the result's scale (1 = one rounding of the largest term)."""
    return float(((x.double() - exact).abs() / (scale * 2.0**-23 + 1e-45)).max())


@pytest.mark.parametrize("decoupled", [True, False])
@pytest.mark.parametrize("weight_decay", [0.0, 0.1])
@pytest.mark.parametrize("coeff", [None, 0.37])
def test_kernel_matches_adam_in_fp64_as_closely_as_torch_fused_adam(decoupled, weight_decay, coeff):
    """Each step starts the kernel, torch's fused Adam (after the foreach clip multiply, what the
    kernel replaces) and the fp64 reference from the same state: per-step error, not drift."""
    from moe_sft.kernels import adam as adam_kernel

    numel = 3 * adam_kernel.BLOCK + 123  # a partial last program
    g = torch.Generator(device="cuda").manual_seed(0)
    param = torch.randn(numel, device="cuda", generator=g)
    exp_avg, exp_avg_sq = torch.zeros_like(param), torch.zeros_like(param)
    step = torch.zeros((), device="cuda")
    model_param = torch.empty(numel, device="cuda", dtype=torch.bfloat16)  # DDP's bf16 buffer slice
    kind = torch.optim.AdamW if decoupled else torch.optim.Adam
    ours, theirs = [0.0] * 3, [0.0] * 3
    for i in range(6):
        group = dict(lr=3e-3 * (1 - 0.1 * i), betas=(0.9, 0.95), eps=1e-8, weight_decay=weight_decay)
        grad = torch.randn(numel, device="cuda", generator=g) * (10.0 ** (i - 3))
        exact = _adam_fp64(param, grad, exp_avg, exp_avg_sq, i + 1, group, decoupled, coeff)
        ref = torch.nn.Parameter(param.clone())
        ref.grad = grad.clone()
        if coeff is not None:
            torch._foreach_mul_([ref.grad], coeff)
        reference = kind([ref], fused=True, **group)
        reference.state[ref] = {"step": step.clone(), "exp_avg": exp_avg.clone(), "exp_avg_sq": exp_avg_sq.clone()}
        reference.step()
        step += 1
        hyper = adam_kernel.hyper_parameters(group, coeff, "cuda")
        adam_kernel.adam_step(
            param,
            grad,
            exp_avg,
            exp_avg_sq,
            step,
            hyper,
            decoupled=decoupled,
            weight_decay=weight_decay != 0,
            grad_coeff=coeff is not None,
            model_param=model_param,
        )
        assert torch.equal(model_param, param.to(torch.bfloat16)), "the cast megatron's copy_ makes"
        state = reference.state[ref]
        assert float(state["step"]) == float(step)
        for k, (mine, torchs, (value, scale)) in enumerate(
            zip((param, exp_avg, exp_avg_sq), (ref.detach(), state["exp_avg"], state["exp_avg_sq"]), exact)
        ):
            ours[k] = max(ours[k], _error(mine, value, scale))
            theirs[k] = max(theirs[k], _error(torchs, value, scale))
    print(
        f"\nulps of the scale from fp64 Adam, 6 steps (param, exp_avg, exp_avg_sq): kernel "
        f"{[round(x, 2) for x in ours]}, torch fused {[round(x, 2) for x in theirs]}"
    )
    assert max(ours) <= 2.0, ours
    assert all(a <= b + 1.0 for a, b in zip(ours, theirs)), (ours, theirs)


def test_offsets_past_two_to_the_31_elements():
    """DeepSeek-V3's stacked expert weights pass 2^31 elements per tensor: 64-bit offsets."""
    from moe_sft.kernels import adam as adam_kernel

    free, _ = torch.cuda.mem_get_info()
    numel = 2**31 + 3 * 1024 + 5
    if free < 5 * numel * 4 + numel * 2:  # 44 GiB: fits an H100/H200; a smaller or shared GPU cannot
        pytest.skip(f"needs {(5 * 4 + 2) * numel / 2**30:.0f} GiB of free GPU memory")
    param = torch.randn(numel, device="cuda")
    grad = torch.randn(numel, device="cuda")
    exp_avg, exp_avg_sq = torch.zeros_like(param), torch.zeros_like(param)
    head, tail = slice(0, 4096), slice(numel - 4096, numel)
    expected = []
    for part in (head, tail):
        ref = torch.nn.Parameter(param[part].clone())
        ref.grad = grad[part].clone()
        torch.optim.AdamW([ref], lr=1e-2, weight_decay=0.1, fused=True).step()
        expected.append(ref.detach())
    hyper = adam_kernel.hyper_parameters(dict(lr=1e-2, betas=(0.9, 0.999), eps=1e-8, weight_decay=0.1), None, "cuda")
    model_param = torch.zeros(numel, device="cuda", dtype=torch.bfloat16)
    adam_kernel.adam_step(
        param,
        grad,
        exp_avg,
        exp_avg_sq,
        torch.ones((), device="cuda"),
        hyper,
        decoupled=True,
        weight_decay=True,
        grad_coeff=False,
        model_param=model_param,
    )
    for part, want in zip((head, tail), expected):
        torch.testing.assert_close(param[part], want, rtol=1e-6, atol=1e-7)
        assert torch.equal(model_param[part], param[part].to(torch.bfloat16))


def test_a_step_does_not_make_the_host_wait():
    """The hyper-parameters go up through pinned memory: no host sync between groups' kernels."""
    from moe_sft.kernels import adam as adam_kernel

    param = torch.randn(10_000, device="cuda")
    grad, exp_avg, exp_avg_sq = torch.randn_like(param), torch.zeros_like(param), torch.zeros_like(param)
    step = torch.ones((), device="cuda")
    torch.cuda.synchronize()
    torch.cuda.set_sync_debug_mode("error")
    try:
        for coeff in (None, 0.5):
            hyper = adam_kernel.hyper_parameters(
                dict(lr=1e-3, betas=(0.9, 0.95), eps=1e-8, weight_decay=0.1), coeff, "cuda"
            )
            adam_kernel.adam_step(
                param,
                grad,
                exp_avg,
                exp_avg_sq,
                step,
                hyper,
                decoupled=True,
                weight_decay=True,
                grad_coeff=coeff is not None,
            )
    finally:
        torch.cuda.set_sync_debug_mode("default")
    assert torch.isfinite(param).all()
