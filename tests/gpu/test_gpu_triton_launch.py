"""moe_sft/kernels/triton_launch.py on CUDA: launches through the compiled launcher give Triton's
results across specialisations (sizes that do or do not divide by 16, misaligned pointers, dtypes)."""

import pytest
import torch

pytestmark = pytest.mark.gpu


def test_direct_launches_match_torch_for_every_specialisation():
    import triton
    import triton.language as tl

    from moe_sft.kernels import triton_launch

    @triton.jit
    def _axpy(x_ptr, y_ptr, out_ptr, n, alpha, BLOCK: tl.constexpr):
        i = tl.program_id(0) * BLOCK + tl.arange(0, BLOCK)
        x = tl.load(x_ptr + i, mask=i < n).to(tl.float32)
        y = tl.load(y_ptr + i, mask=i < n).to(tl.float32)
        tl.store(out_ptr + i, (alpha * x + y).to(out_ptr.dtype.element_ty), mask=i < n)

    base = torch.randn(5000, device="cuda")
    # powers of two: alpha * x is exact, so Triton's fused multiply-add rounds as torch does
    cases = [
        (base[:4096], 2.0),
        (base[:4095], 4.0),
        (base[1:4097], 0.5),
        (base[:1], 0.25),
        (base[:4096].to(torch.bfloat16), 2.0),
    ]
    for repeat in range(3):  # the first round fills the cache through Triton, the next ones launch directly
        for x, alpha in cases:
            y = torch.randn_like(x)
            out = torch.empty_like(x)
            triton_launch.launch(_axpy, (triton.cdiv(x.numel(), 256),), x, y, out, x.numel(), alpha, BLOCK=256)
            ref = (alpha * x.float() + y.float()).to(x.dtype)
            assert torch.equal(out, ref), (repeat, x.numel(), x.dtype)
    entries = [v for k, v in triton_launch._cache.items() if k[0] is _axpy]
    assert len(entries) == len(cases) and all(v is not triton_launch._UNUSABLE for v in entries)


def test_a_do_not_specialize_count_launches_one_kernel_for_every_value():
    """A token count declared do_not_specialize: one cache entry serves 1, 16, 17 and 4096, each
    launched directly through the kernel compiled for the first, with Triton's results."""
    import triton
    import triton.language as tl

    from moe_sft.kernels import triton_launch

    @triton.jit(do_not_specialize=["n"])
    def _scale(x_ptr, out_ptr, n, BLOCK: tl.constexpr):
        i = tl.program_id(0) * BLOCK + tl.arange(0, BLOCK)
        tl.store(out_ptr + i, tl.load(x_ptr + i, mask=i < n) * 2.0, mask=i < n)

    base = torch.randn(5000, device="cuda")
    for n in (17, 1, 16, 4096, 17):
        out = torch.full_like(base, -1.0)
        triton_launch.launch(_scale, (triton.cdiv(n, 256),), base, out, n, BLOCK=256)
        assert torch.equal(out[:n], base[:n] * 2.0) and bool((out[n:] == -1.0).all()), n
    entries = [v for k, v in triton_launch._cache.items() if k[0] is _scale]
    assert len(entries) == 1 and entries[0] is not triton_launch._UNUSABLE
