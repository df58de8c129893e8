"""On CUDA, our RMSNorm runs one Triton kernel each way (moe_sft/layers/norm.py): its output equals
transformers' Qwen3MoeRMSNorm in bf16 (to the reduction order's rare 1-ulp differences), its
gradients are the fp32 math of the same formula rounded once, and it keeps only what the planner
counts (the input as it is, one fp32 1/rms per row), at the hidden norms' and qk-norm's shapes."""

import pytest
import torch

pytestmark = pytest.mark.gpu

HIDDEN, QK_NORM = (4096, 2048), (4096, 32, 128)  # Qwen3-30B-A3B: input/pre-MLP norm; q norm (32 heads x 128)


def _saved_storages(module, x):
    """module(x), and {storage pointer: bytes} of what autograd saved for its backward."""
    storages = {}

    def pack(t):
        storages[t.untyped_storage().data_ptr()] = t.untyped_storage().nbytes()
        return t

    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        return module(x), storages


def _modules(width, dtype=torch.bfloat16):
    from megatron.core.transformer.transformer_config import TransformerConfig
    from transformers.models.qwen3_moe.modeling_qwen3_moe import Qwen3MoeRMSNorm

    from moe_sft.layers.norm import RMSNorm

    config = TransformerConfig(num_layers=1, hidden_size=2048, num_attention_heads=16, params_dtype=dtype)
    ours = RMSNorm(config, width).cuda()
    theirs = Qwen3MoeRMSNorm(width, eps=1e-6).to("cuda", dtype)
    with torch.no_grad():
        ours.weight.normal_()
        theirs.weight.copy_(ours.weight)
    return ours, theirs


def _fp64_reference(x, weight, dy, eps=1e-6):
    """The module's backward in fp64 from the same inputs: dx of y_hat = x * rstd with
    grad g = dy * w; dw = sum over rows of dy * y_hat, y_hat rounded to x's dtype as in forward.
    Also the largest |dy * y_hat| per column (see the dw bound)."""
    xd = x.double()
    rstd = torch.rsqrt(xd.pow(2).mean(-1, keepdim=True) + eps)
    x_hat = xd * rstd
    g = dy.double() * weight.double()
    dx = rstd * (g - x_hat * (g * x_hat).mean(-1, keepdim=True))
    terms = (dy.double() * x_hat.to(x.dtype).double()).reshape(-1, x.shape[-1])
    return dx, terms.sum(0), terms.abs().amax(0)


@pytest.mark.parametrize("shape", [HIDDEN, QK_NORM], ids=["hidden", "qk_norm"])
def test_fused_rmsnorm_saves_what_the_planner_counts_and_matches_transformers(shape):
    from moe_sft.layers.norm import triton_fits
    from moe_sft.plan.memory import _norm

    ours, theirs = _modules(shape[-1])
    x = torch.randn(shape, device="cuda", dtype=torch.bfloat16, requires_grad=True)
    assert triton_fits(x, ours.weight)
    y, storages = _saved_storages(ours, x)
    storages.pop(ours.weight.untyped_storage().data_ptr(), None)
    rows = x.numel() // shape[-1]
    assert sum(storages.values()) == _norm(rows, shape[-1])
    # the kernel sums x^2 in another order than torch.mean: rarely, y_hat rounds the other way
    # (one bf16 ulp of y_hat, so at most 2 of y)
    reference = theirs(x)
    assert y.dtype == reference.dtype == torch.bfloat16 and y.shape == reference.shape
    torch.testing.assert_close(y, reference, rtol=2**-6, atol=0)
    assert (y != reference).float().mean() < 1e-4


@pytest.mark.parametrize(
    "shape,dtype",
    [(HIDDEN, torch.bfloat16), (QK_NORM, torch.bfloat16), (HIDDEN, torch.float32)],
    ids=["hidden", "qk_norm", "hidden_fp32"],
)
def test_fused_rmsnorm_gradients_match_fp64_math(shape, dtype):
    """bf16: dx and dw are their fp64 values rounded once (within one bf16 ulp: rtol 2^-7), up to
    fp32 arithmetic error far below that (absolute 1e-5 of the largest gradient). fp32: within that
    absolute error alone. dw may also differ by one rounding of y_hat per column (2^-7 of its
    largest term |dy * y_hat|, 2^-23 in fp32): the reference rounds y_hat from fp64, the kernel
    from fp32, and rarely the two round apart (measured on an H200: one of 2048 columns)."""
    ours, _ = _modules(shape[-1], dtype)
    g = torch.Generator(device="cuda").manual_seed(0)
    x = (torch.randn(shape, device="cuda", generator=g) * 3).to(dtype).requires_grad_(True)
    dy = torch.randn(shape, device="cuda", generator=g).to(dtype)
    ours(x).backward(dy)
    dx, dw, largest_term = _fp64_reference(x.detach(), ours.weight.detach(), dy)
    assert x.grad.dtype == dtype and ours.weight.grad.dtype == dtype
    bf16 = dtype == torch.bfloat16
    rtol = 2**-7 if bf16 else 0.0
    torch.testing.assert_close(x.grad.double(), dx, rtol=rtol, atol=1e-5 * dx.abs().max().item())
    y_hat_rounding = largest_term * (2**-7 if bf16 else 2**-23)
    bound = rtol * dw.abs() + 1e-5 * dw.abs().max() + y_hat_rounding
    assert ((ours.weight.grad.double() - dw).abs() <= bound).all()


