"""The Triton grouped weight-gradient kernel (moe_sft/kernels/wgrad.py) at Qwen3-30B-A3B's expert
shapes: out[e] += x_e^T dy_e equals the fp64 product of the same bf16 values to fp32 rounding,
experts without rows leave their slice untouched, and the autograd function returns grouped_mm's
input gradient. (The DDP interplay: tests/gpu/test_gpu_parity.py.)"""

import pytest
import torch
import torch.nn.functional as F

pytestmark = pytest.mark.gpu


def _routed_rows(tokens=4096, experts=128, topk=8, idle=(5, 77)):
    g = torch.Generator().manual_seed(0)
    scores = torch.rand(tokens, experts, generator=g) ** 3  # skewed: busy and quiet experts
    scores[:, list(idle)] = -1
    counts = torch.bincount(scores.topk(topk, dim=1).indices.flatten(), minlength=experts)
    return counts


@pytest.mark.parametrize("k,n", [(2048, 1536), (768, 2048)])  # fc1 (gate+up), fc2
def test_grouped_wgrad_accumulates_the_fp64_product(k, n):
    from moe_sft.kernels.wgrad import accumulate_grouped_wgrad

    counts = _routed_rows()
    ends = torch.cumsum(counts, 0, dtype=torch.int32).cuda()
    rows = int(counts.sum())
    x = torch.randn(rows, k, device="cuda").bfloat16()
    dy = torch.randn(rows, n, device="cuda").bfloat16()
    out = torch.randn(len(counts), k, n, device="cuda")
    before = out.clone()
    accumulate_grouped_wgrad(x, dy, ends, out)

    start = 0
    for e, c in enumerate(counts.tolist()):
        if c == 0:
            assert torch.equal(out[e], before[e]), e
            continue
        exact = before[e].double() + x[start : start + c].double().T @ dy[start : start + c].double()
        err = (out[e].double() - exact).abs().max().item()
        assert err <= 1e-5 * exact.abs().max().item() + 1e-4, (e, c, err)
        start += c


def test_autograd_function_gives_grouped_mm_input_gradient_and_fills_main_grad():
    from moe_sft.kernels.wgrad import GroupedMatmulIntoMainGrad

    experts, k, n = 16, 256, 512
    counts = torch.randint(0, 64, (experts,))
    ends = torch.cumsum(counts, 0, dtype=torch.int32).cuda()
    weight = torch.nn.Parameter(torch.randn(k, experts * n, device="cuda").bfloat16())
    weight.main_grad = torch.zeros(weight.shape, device="cuda")
    reference = torch.nn.Parameter(weight.detach().clone())
    x = torch.randn(int(counts.sum()), k, device="cuda").bfloat16().requires_grad_(True)
    x_ref = x.detach().clone().requires_grad_(True)
    g = torch.randn(x.shape[0], n, device="cuda").bfloat16()

    out = GroupedMatmulIntoMainGrad.apply(x, weight, ends, (experts, k, n))
    out.backward(g)
    ref = F.grouped_mm(x_ref, reference.view(experts, k, n), offs=ends)
    ref.backward(g)

    assert torch.equal(out, ref)
    torch.testing.assert_close(x.grad, x_ref.grad)
    assert weight.grad_added_to_main_grad
    scale = reference.grad.float().abs().max().item()
    assert (weight.main_grad - reference.grad.float()).abs().max().item() <= 1e-2 * scale
