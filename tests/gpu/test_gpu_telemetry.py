"""Telemetry on a GPU: the router statistics never synchronise the host and cost little; the
quickstart logs peak memory, TFLOP/s and MFU (H100/H200 peaks are known by name).

    python -m pytest tests/gpu/test_gpu_telemetry.py -q -s
"""

from __future__ import annotations

from types import SimpleNamespace

import pytest
import torch

pytestmark = pytest.mark.gpu


def test_router_statistics_do_not_sync_and_are_cheap():
    from moe_sft.trainer.moe_stats import MoERoutingStats

    tokens, experts, topk = 32768, 256, 8  # a DeepSeek-V3 MoE layer's router on 32k tokens
    config = SimpleNamespace(
        num_moe_experts=experts, num_layers=1, mtp_num_layers=None, moe_router_score_function="sigmoid"
    )
    stats = MoERoutingStats([], config, "cuda")
    logits = torch.randn(tokens, 1, experts, device="cuda")
    routing_map = torch.zeros(tokens, experts, dtype=torch.bool, device="cuda")
    routing_map.scatter_(1, logits.view(tokens, experts).topk(topk, dim=-1).indices, True)
    padding = torch.zeros(tokens, 1, dtype=torch.bool, device="cuda")
    padding[-100:] = True
    stats.record(1, logits, routing_map, padding)  # warm-up
    torch.cuda.synchronize()
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    torch.cuda.set_sync_debug_mode("error")  # any host<->device sync in record() raises
    try:
        start.record()
        for _ in range(20):
            stats.record(1, logits, routing_map, padding)
        end.record()
        vector = stats.take(1.0, 1.0)
    finally:
        torch.cuda.set_sync_debug_mode(0)
    torch.cuda.synchronize()
    ms = start.elapsed_time(end) / 20
    print(f"router statistics: {ms * 1000:.1f} us per layer per micro-batch of {tokens} tokens x {experts} experts")
    counts = vector[:experts].cpu()
    assert counts.sum().item() == 21 * topk * (tokens - 100)
    # vs the expert matmuls of such a layer: 32768 x 8 x 3 x 2 x 7168 x 2048 x 3 (fwd+bwd) = 69 TFLOP,
    # ~100 ms at 700 TFLOP/s; the router statistics must stay a rounding error next to that
    assert ms < 1.0


def test_quickstart_logs_memory_tflops_and_mfu(tmp_path):
    from moe_sft.trainer.flops import default_peak_tflops
    from tests.dist.launch import step_metrics, torchrun

    proc = torchrun(
        1,
        [
            "trainer.max_steps=3",
            "trainer.log_interval=1",
            "trainer.export_hf_at_end=false",
            f"trainer.output_dir={tmp_path / 'run'}",
            f"model.hf_path={tmp_path / 'hf'}",
            f"model.mcore_path={tmp_path / 'mcore'}",
        ],
    )
    last = step_metrics(proc.stdout)[3]
    print({k: last[k] for k in last if k in ("max_allocated_gib", "max_reserved_gib", "tflops_per_gpu", "mfu_pct")})
    assert 0 < last["max_allocated_gib"] <= last["max_reserved_gib"]
    assert last["tflops_per_gpu"] > 0
    if default_peak_tflops(torch.cuda.get_device_name()):
        assert 0 < last["mfu_pct"] < 100
    assert "ETA" in proc.stdout and "telemetry: model FLOPs per token" in proc.stdout