def test_fused_rmsnorm_takes_strided_inputs():
    """k of a split QKV output (a strided view: normalised in place of reading, saved as the view)
    and a transposed input (copied) give what their contiguous copies give, bit for bit."""
    ours, _ = _modules(128)
    qkv = torch.randn(1024, 1, 4, (8 + 2) * 128, device="cuda", dtype=torch.bfloat16)  # [s, b, groups, (q + k + v)]
    k = qkv.split([8 * 128, 128, 128], dim=3)[1]
    transposed = torch.randn(128, 2048, device="cuda", dtype=torch.bfloat16).t()
    for strided in (k, transposed):
        assert not strided.is_contiguous()
        a, b = strided.detach().requires_grad_(True), strided.detach().contiguous().requires_grad_(True)
        ya, storages = _saved_storages(ours, a)
        assert a.untyped_storage().data_ptr() in storages  # saved as it is, no copy kept
        ours.weight.grad = None
        dy = torch.randn_like(ya)
        ya.backward(dy)
        dw_a = ours.weight.grad
        ours.weight.grad = None
        yb = ours(b)
        yb.backward(dy)
        assert torch.equal(ya, yb) and torch.equal(a.grad, b.grad) and torch.equal(dw_a, ours.weight.grad)


def _round_once_matches(ours, theirs, shape, weight, offset: float):
    """A norm in the round-once order (fp32 x-hat times the fp32 scale `offset` + w, rounded once):
    its forward equals transformers' module in bf16 (to the reduction order's rare 1-ulp
    differences), dx and dw are their fp64 values within one bf16 rounding."""
    from moe_sft.layers.norm import triton_fits

    g = torch.Generator(device="cuda").manual_seed(1)
    with torch.no_grad():
        ours.weight.copy_(weight)
        theirs.weight.copy_(weight)
    x = (torch.randn(shape, device="cuda", generator=g) * 3).to(torch.bfloat16).requires_grad_(True)
    assert triton_fits(x, ours.weight)
    y = ours(x)
    reference = theirs(x)
    assert y.dtype == reference.dtype == torch.bfloat16
    torch.testing.assert_close(y, reference, rtol=2**-7, atol=0)
    assert (y != reference).float().mean() < 1e-4
    dy = torch.randn(shape, device="cuda", generator=g).to(torch.bfloat16)
    y.backward(dy)
    xd, wd, dyd = x.detach().double(), ours.weight.detach().double() + offset, dy.double()
    rstd = torch.rsqrt(xd.pow(2).mean(-1, keepdim=True) + 1e-6)
    x_hat = xd * rstd
    gd = dyd * wd
    dx = rstd * (gd - x_hat * (gd * x_hat).mean(-1, keepdim=True))
    dw = (dyd * x_hat).reshape(-1, shape[-1]).sum(0)
    torch.testing.assert_close(x.grad.double(), dx, rtol=2**-7, atol=1e-5 * dx.abs().max().item())
    torch.testing.assert_close(ours.weight.grad.double(), dw, rtol=2**-7, atol=1e-5 * dw.abs().max().item())


def _weight(width: int, around: float) -> torch.Tensor:
    g = torch.Generator(device="cuda").manual_seed(0)
    return around + torch.randn(width, device="cuda", generator=g) * 0.2


@pytest.mark.parametrize("shape", [HIDDEN, QK_NORM], ids=["hidden", "qk_norm"])
def test_zero_centred_kernel_matches_transformers_and_fp64_math(shape):
    """Qwen3.5 / Qwen3-Next's zero-centred norm (fp32 x-hat times fp32 (1 + w), rounded once) in the
    same kernels, against transformers' Qwen3_5MoeRMSNorm."""
    from megatron.core.transformer.transformer_config import TransformerConfig
    from transformers.models.qwen3_5_moe.modeling_qwen3_5_moe import Qwen3_5MoeRMSNorm

    from moe_sft.layers.norm import RMSNorm

    config = TransformerConfig(
        num_layers=1, hidden_size=2048, num_attention_heads=16, params_dtype=torch.bfloat16,
        layernorm_zero_centered_gamma=True,
    )  # fmt: skip
    ours = RMSNorm(config, shape[-1]).cuda()
    theirs = Qwen3_5MoeRMSNorm(shape[-1], eps=1e-6).to("cuda", torch.bfloat16)
    _round_once_matches(ours, theirs, shape, _weight(shape[-1], 0.0), offset=1.0)


@pytest.mark.parametrize("shape", [HIDDEN, (4096, 2, 512)], ids=["hidden", "full_attention_qk_norm"])
def test_gemma4_norm_kernel_matches_transformers_and_fp64_math(shape):
    """Gemma 4's norm (fp32 x-hat times the fp32 weight, rounded once: `round_hat=False`) in the same
    kernels, at the hidden width and its 512-wide full-attention heads, against transformers'
    Gemma4RMSNorm."""
    from megatron.core.transformer.transformer_config import TransformerConfig
    from transformers.models.gemma4.modeling_gemma4 import Gemma4RMSNorm as TheirNorm

    from moe_sft.layers.norm import Gemma4RMSNorm

    config = TransformerConfig(num_layers=1, hidden_size=2048, num_attention_heads=16, params_dtype=torch.bfloat16)
    ours = Gemma4RMSNorm(config, shape[-1]).cuda()
    theirs = TheirNorm(shape[-1], eps=1e-6).to("cuda", torch.bfloat16)
    _round_once_matches(ours, theirs, shape, _weight(shape[-1], 1.0), offset=0.0)
