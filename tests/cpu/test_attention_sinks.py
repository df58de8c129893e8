"""Attention sinks (softmax_type learnable / off-by-one) and sliding windows in VarlenCoreAttention.

The reference path must equal transformers' gpt-oss eager attention (values and gradients of q,
k, v and the sinks), packed documents must equal each document alone, the CUDA path's sink fold
(flash out × sigmoid(lse - sink), backward through the flash backward with a modified `out`) is
checked with a CPU stand-in for the flash kernels, context parallel is simulated in-process, and
the checkpoint layout of `softmax_offset` must be megatron DotProductAttention's.
"""

from __future__ import annotations

import functools
import types

import pytest
import torch
import torch.distributed as dist
from megatron.core import parallel_state
from megatron.core.packed_seq_params import PackedSeqParams
from megatron.core.transformer.enums import AttnMaskType
from megatron.core.transformer.transformer_config import TransformerConfig
from torch.testing._internal.distributed.fake_pg import FakeStore

from moe_sft.layers.attention import VarlenCoreAttention, cp_kernel, sdpa_varlen_reference
from moe_sft.layers.attention_sinks import (
    STANDIN_KERNELS,
    SinkFlashVarlen,
    layer_window,
    sink_attention_reference,
)
from moe_sft.layers.context_parallel import attention_on_gathered_kv, local_token_index, plan_cp_attention

HQ, HKV, D = 4, 2, 16
WINDOW = 8  # HF sliding_window; megatron window_size=(WINDOW - 1, 0)


def _world(world: int = 1, rank: int = 0, tp: int = 1) -> None:
    if parallel_state.model_parallel_is_initialized():
        parallel_state.destroy_model_parallel()
    if dist.is_initialized():
        dist.destroy_process_group()
    dist.init_process_group("fake", store=FakeStore(), rank=rank, world_size=world)
    parallel_state.initialize_model_parallel(tensor_model_parallel_size=tp, create_gloo_process_groups=False)


@pytest.fixture(autouse=True)
def world():
    _world()
    yield
    parallel_state.destroy_model_parallel()
    dist.destroy_process_group()


def _config(softmax_type="learnable", window=True, dtype=torch.float32, **extra):
    return TransformerConfig(
        num_layers=2,
        hidden_size=64,
        num_attention_heads=HQ,
        num_query_groups=HKV,
        kv_channels=D,
        params_dtype=dtype,
        softmax_type=softmax_type,
        window_size=(WINDOW - 1, 0) if window else None,
        window_attn_skip_freq=[1, 0],  # layer 1 sliding, layer 2 full (gpt-oss's alternation)
        attention_dropout=0.0,
        **extra,
    )


def _attention(layer_number, dtype=torch.float32, seed=0, **kw):
    module = VarlenCoreAttention(_config(dtype=dtype, **kw), layer_number, AttnMaskType.causal, "self")
    if isinstance(module.softmax_offset, torch.nn.Parameter):
        with torch.no_grad():  # init_method's std 0.02 would make the sinks nearly irrelevant
            module.softmax_offset.copy_(torch.randn(HQ, generator=torch.Generator().manual_seed(seed)) * 2)
    return module


def _thd(lengths):
    cu = torch.tensor([0, *lengths]).cumsum(0).to(torch.int32)
    return PackedSeqParams(qkv_format="thd", cu_seqlens_q=cu, cu_seqlens_kv=cu, max_seqlen_q=max(lengths))


def _qkv(total, dtype=torch.float32, seed=1, hkv=HKV):
    g = torch.Generator().manual_seed(seed)
    mk = lambda h: torch.randn(total, h, D, generator=g, dtype=dtype).requires_grad_()
    return mk(HQ), mk(hkv), mk(hkv)


