"""Every patch in moe_sft/runtime/compat.py does what its comment says (CPU machines only)."""

from __future__ import annotations

import pytest
import torch

from moe_sft.runtime import compat

pytestmark = pytest.mark.skipif(torch.cuda.is_available(), reason="CPU compat is for CUDA-less machines")


@pytest.fixture(scope="module", autouse=True)
def patched():
    compat.apply_megatron_fixes()
    compat.apply_cpu_compat()


def test_cuda_device_requests_land_on_cpu():
    assert torch.empty(3, device="cuda").device.type == "cpu"
    assert torch.zeros(2, device=torch.device("cuda", 0)).device.type == "cpu"
    assert torch.ones(2, device=torch.cuda.current_device()).device.type == "cpu"
    x = torch.arange(4)
    assert x.to("cuda").device.type == "cpu" and x.cuda() is x
    assert x.to(device="cuda", dtype=torch.float32).dtype == torch.float32


def test_meta_device_context_still_works_under_the_factory_wrappers():
    # transformers' from_pretrained and the streaming converter build models under it
    with torch.device("meta"):
        assert torch.empty(3).is_meta and torch.zeros(2, 2).is_meta
        assert torch.nn.Linear(4, 4).weight.is_meta


def test_tensor_type_reports_cuda_names_for_megatron_asserts():
    assert torch.zeros(1).type() == "torch.cuda.FloatTensor"
    assert torch.zeros(1, dtype=torch.bfloat16).type() == "torch.cuda.BFloat16Tensor"
    assert torch.zeros(1).type(torch.float64).dtype == torch.float64  # the converting form still works


def test_cuda_streams_and_events_are_noops():
    stream = torch.cuda.Stream()
    with torch.cuda.stream(stream):
        event = torch.cuda.Event()
        event.record()
    torch.cuda.current_stream().wait_stream(stream)
    torch.cuda.synchronize()
    assert event.query()


def test_cuda_rng_maps_to_the_cpu_generator():
    torch.cuda.manual_seed(123)
    a = torch.rand(3)
    torch.cuda.set_rng_state(torch.cuda.get_rng_state())
    torch.cuda.manual_seed(123)
    assert torch.equal(a, torch.rand(3))


def test_megatron_fused_functions_run_eager():
    from megatron.core.fusions.fused_bias_swiglu import bias_swiglu_impl
    from torch._dynamo.utils import counters

    def compiled_frames(x):
        counters.clear()
        torch._dynamo.reset()
        y = bias_swiglu_impl(x, None)
        assert torch.allclose(y, torch.nn.functional.silu(x[:, :4]) * x[:, 4:])
        return counters["stats"]["unique_graphs"]

    x = torch.randn(4, 8)
    assert compiled_frames(x) == 0
    # the control: GPU's behaviour. torch's own patch restores the CPU compat's setting on exit
    # (pytest's monkeypatch deletes it: tests/cpu/test_test_hygiene.py)
    with torch._dynamo.config.patch(disable=False):
        assert compiled_frames(x) > 0
    assert torch._dynamo.config.disable


def test_suspended_restores_plain_torch_and_reapplies():
    patched_empty = torch.empty
    with compat.suspended():
        assert torch.empty is not patched_empty
        with pytest.raises((RuntimeError, AssertionError)):
            torch.empty(1, device="cuda")  # real torch: no CUDA here
    assert torch.empty is patched_empty


def test_megatron_router_gemm_name_exists_without_te():
    from megatron.core.transformer.moe import moe_utils

    assert moe_utils.te_general_gemm is None  # None selects the torch.mm branch


def test_fully_reshardable_load_keeps_adam_step():
    from megatron.core.optimizer.distrib_optimizer import DistributedOptimizer

    assert getattr(DistributedOptimizer._set_main_param_and_optimizer_states, "_moe_sft_fixed", False)
    # the load_state_dict wrapper that un-shares the step tensors is installed (its effect is
    # measured end to end by tests/dist/test_quickstart_e2e.py's resume equivalence)
    assert DistributedOptimizer.load_state_dict.__module__ == compat.__name__


