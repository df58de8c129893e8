"""MoE routing statistics (moe_sft/trainer/moe_stats.py) and the step telemetry on one rank.

A real megatron TopKRouter with hand-set weights routes tokens to known experts, so the counts,
max/mean ratio, dead experts and entropies are known; padding, no-grad and eval forwards must
not be counted. Then one real training step through megatron's schedule: the logged per-layer
loads sum to top-k x real tokens, and the FLOPs are the formula's.
"""

from __future__ import annotations

import math

import pytest
import torch
from megatron.core.transformer.moe import moe_utils

from moe_sft.data.packing import build_micro_batch
from moe_sft.models import deepseek_v3, qwen3_moe
from moe_sft.trainer import flops
from moe_sft.trainer.metrics import Histogram, on_console
from moe_sft.trainer.moe_stats import MoERoutingStats, layer_stats, router_distribution, routing_metrics
from tests.train_steps import PromptedDoc

E, K, H = 8, 2, 128  # the tiny Qwen3-MoE: 8 experts, top-2, hidden 128


@pytest.fixture(scope="module")
def qwen():
    from moe_sft.conversion.single_rank import single_rank_model

    torch.manual_seed(0)
    hf_cfg = qwen3_moe.tiny_hf_config(vocab_size=300)
    return single_rank_model(qwen3_moe.FAMILY, hf_cfg), hf_cfg


def _entropy(logits) -> float:
    z = sum(math.exp(x) for x in logits)
    return -sum(math.exp(x) / z * (x - math.log(z)) for x in logits)


def test_layer_stats_of_known_counts():
    stats = layer_stats(torch.tensor([4.0, 0.0, 2.0, 2.0]), entropy_sum=3.0, tokens=4.0)
    assert stats["max_load_ratio"] == 2.0  # 4 / mean 2
    assert stats["dead_experts"] == 1.0
    assert stats["router_entropy"] == pytest.approx(3.0 / 4.0 / math.log(4))
    # load shares (1/2, 0, 1/4, 1/4): entropy 1.5 ln 2 = 0.75 ln 4
    assert stats["load_entropy"] == pytest.approx(0.75)
    balanced = layer_stats(torch.full((8,), 5.0), entropy_sum=0.0, tokens=20.0)
    assert balanced["max_load_ratio"] == 1.0 and balanced["load_entropy"] == pytest.approx(1.0)


def test_summary_over_layers_skips_layers_without_tokens():
    counts = torch.tensor([[4.0, 0.0, 2.0, 2.0], [0.0, 0.0, 0.0, 0.0], [2.0, 2.0, 2.0, 2.0]])
    out = routing_metrics(
        counts,
        torch.tensor([1.0, 0.0, 2.0]),
        torch.tensor([4.0, 0.0, 4.0]),
        drift=torch.tensor([[0.5, 0.4], [0.0, 0.0], [0.2, 0.1]]),
    )
    assert "moe/layer_1/max_load_ratio" not in out  # a dense layer: no row
    assert out["moe/max_load_ratio"] == 2.0 and out["moe/dead_experts"] == 1.0
    assert out["moe/router_entropy"] == pytest.approx((1 / 4 + 2 / 4) / 2 / math.log(4))
    assert out["moe/bias_drift"] == pytest.approx(0.4) and out["moe/layer_2/bias_drift_l2"] == pytest.approx(0.2)
    assert out["moe/layer_0/expert_load"] == Histogram([4.0, 0.0, 2.0, 2.0])
    on = sorted(k for k in out if on_console(k))
    assert on == ["moe/bias_drift", "moe/dead_experts", "moe/max_load_ratio", "moe/router_entropy"]


def test_sigmoid_router_distribution_is_normalised():
    logits = torch.tensor([[0.0, 1.0, -1.0, 2.0]])
    p = router_distribution(logits, "sigmoid")
    s = torch.sigmoid(logits)
    assert torch.allclose(p, s / s.sum()) and p.sum().item() == pytest.approx(1.0)
    assert torch.allclose(router_distribution(logits, "softmax"), torch.softmax(logits, -1))


def _known_tokens():
    """Token t has logit 3 on expert first[t], 2 on second[t], 0 elsewhere (router weight = I)."""
    first = [0, 0, 0, 1, 2, 3, 0, 7]
    second = [1, 2, 1, 0, 1, 2, 3, 6]
    x = torch.zeros(len(first), 1, H)  # [s, b, h]
    for t, (a, b) in enumerate(zip(first, second)):
        x[t, 0, a], x[t, 0, b] = 3.0, 2.0
    return x, first, second