def _hf_eager(q, k, v, sinks, scale, window):
    """transformers' gpt-oss eager attention on one document, with HF's masks built by hand."""
    from transformers.models.gpt_oss.modeling_gpt_oss import eager_attention_forward

    s = q.shape[0]
    qi, ki = torch.arange(s)[:, None], torch.arange(s)[None, :]
    allowed = ki <= qi  # causal_mask_function
    if window is not None:
        allowed &= ki > qi - window  # sliding_window_overlay
    mask = torch.zeros(s, s, dtype=q.dtype).masked_fill(~allowed, torch.finfo(q.dtype).min)[None, None]
    stub = types.SimpleNamespace(sinks=sinks, num_key_value_groups=q.shape[1] // k.shape[1], training=False)
    to_bhsd = lambda x: x.transpose(0, 1)[None]
    out, _ = eager_attention_forward(stub, to_bhsd(q), to_bhsd(k), to_bhsd(v), mask, scale)
    return out[0]  # [s, h, d]


def _grads(out, tensors, seed=2):
    weight = torch.randn(out.shape, dtype=out.dtype, generator=torch.Generator().manual_seed(seed))
    return torch.autograd.grad((out * weight).sum(), tensors)


@pytest.mark.parametrize("layer_number, window", [(1, WINDOW), (2, None)])
def test_reference_matches_hf_gpt_oss_eager(layer_number, window):
    module = _attention(layer_number)
    assert module.window == (None if window is None else WINDOW - 1)
    q, k, v = _qkv(21)
    ours = module(q, k, v, None, packed_seq_params=_thd([21])).view(21, HQ, D)
    hf = _hf_eager(q, k, v, module.softmax_offset, module.softmax_scale, window)
    torch.testing.assert_close(ours, hf, rtol=1e-5, atol=1e-6)
    tensors = (q, k, v, module.softmax_offset)
    for a, b in zip(_grads(ours, tensors), _grads(hf, tensors)):
        torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-6)


@pytest.mark.parametrize("layer_number", [1, 2])
def test_packed_documents_equal_each_alone(layer_number):
    module = _attention(layer_number, dtype=torch.float64)
    lengths = [13, 1, 29, 7]
    q, k, v = _qkv(sum(lengths), torch.float64)
    packed = module(q, k, v, None, packed_seq_params=_thd(lengths)).view(-1, HQ, D)
    start = 0
    for n in lengths:
        sl = slice(start, start + n)
        alone = module(q[sl], k[sl], v[sl], None, packed_seq_params=_thd([n])).view(n, HQ, D)
        torch.testing.assert_close(packed[sl], alone, rtol=0, atol=1e-12)
        start += n


@pytest.mark.parametrize("window", [None, 3])
@pytest.mark.parametrize("with_sink", [True, False])
@pytest.mark.parametrize("hkv", [HQ, HKV, 1])
def test_flash_sink_fold_equals_reference(window, with_sink, hkv):
    """The CUDA path's autograd (SinkFlashVarlen) over a CPU stand-in of the flash kernels, with
    bottom-right aligned segments (sq < sk, as under CP) next to square ones."""
    cu_q = torch.tensor([0, 5, 6, 17, 24], dtype=torch.int32)
    cu_k = torch.tensor([0, 9, 10, 21, 28], dtype=torch.int32)  # 1st segment: 5 queries, 9 keys
    q, _, _ = _qkv(24, torch.float64, hkv=hkv)
    _, k, v = _qkv(28, torch.float64, seed=3, hkv=hkv)
    sink = (torch.randn(HQ, dtype=torch.float64, generator=torch.Generator().manual_seed(4)) * 2).requires_grad_()
    sink_arg = sink if with_sink else None
    ours = SinkFlashVarlen.apply(q, k, v, sink_arg, cu_q, cu_k, 11, 11, 0.3, window, STANDIN_KERNELS)
    ref = sink_attention_reference(q, k, v, cu_q, cu_k, 0.3, sink_arg, window)
    torch.testing.assert_close(ours, ref, rtol=1e-10, atol=1e-12)
    tensors = (q, k, v, sink) if with_sink else (q, k, v)
    for a, b in zip(_grads(ours, tensors), _grads(ref, tensors)):
        torch.testing.assert_close(a, b, rtol=1e-10, atol=1e-12)