def test_expert_bias_counts_skip_padding_tokens():
    from megatron.core.transformer.moe.router import TopKRouter

    router = type("R", (), {"enable_expert_bias": True, "local_tokens_per_expert": torch.zeros(3)})()
    routing_map = torch.tensor([[1, 0, 1], [0, 1, 1], [1, 1, 0], [1, 0, 1]], dtype=torch.bool)
    padding = torch.tensor([False, False, True, True])  # the last two tokens are padding
    TopKRouter._apply_expert_bias(router, routing_map, padding_mask=padding)
    assert router.local_tokens_per_expert.tolist() == [1.0, 1.0, 2.0]


def test_hybrid_optimizer_main_params_and_cpu_copies_follow_loaded_weights():
    """Optimizer CPU offload: after weights are loaded into the model, reload_model_params must
    refresh the fp32 main shard *and* the CPU copy the hybrid optimizer steps (megatron 0.16.1
    refreshed neither: the first step wrote the pre-load weights back)."""
    from types import SimpleNamespace

    from megatron.core.optimizer.cpu_offloading import HybridDeviceOptimizer
    from megatron.core.optimizer.distrib_optimizer import DistributedOptimizer, Range

    model_param = torch.arange(6, dtype=torch.bfloat16)  # the weights just loaded
    main = torch.zeros(4)  # this rank's fp32 shard: elements 2..5, still the pre-load values
    cpu_copy = torch.zeros(4)  # what the hybrid optimizer steps on the CPU
    hdo = HybridDeviceOptimizer.__new__(HybridDeviceOptimizer)
    hdo.gpu_params_map_cpu_copy, hdo.param_to_fp32_param = {main: cpu_copy}, {}
    hdo.param_update_in_fp32, hdo.state = True, {main: {"master_param": cpu_copy}}
    dist_opt = SimpleNamespace(
        optimizer=hdo, config=SimpleNamespace(use_precision_aware_optimizer_no_fp8_or_ds_fp8=False),
        ddp_config=SimpleNamespace(use_megatron_fsdp=False), is_stub_optimizer=False,
        model_float16_groups=[[model_param]], shard_fp32_from_float16_groups=[[main]],
        model_fp32_groups=[], shard_fp32_groups=[],
        _get_model_param_range_map=lambda p: {"param": Range(2, 6)})
    DistributedOptimizer._copy_model_params_to_main_params(dist_opt)
    assert main.tolist() == cpu_copy.tolist() == [2.0, 3.0, 4.0, 5.0]
    assert dist_opt.optimizer is hdo
    # a resume loads the main shard directly; the CPU copy follows it (megatron: KeyError)
    main.copy_(torch.tensor([7.0, 8.0, 9.0, 10.0]))
    hdo._update_fp32_params_by_new_state()
    assert cpu_copy.tolist() == [7.0, 8.0, 9.0, 10.0]


def test_train_entry_point_defaults_to_expandable_segments_unless_set(monkeypatch):
    from moe_sft import train

    monkeypatch.delenv("PYTORCH_CUDA_ALLOC_CONF", raising=False)
    monkeypatch.delenv("PYTORCH_ALLOC_CONF", raising=False)
    train.default_allocator_config()
    assert train.os.environ["PYTORCH_CUDA_ALLOC_CONF"] == "expandable_segments:True"
    monkeypatch.setenv("PYTORCH_CUDA_ALLOC_CONF", "max_split_size_mb:512")
    train.default_allocator_config()
    assert train.os.environ["PYTORCH_CUDA_ALLOC_CONF"] == "max_split_size_mb:512"
    monkeypatch.delenv("PYTORCH_CUDA_ALLOC_CONF")
    monkeypatch.setenv("PYTORCH_ALLOC_CONF", "expandable_segments:False")
    train.default_allocator_config()
    assert "PYTORCH_CUDA_ALLOC_CONF" not in train.os.environ
