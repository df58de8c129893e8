"""moe_sft/kernels/install.py: kernels.fused switches every global swap on and off, and a tiny model
trains the same either way (fp32 on CPU: the kernels compute what megatron's functions compute)."""

from __future__ import annotations

import pytest
import torch

from moe_sft.config import KernelsConfig
from moe_sft.kernels import install
from moe_sft.models import qwen3_moe
from tests.train_steps import adam_steps, random_batches

VOCAB = 300


@pytest.fixture
def restore_defaults():
    yield
    install.install(KernelsConfig())


def test_off_restores_megatron_s_functions_and_on_installs_ours(restore_defaults):
    from megatron.core.models.common.embeddings import rope_utils
    from megatron.core.transformer.moe import router, token_dispatcher

    from moe_sft.kernels import cross_entropy, permute, rms_norm, rope, router_topk, wgrad

    install.install(KernelsConfig(fused=False))
    megatron = (token_dispatcher.permute, router.topk_routing_with_score_function, rope_utils._apply_rotary_pos_emb_thd)
    assert megatron[0].__module__.startswith("megatron.") and megatron[2].__module__.startswith("megatron.")
    assert not cross_entropy.ENABLED and not wgrad.ENABLED and not rms_norm.ENABLED
    lines = install.install(KernelsConfig(wgrad_overlap=False))
    assert token_dispatcher.permute is permute.permute
    assert router.topk_routing_with_score_function is router_topk.topk_routing_with_score_function
    assert rope_utils._apply_rotary_pos_emb_thd is rope.apply_rope_thd
    assert cross_entropy.ENABLED and wgrad.ENABLED and rms_norm.ENABLED and not wgrad.OVERLAP and len(lines) >= 6
    install.install(KernelsConfig(fused=False))
    assert (
        token_dispatcher.permute,
        router.topk_routing_with_score_function,
        rope_utils._apply_rotary_pos_emb_thd,
    ) == megatron


def test_a_tiny_model_trains_the_same_with_kernels_off_and_on(restore_defaults):
    from moe_sft.conversion.single_rank import single_rank_model

    hf_cfg = qwen3_moe.tiny_hf_config(vocab_size=VOCAB)
    batches = random_batches(VOCAB, (24, 31))

    def losses(fused: bool) -> list[float]:
        torch.manual_seed(0)
        model = single_rank_model(qwen3_moe.FAMILY, hf_cfg)
        install.install(KernelsConfig(fused=fused))  # after single_rank_model's own (default) install
        return adam_steps(model, batches, VOCAB, "cpu", steps=2, lr=3e-3)[0]

    off, on = losses(False), losses(True)
    assert len(off) == 2 and off[1] != off[0]
    torch.testing.assert_close(torch.tensor(on), torch.tensor(off), rtol=1e-5, atol=1e-6)