def test_flash_sink_fold_needs_the_folded_out():
    """Negative control: handing the flash backward the kernel's own (unfolded) `out`, as a naive
    fold would, gets q/k gradients wrong; v's gradient (Pᵀ dO) does not read `out`."""

    def naive_backward(dout, q, k, v, out, lse, cu_q, cu_k, max_q, max_k, scale, window, aux):
        unfolded = STANDIN_KERNELS[0](q, k, v, cu_q, cu_k, max_q, max_k, scale, window)[0]
        return STANDIN_KERNELS[1](dout, q, k, v, unfolded, lse, cu_q, cu_k, max_q, max_k, scale, window, aux)

    cu = torch.tensor([0, 9, 20], dtype=torch.int32)
    q, k, v = _qkv(20, torch.float64)
    sink = torch.randn(HQ, dtype=torch.float64, generator=torch.Generator().manual_seed(4)) * 2
    naive = SinkFlashVarlen.apply(q, k, v, sink, cu, cu, 11, 11, 0.3, None, (STANDIN_KERNELS[0], naive_backward))
    ref = sink_attention_reference(q, k, v, cu, cu, 0.3, sink, None)
    (dq, dk, dv), (rq, rk, rv) = _grads(naive, (q, k, v)), _grads(ref, (q, k, v))
    torch.testing.assert_close(dv, rv, rtol=1e-10, atol=1e-12)
    assert not torch.allclose(dq, rq, rtol=1e-4, atol=1e-6) and not torch.allclose(dk, rk, rtol=1e-4, atol=1e-6)


def test_vanilla_path_unchanged():
    module = _attention(1, softmax_type="vanilla", window=False)
    assert module.softmax_offset is None and module.window is None and not list(module.parameters())
    lengths = [13, 1, 29]
    q, k, v = _qkv(sum(lengths))
    ours = module(q, k, v, None, packed_seq_params=_thd(lengths))
    before = sdpa_varlen_reference(q, k, v, _thd(lengths).cu_seqlens_q, module.softmax_scale)
    assert torch.equal(ours, before.reshape(ours.shape))
    # and the full layer of a windowed config is the same code path
    full = _attention(2, softmax_type="vanilla")
    assert full.window is None and torch.equal(full(q, k, v, None, packed_seq_params=_thd(lengths)), ours)


def test_off_by_one_is_a_zero_sink():
    module = _attention(2, softmax_type="off-by-one", dtype=torch.float64)
    assert not list(module.parameters()) and torch.equal(module.softmax_offset, torch.zeros(HQ, dtype=torch.float64))
    q, k, v = _qkv(17, torch.float64)
    ours = module(q, k, v, None, packed_seq_params=_thd([17])).view(17, HQ, D)
    ref = _hf_eager(q, k, v, torch.zeros(HQ, dtype=torch.float64), module.softmax_scale, None)
    torch.testing.assert_close(ours, ref, rtol=1e-10, atol=1e-12)


def test_sbhd_input_matches_thd():
    module = _attention(1, dtype=torch.float64)
    q, k, v = _qkv(2 * 11, torch.float64)
    sbhd = lambda x: x.view(2, 11, *x.shape[1:]).transpose(0, 1)
    out = module(sbhd(q), sbhd(k), sbhd(v), None)  # [s, b, h*d]
    thd = module(q, k, v, None, packed_seq_params=_thd([11, 11]))
    torch.testing.assert_close(out.transpose(0, 1).reshape(thd.shape), thd, rtol=0, atol=1e-12)


