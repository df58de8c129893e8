"""On CUDA our packed-sequence RoPE runs two Triton kernels: forward and backward equal megatron-core's own
`_apply_rotary_pos_emb_thd` bit for bit in bf16, for q, a k sliced out of the fused QKV output, MLA's rope
part and a partial rotary dim, and neither pass waits on the host."""

import types

import pytest
import torch

from moe_sft.kernels import rope

pytestmark = pytest.mark.gpu

CP1 = types.SimpleNamespace(size=lambda: 1, rank=lambda: 0)
DOCUMENTS = (1000, 37, 2048, 0, 11, 1000)  # 4096 packed tokens, an empty document among them


def _freqs(rows: int, rot_dim: int, base: float) -> torch.Tensor:
    """megatron's RotaryEmbedding table: fp32 [rows, 1, 1, rot_dim], the angles repeated for both halves."""
    inv = 1.0 / (base ** (torch.arange(0, rot_dim, 2, dtype=torch.float32, device="cuda") / rot_dim))
    angles = torch.outer(torch.arange(rows, dtype=torch.float32, device="cuda"), inv)
    return torch.cat([angles, angles], dim=-1)[:, None, None, :]


def _q(tokens):  # [tokens, 32, 128]: the reshaped q is its own tensor
    return torch.randn(tokens, 32, 128, device="cuda", dtype=torch.bfloat16), lambda x: x


def _k(tokens):  # [tokens, 4, 128] sliced from a fused QKV output [tokens, 4 groups, (8 q + k + v) x 128]
    return torch.randn(tokens, 4, 10 * 128, device="cuda", dtype=torch.bfloat16), lambda x: x[:, :, 1024:1152]


def _mla(tokens):  # MLA's rope part [tokens, 16, 64], split from q [tokens, 16, 128 nope + 64 rope]
    return torch.randn(tokens, 16, 192, device="cuda", dtype=torch.bfloat16), lambda x: x[:, :, 128:]


def _partial(tokens):  # rotary on the first 64 of 128 dims, the rest passed through
    return torch.randn(tokens, 8, 128, device="cuda", dtype=torch.bfloat16), lambda x: x


CASES = {
    "q": (_q, 128, dict()),
    "k view": (_k, 128, dict()),
    "mla": (_mla, 64, dict(multi_latent_attention=True, mscale=1.2076)),  # a YaRN-style mscale
    "partial rot_dim": (_partial, 64, dict(mscale=0.7)),
}


def _run(fn, leaf, view, cu_seqlens, freqs, grad, variant):
    """fn's output and the gradient reaching the leaf that t is a view of."""
    leaf = leaf.detach().clone().requires_grad_()
    out = fn(view(leaf), cu_seqlens, freqs, cp_group=CP1, **variant)
    out.backward(grad)
    return out.detach(), leaf.grad


@pytest.mark.parametrize("freq_rows", ["longest document", "one per token"])
@pytest.mark.parametrize("case", list(CASES))
def test_fused_rope_equals_megatron_without_host_syncs(case, freq_rows):
    make, rot_dim, variant = CASES[case]
    torch.manual_seed(0)
    leaf, view = make(sum(DOCUMENTS))
    cu_seqlens = torch.tensor((0, *torch.tensor(DOCUMENTS).cumsum(0).tolist()), dtype=torch.int32, device="cuda")
    freqs = _freqs(max(DOCUMENTS) if freq_rows == "longest document" else sum(DOCUMENTS), rot_dim, base=1e6)
    grad = torch.randn_like(view(leaf))
    assert rope._fused_path_applies(view(leaf), freqs, False, variant.get("mscale", 1.0))

    ref_out, ref_grad = _run(rope._megatron_rope_thd, leaf, view, cu_seqlens, freqs, grad, variant)
    torch.cuda.synchronize()
    torch.cuda.set_sync_debug_mode("error")  # a host sync in our forward or backward raises
    try:
        out, out_grad = _run(rope.apply_rope_thd, leaf, view, cu_seqlens, freqs, grad, variant)
    finally:
        torch.cuda.set_sync_debug_mode("default")
    # both call CUDA's cosf / sinf on the same fp32 angles and round each op alike
    assert torch.equal(out, ref_out)
    assert torch.equal(out_grad, ref_grad)


@pytest.mark.parametrize("case", ["q", "k view"])
def test_a_short_micro_batch_compiles_nothing_new(case):
    """Packs end with short micro-batches: one of another token count must reuse the kernels compiled
    for the first (their tile comes from the width per token; a mid-run compile is ~0.4 s)."""
    from moe_sft.kernels import triton_launch

    make, rot_dim, variant = CASES[case]

    def compiled():
        return sum(1 for key in triton_launch._cache if key[0] is rope._rope_kernel)

    before = None
    for tokens in (4096, 8192, 700, 33, 1):
        leaf, view = make(tokens)
        cu_seqlens = torch.tensor([0, tokens // 2, tokens], dtype=torch.int32, device="cuda")
        _run(
            rope.apply_rope_thd,
            leaf,
            view,
            cu_seqlens,
            _freqs(tokens, rot_dim, base=1e6),
            torch.randn_like(view(leaf)),
            variant,
        )
        before = compiled() if before is None else before
        assert compiled() == before, f"{tokens} tokens compiled a new _rope_kernel specialisation"
