"""Every patch in moe_sft/runtime/cpu_compat.py does what its comment says (CPU machines only)."""

from __future__ import annotations

import pytest
import torch

from moe_sft.runtime import cpu_compat, megatron_fixes

pytestmark = pytest.mark.skipif(torch.cuda.is_available(), reason="CPU compat is for CUDA-less machines")


@pytest.fixture(scope="module", autouse=True)
def patched():
    megatron_fixes.apply_megatron_fixes()
    cpu_compat.apply_cpu_compat()


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
    with cpu_compat.suspended():
        assert torch.empty is not patched_empty
        with pytest.raises((RuntimeError, AssertionError)):
            torch.empty(1, device="cuda")  # real torch: no CUDA here
    assert torch.empty is patched_empty


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