def _cp_forward(q, k, v, cu, cp, kernel):
    index = [local_token_index(cu, cp, r) for r in range(cp)]
    k_all, v_all = torch.cat([k[i] for i in index]), torch.cat([v[i] for i in index])
    out = q.new_zeros(q.shape[0], q.shape[1], v.shape[-1])
    for r in range(cp):
        local = attention_on_gathered_kv(q[index[r]], k_all, v_all, plan_cp_attention(cu, cp, r), 0.3, kernel)
        out = out.index_put((index[r],), local)
    return out


@pytest.mark.parametrize("cp", [2, 3])
@pytest.mark.parametrize("path", ["reference", "flash_fold"])
def test_context_parallel_with_sinks_and_window(cp, path):
    lengths = [12 * cp, 4 * cp, 6 * cp]  # multiples of 2·cp; chunks longer and shorter than the window
    cu = torch.tensor([0, *lengths]).cumsum(0).tolist()
    q, k, v = _qkv(cu[-1], torch.float64)
    sink = (torch.randn(HQ, dtype=torch.float64, generator=torch.Generator().manual_seed(5)) * 2).requires_grad_()
    if path == "reference":
        kernel = functools.partial(cp_kernel, sink=sink, window=5)
    else:

        def kernel(q, k, v, cu_q, cu_k, max_q, max_k, scale):
            return SinkFlashVarlen.apply(q, k, v, sink, cu_q, cu_k, max_q, max_k, scale, 5, STANDIN_KERNELS)

    ours = _cp_forward(q, k, v, cu, cp, kernel)
    full = sink_attention_reference(q, k, v, torch.tensor(cu), torch.tensor(cu), 0.3, sink, 5)
    torch.testing.assert_close(ours, full, rtol=1e-10, atol=1e-12)
    for a, b in zip(_grads(ours, (q, k, v, sink)), _grads(full, (q, k, v, sink))):
        torch.testing.assert_close(a, b, rtol=1e-10, atol=1e-12)


def test_layer_window_follows_megatron():
    cfg = lambda **kw: types.SimpleNamespace(**{"window_size": (127, 0), "window_attn_skip_freq": None, **kw})
    assert layer_window(cfg(), 1) == 127
    assert [layer_window(cfg(window_attn_skip_freq=2), n) for n in (1, 2, 3, 4)] == [127, None, 127, None]
    assert layer_window(cfg(window_size=None), 1) is None
    assert layer_window(cfg(window_size=(-1, 0)), 1) is None
    with pytest.raises(ValueError, match="window_size"):
        layer_window(cfg(window_size=(127, 4)), 1)


def test_sharded_state_dict_matches_megatron(monkeypatch):
    """TP=2, rank 1: same parameter shape, key and TP sharding as megatron's DotProductAttention."""
    from megatron.core.transformer.dot_product_attention import DotProductAttention

    _world(world=2, rank=1, tp=2)
    monkeypatch.setattr(torch.cuda, "current_device", lambda: "cpu")  # megatron allocates on CUDA
    config = _config()
    ours = VarlenCoreAttention(config, 1, AttnMaskType.causal, "self")
    theirs = DotProductAttention(config, 1, AttnMaskType.causal, "self")
    assert ours.softmax_offset.shape == theirs.softmax_offset.shape == (HQ // 2,)
    assert [n for n, _ in ours.named_parameters()] == [n for n, _ in theirs.named_parameters()] == ["softmax_offset"]
    meta = {"dp_cp_group": parallel_state.get_data_parallel_group(with_context_parallel=True)}
    a = ours.sharded_state_dict("decoder.layers.0.self_attention.core_attention.", ((0, 0, 2),), meta)
    b = theirs.sharded_state_dict("decoder.layers.0.self_attention.core_attention.", ((0, 0, 2),), meta)
    assert a.keys() == b.keys() == {"decoder.layers.0.self_attention.core_attention.softmax_offset"}
    for key in a:
        for field in ("key", "global_shape", "global_offset", "axis_fragmentations", "replica_id", "local_shape"):
            assert getattr(a[key], field) == getattr(b[key], field), field
