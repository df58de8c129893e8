"""moe_sft.kernels.rope against megatron-core's own THD rotary embedding: the same values."""

import types

import pytest
import torch
from megatron.core.models.common.embeddings import rope_utils

from moe_sft.kernels import rope

CP1 = types.SimpleNamespace(size=lambda: 1, rank=lambda: 0)


def _freqs(rows: int, dim: int) -> torch.Tensor:
    inv = 1.0 / (10000 ** (torch.arange(0, dim, 2, dtype=torch.float64) / dim))
    angles = torch.outer(torch.arange(rows, dtype=torch.float64), inv)
    return torch.cat([angles, angles], dim=-1)[:, None, None, :]


@pytest.mark.parametrize("lengths", [(5, 11, 3, 1), (20,), (4, 0, 9, 0, 7)])
@pytest.mark.parametrize("freq_rows", ["longest document", "one per token"])
@pytest.mark.parametrize(
    "variant", [dict(), dict(rotary_interleaved=True), dict(multi_latent_attention=True), dict(mscale=0.7)]
)
def test_sync_free_rope_equals_megatron(lengths, freq_rows, variant):
    cu_seqlens = torch.tensor((0, *torch.tensor(lengths).cumsum(0).tolist()), dtype=torch.int32)
    tokens, dim = int(cu_seqlens[-1]), 16
    rows = max(lengths) if freq_rows == "longest document" else tokens
    t = torch.randn(tokens, 3, dim, dtype=torch.float64, generator=torch.Generator().manual_seed(len(lengths)))
    freqs = _freqs(rows, dim)
    ours = rope.apply_rope_thd(t, cu_seqlens, freqs, cp_group=CP1, **variant)
    ref = rope._megatron_rope_thd(t, cu_seqlens, freqs, cp_group=CP1, **variant)
    torch.testing.assert_close(ours, ref, rtol=0, atol=0)


def test_positions_restart_in_every_document():
    cu_seqlens = torch.tensor([0, 3, 3, 5, 9], dtype=torch.int32)
    assert rope.positions_in_documents(cu_seqlens, 9).tolist() == [0, 1, 2, 0, 1, 0, 1, 2, 3]


def test_megatron_uses_it_once_fixes_are_applied():
    from moe_sft.config import KernelsConfig
    from moe_sft.kernels import install
    from moe_sft.runtime import megatron_fixes

    megatron_fixes.apply_megatron_fixes()
    install.install(KernelsConfig())
    assert rope_utils._apply_rotary_pos_emb_thd is rope.apply_rope_thd


def test_the_kernel_tile_depends_on_the_width_per_token_only():
    """The sweep's tiles at 4096 tokens (q [*, 32, 128]: 4096; k [*, 4, 128]: 1024), whatever a
    micro-batch's token count: a tile is a compile-time constant, so a short micro-batch must not
    change it (the GPU side: tests/gpu/test_gpu_rope.py)."""
    assert rope.tile_elements(heads=32, half_block=64) == rope.TILE == 4096
    assert rope.tile_elements(heads=4, half_block=64) == rope.MIN_TILE == 1024
    assert rope.tile_elements(heads=8, half_block=32) == 1024  # MLA's rope part is narrower still
    assert rope.tile_elements(heads=16, half_block=64) == 4096
    assert rope.tile_elements(heads=8, half_block=64) == 2048