def test_router_hook_counts_known_choices_and_skips_padding(qwen):
    model, _ = qwen
    router = model.decoder.layers[0].mlp.router
    with torch.no_grad():
        router.weight.zero_()
        router.weight[:, :E] = torch.eye(E)
    stats = MoERoutingStats([router], model.config, "cpu")
    x, first, second = _known_tokens()
    padding = torch.zeros(len(first), 1, dtype=torch.bool)
    padding[-1] = True  # the last token (experts 7 and 6) is padding
    router.train()
    router(x, padding)
    with torch.no_grad():  # the first forward of a recomputed layer, or evaluation: not counted
        router(x, padding)
    router.eval()
    router(x, padding)
    router.train()
    vector = stats.take(1.0, 1.0)
    out = stats.metrics(vector)
    want = [0.0] * E
    for a, b in zip(first[:-1], second[:-1]):
        want[a] += 1
        want[b] += 1
    assert want == [5, 4, 3, 2, 0, 0, 0, 0]
    assert out["moe/layer_0/expert_load"].counts == want
    assert sum(want) == K * 7  # top-k x real tokens
    assert out["moe/layer_0/dead_experts"] == 4.0
    assert out["moe/layer_0/max_load_ratio"] == pytest.approx(5 / (14 / 8))
    token_entropy = _entropy([3.0, 2.0] + [0.0] * (E - 2))  # every token has the same logits up to order
    assert out["moe/layer_0/router_entropy"] == pytest.approx(token_entropy / math.log(E), rel=1e-6)
    assert "moe/bias_drift" not in out  # Qwen3-MoE has no expert bias
    assert stats.take(1.0, 1.0).abs().sum() == 0  # take() resets the accumulator
    moe_utils.clear_aux_losses_tracker()


def test_expert_bias_drift_and_mtp_layers_are_tracked():
    from moe_sft.conversion.single_rank import single_rank_model
    from moe_sft.trainer.step import run_forward_backward

    torch.manual_seed(0)
    hf_cfg = deepseek_v3.tiny_hf_config(vocab_size=300, num_nextn_predict_layers=1)
    model = single_rank_model(deepseek_v3.FAMILY, hf_cfg)
    model.run_mtp = True
    stats = MoERoutingStats([model], model.config, "cpu")
    assert stats.has_expert_bias and sorted(stats.initial_bias) == [2, 3]  # layer 1 and the MTP layer
    batch = build_micro_batch([PromptedDoc(list(range(5, 40))), PromptedDoc(list(range(50, 70)))], pad_to=64)
    run_forward_backward([model], [batch], 30, "cpu", 300, seq_length=0, mtp_weight=0.3)
    delta = torch.tensor([0.5, -2.0, 0, 0, 0, 0, 0, 1.0])
    model.mtp.layers[0].transformer_layer.mlp.router.expert_bias.add_(delta)
    out = stats.metrics(stats.take(1.0, 1.0))
    assert "moe/layer_0/max_load_ratio" not in out  # layer 0 is dense (first_k_dense_replace=1)
    assert sum(out["moe/layer_1/expert_load"].counts) == K * (35 + 20)  # padding excluded
    # Layer 2 is the MTP layer: megatron 0.16.1's MTP block takes no padding_mask;
    # megatron_fixes.fix_mtp_router_padding gives it the decoder's, so its router counts only the
    # real tokens too (docs/layouts.md, "Upstream bug classes").
    assert sum(out["moe/layer_2/expert_load"].counts) == K * (35 + 20)
    assert out["moe/layer_2/bias_drift_max"] == pytest.approx(2.0)
    assert out["moe/layer_2/bias_drift_l2"] == pytest.approx(delta.norm().item())
    assert out["moe/layer_1/bias_drift_max"] == 0.0 and out["moe/bias_drift"] == pytest.approx(2.0)


def test_one_training_step_logs_loads_flops_and_progress(qwen, capsys):
    from moe_sft.trainer.step import run_forward_backward
    from moe_sft.trainer.telemetry import Telemetry

    model, hf_cfg = qwen
    g = torch.Generator().manual_seed(2)
    docs = [PromptedDoc(torch.randint(0, 300, (n,), generator=g).tolist()) for n in (30, 45, 9)]
    batches = [build_micro_batch(docs[:2], pad_to=128), build_micro_batch(docs[2:])]
    tel = Telemetry(
        config=model.config,
        model_chunks=[model],
        vocab_size=300,
        run_mtp=False,
        device="cpu",
        precision="fp32",
        peak_tflops=100.0,
        log_interval=2,
        max_steps=4,
    )
    for step in range(2):
        run_forward_backward([model], batches, 70, "cpu", 300, seq_length=0)
        metrics = tel.step_metrics(step, batches, seconds=0.5)
    for layer in (0, 1):
        assert sum(metrics[f"moe/layer_{layer}/expert_load"].counts) == K * (30 + 45 + 9)
    shape = flops.ModelShape.from_config(model.config, 300)
    step_flops = 3 * flops.forward_flops(shape, [30, 45, 9])
    assert metrics["perf/detail/model_tflop_per_step"] == pytest.approx(step_flops / 1e12, rel=1e-12)
    assert metrics["perf/detail/real_tokens"] == 30 + 45 + 9
    assert metrics["perf/tflops_per_gpu"] == pytest.approx(step_flops / 1e12 / 0.5)
    assert metrics["perf/mfu_pct"] == pytest.approx(metrics["perf/tflops_per_gpu"])  # peak 100
    lines = [ln for ln in capsys.readouterr().out.splitlines() if ln.startswith("[moe-sft] step")]
    assert len(lines) == 1 and lines[0].startswith("[moe-sft] step 2/4 (50.0%) elapsed 00:00:")
    assert " ETA 00:00:" in lines[0] and lines[0].endswith(" s/step")
