"""Which CUDA kernel `VarlenCoreAttention` runs (`model.attention_kernel`: auto | torch | fa4), on CPU.

flash-attn-4 and flash-attn are replaced by recording fakes that compute the exact reference
(`sink_attention_reference`: bottom-right causal mask, window, sink), and the GPU's compute
capability by a patched `_cuda_capability`, so the routing and the arguments each kernel gets are
checked here; tests/gpu/test_gpu_fa4.py checks the real kernel's numbers. The fake FA4 has the
real signature of `flash_attn.cute.flash_attn_varlen_func` (4.0.0b36) up to `learnable_sink`: a
keyword it does not know, or a fourth positional argument (FA4's `qv`), fails here.
"""

from __future__ import annotations

import pytest
import torch
import torch.distributed as dist
from megatron.core import parallel_state
from megatron.core.packed_seq_params import PackedSeqParams
from megatron.core.transformer.enums import AttnMaskType
from megatron.core.transformer.transformer_config import TransformerConfig
from torch.testing._internal.distributed.fake_pg import FakeStore

from moe_sft.layers import attention
from moe_sft.layers.attention_sinks import STANDIN_KERNELS, sink_attention_reference
from moe_sft.layers.context_parallel import attention_on_gathered_kv, local_token_index, plan_cp_attention
from moe_sft.plan import hardware

HQ, HKV, D = 4, 2, 16
DOCS = [13, 1, 29, 7]
TOTAL = sum(DOCS)
WINDOW = 8  # megatron window_size=(WINDOW - 1, 0)


class _FakeFA4:
    """flash_attn.cute.flash_attn_varlen_func's signature and (out, lse) return, computing the
    reference; records every call's arguments."""

    def __init__(self):
        self.calls = []

    def __call__(
        self,
        q,
        k,
        v,
        qv=None,
        cu_seqlens_q=None,
        cu_seqlens_k=None,
        max_seqlen_q=None,
        max_seqlen_k=None,
        min_seqlen_k=None,
        seqused_q=None,
        seqused_k=None,
        gather_kv_indices=None,
        page_table=None,
        softmax_scale=None,
        causal=False,
        window_size=(None, None),
        learnable_sink=None,
    ):
        self.calls.append(dict(locals(), self=None))
        left, right = window_size
        assert causal and right in (None, 0), "moe-sft's attention is causal"
        out = sink_attention_reference(q, k, v, cu_seqlens_q, cu_seqlens_k, softmax_scale, learnable_sink, left)
        return out, None


class _FakeFlashAttn2:
    """flash_attn.flash_attn_varlen_func (positional cu_seqlens and max lengths)."""

    def __init__(self):
        self.calls = []

    def __call__(self, q, k, v, cu_q, cu_k, max_q, max_k, softmax_scale=None, causal=False):
        self.calls.append(dict(v=v, cu_q=cu_q, cu_k=cu_k))
        assert causal
        return sink_attention_reference(q, k, v, cu_q, cu_k, softmax_scale)


class _FakeTorchFlash:
    """`_FlashVarlen` (torch's flash kernel called directly)."""

    def __init__(self):
        self.calls = []

    def apply(self, q, k, v, cu_q, cu_k, max_q, max_k, scale):
        self.calls.append(dict(v=v))
        return sink_attention_reference(q, k, v, cu_q, cu_k, scale)


@pytest.fixture
def kernels(monkeypatch):
    """Fakes for the three CUDA kernels, a GPU of a given capability, and the default choice
    restored afterwards. `kernels.gpu((9, 0))` makes every tensor's device an SM90 GPU to the
    kernel choice (the tensors stay on the CPU, where the fakes compute)."""
    fakes = type("Kernels", (), {})()
    fakes.fa4, fakes.fa2, fakes.torch = _FakeFA4(), _FakeFlashAttn2(), _FakeTorchFlash()
    monkeypatch.setattr(attention, "_choice", "auto")
    monkeypatch.setattr(attention, "fa4_varlen_func", fakes.fa4)
    monkeypatch.setattr(attention, "flash_attn_varlen_func", fakes.fa2)
    monkeypatch.setattr(attention, "_FlashVarlen", fakes.torch)
    monkeypatch.setattr(attention, "FLASH_KERNELS", STANDIN_KERNELS)  # sink / window fold on CPU

    def gpu(capability):
        monkeypatch.setattr(attention, "_cuda_capability", lambda device: capability)
        monkeypatch.setattr(torch.cuda, "current_device", lambda: 0)

    def cuda_available(available=True):  # set_attention_kernel("fa4") asks; the modules' init would too
        monkeypatch.setattr(torch.cuda, "is_available", lambda: available)

    fakes.gpu, fakes.cuda_available = gpu, cuda_available
    fakes.used = lambda: [n for n in ("fa4", "fa2", "torch") if getattr(fakes, n).calls]
    return fakes


@pytest.fixture
def world():
    """A one-rank fake process group: learnable sinks read the TP group at construction. Whatever
    world an earlier test in this worker left (pytest-xdist runs modules in one process) goes first."""
    from tests.cpu.test_plan import _reset_world

    _reset_world()
    dist.init_process_group("fake", store=FakeStore(), rank=0, world_size=1)
    parallel_state.initialize_model_parallel(tensor_model_parallel_size=1, create_gloo_process_groups=False)
    yield
    _reset_world()


def _qkv(total=TOTAL, hq=HQ, hkv=HKV, d=D, dv=D, dtype=torch.bfloat16, seed=0):
    g = torch.Generator().manual_seed(seed)
    mk = lambda h, dim: torch.randn(total, h, dim, generator=g).to(dtype).requires_grad_()
    return mk(hq, d), mk(hkv, d), mk(hkv, dv)


def _cu(lengths=DOCS, dtype=torch.int32):
    return torch.tensor([0, *lengths]).cumsum(0).to(dtype)


def _call(q, k, v, sink=None, window=None):
    cu = _cu()
    return attention._varlen_cuda(q, k, v, cu, cu, max(DOCS), max(DOCS), 0.25, sink, window)


def _module(softmax_type="vanilla", window=False, layer_number=1):
    config = TransformerConfig(
        num_layers=2,
        hidden_size=64,
        num_attention_heads=HQ,
        num_query_groups=HKV,
        kv_channels=D,
        params_dtype=torch.bfloat16,
        softmax_type=softmax_type,
        window_size=(WINDOW - 1, 0) if window else None,
        window_attn_skip_freq=[1, 0] if window else None,
        attention_dropout=0.0,
    )
    module = attention.VarlenCoreAttention(config, layer_number, AttnMaskType.causal, "self")
    if isinstance(module.softmax_offset, torch.nn.Parameter):
        with torch.no_grad():
            module.softmax_offset.copy_(torch.randn(HQ, generator=torch.Generator().manual_seed(5)) * 2)
    return module


def _thd(lengths=DOCS, dtype=torch.int32):
    cu = _cu(lengths, dtype)
    return PackedSeqParams(qkv_format="thd", cu_seqlens_q=cu, cu_seqlens_kv=cu, max_seqlen_q=max(lengths))


# ----------------------------------------------------------------------------- the choice


@pytest.mark.parametrize(
    ("capability", "expected"), [((9, 0), "fa4"), ((10, 0), "fa4"), ((8, 0), "fa2"), ((12, 0), "fa2")]
)
def test_auto_picks_fa4_on_sm90_and_sm100_only(kernels, capability, expected):
    kernels.gpu(capability)
    _call(*_qkv())
    assert kernels.used() == [expected]


def test_auto_without_fa4_keeps_the_old_order(kernels, monkeypatch):
    kernels.gpu((9, 0))
    monkeypatch.setattr(attention, "fa4_varlen_func", None)
    _call(*_qkv())
    monkeypatch.setattr(attention, "flash_attn_varlen_func", None)
    _call(*_qkv())
    assert len(kernels.fa2.calls) == 1 and len(kernels.torch.calls) == 1


def test_torch_never_picks_an_optional_kernel(kernels):
    kernels.gpu((9, 0))
    attention.set_attention_kernel("torch")
    _call(*_qkv())
    assert kernels.used() == ["torch"]
    assert "flash-attn-4" not in attention.attention_kernel_name("cuda")
    assert attention.attention_kernel_name("cuda").startswith("torch's flash varlen kernel")


def test_fa4_required_but_missing_names_the_field_and_the_fix(kernels, monkeypatch):
    monkeypatch.setattr(attention, "fa4_varlen_func", None)
    monkeypatch.setattr(attention, "_FA4_IMPORT_ERROR", "ModuleNotFoundError: No module named 'cutlass'")
    with pytest.raises(RuntimeError, match=r"model\.attention_kernel=fa4.*No module named 'cutlass'.*pip install"):
        attention.set_attention_kernel("fa4")
    assert attention._choice == "auto"


@pytest.mark.parametrize(("capability", "found"), [((8, 0), "compute capability 8.0"), (None, "no CUDA device")])
def test_fa4_required_on_a_gpu_it_does_not_support(kernels, capability, found):
    kernels.gpu(capability)
    kernels.cuda_available(capability is not None)
    with pytest.raises(RuntimeError, match=f"model.attention_kernel=fa4 needs an SM90.*found {found}"):
        attention.set_attention_kernel("fa4")


def test_fa4_required_raises_at_a_call_it_cannot_run(kernels):
    kernels.gpu((9, 0))
    kernels.cuda_available()
    attention.set_attention_kernel("fa4")
    _call(*_qkv())
    assert kernels.used() == ["fa4"]
    with pytest.raises(ValueError, match=r"model\.attention_kernel=fa4: .*head dims \(12, 12\)"):
        _call(*_qkv(d=12, dv=12))


def test_unknown_choice_lists_the_accepted_ones(kernels):
    with pytest.raises(ValueError, match="model.attention_kernel='fa3': expected one of auto, torch, fa4"):
        attention.set_attention_kernel("fa3")


def test_kernel_name_says_fa4_where_auto_would_use_it(kernels):
    kernels.gpu((9, 0))
    assert attention.attention_kernel_name("cuda").startswith("flash-attn-4 (flash_attn.cute.flash_attn_varlen_func)")
    assert "else flash_attn.flash_attn_varlen_func" in attention.attention_kernel_name("cuda")
    assert attention.attention_kernel_name("cpu").startswith("per-document scaled_dot_product_attention")
    kernels.gpu((8, 0))
    assert attention.attention_kernel_name("cuda") == "flash_attn.flash_attn_varlen_func"


# ----------------------------------------------------------------------------- what FA4 is given


def test_module_passes_fa4_int32_cu_seqlens_lengths_scale_and_causal(kernels):
    kernels.gpu((9, 0))
    module = _module()
    q, k, v = _qkv()
    out = module(q, k, v, None, packed_seq_params=_thd(dtype=torch.int64))
    (call,) = kernels.fa4.calls
    assert call["cu_seqlens_q"].dtype == torch.int32 and call["cu_seqlens_k"].dtype == torch.int32
    assert torch.equal(call["cu_seqlens_q"], _cu()) and torch.equal(call["cu_seqlens_k"], _cu())
    assert call["max_seqlen_q"] == call["max_seqlen_k"] == max(DOCS) and isinstance(call["max_seqlen_q"], int)
    assert call["softmax_scale"] == module.softmax_scale == D**-0.5
    assert call["causal"] is True and call["window_size"] == (None, None) and call["learnable_sink"] is None
    assert call["qv"] is None and call["v"] is v
    # the same numbers as the CPU path (SDPA per document), gradients included
    ref = attention.sdpa_varlen_reference(q.float(), k.float(), v.float(), _cu(), module.softmax_scale)
    torch.testing.assert_close(out.float(), ref.reshape(out.shape), rtol=2e-2, atol=2e-2)
    out.float().pow(2).sum().backward()
    assert all(t.grad is not None and t.grad.abs().sum() > 0 for t in (q, k, v))


def test_sink_and_window_go_to_fa4_as_the_reference_defines_them(kernels, world):
    kernels.gpu((9, 0))
    module = _module("learnable", window=True, layer_number=1)
    q, k, v = _qkv()
    out = module(q, k, v, None, packed_seq_params=_thd())
    (call,) = kernels.fa4.calls
    assert call["learnable_sink"] is module.softmax_offset and call["window_size"] == (WINDOW - 1, 0)
    out.float().sum().backward()
    assert module.softmax_offset.grad is not None  # the sink's gradient comes back through FA4


def test_sink_and_window_on_sm80_keep_the_torch_fold(kernels, world):
    kernels.gpu((8, 0))
    module = _module("learnable", window=True, layer_number=1)
    q, k, v = _qkv()
    out = module(q, k, v, None, packed_seq_params=_thd()).view(-1, HQ, D)
    assert kernels.used() == []  # SinkFlashVarlen over the (stand-in) torch flash kernels
    ref = sink_attention_reference(q, k, v, _cu(), _cu(), module.softmax_scale, module.softmax_offset, WINDOW - 1)
    torch.testing.assert_close(out.float(), ref.float(), rtol=2e-2, atol=2e-2)


def test_off_by_one_sink_is_a_zero_learnable_sink(kernels, world):
    kernels.gpu((9, 0))
    module = _module("off-by-one")
    module(*_qkv(), None, packed_seq_params=_thd())
    (call,) = kernels.fa4.calls
    assert torch.equal(call["learnable_sink"], torch.zeros(HQ, dtype=torch.bfloat16))


def test_fp32_on_cuda_stays_on_the_reference(kernels):
    kernels.gpu((9, 0))
    q, k, v = _qkv(dtype=torch.float32)
    _module()(q, k, v, None, packed_seq_params=_thd())
    assert kernels.used() == []


def test_heads_wider_than_the_flash_kernels_take_stay_on_the_reference(kernels):
    """Gemma 4's 512-wide full-attention heads: no flash kernel takes them; 256 still goes to one."""
    kernels.gpu((9, 0))
    for d, used in ((attention.FLASH_MAX_HEAD_DIM + 8, []), (attention.FLASH_MAX_HEAD_DIM, ["fa4"])):
        q, k, v = _qkv(d=d, dv=d)
        _module()(q, k, v, None, packed_seq_params=_thd())
        assert kernels.used() == used, d


def test_cpu_tensors_never_reach_a_cuda_kernel(kernels):
    module = _module()  # no kernels.gpu(): the real capability check, a CPU device
    q, k, v = _qkv()
    out = module(q, k, v, None, packed_seq_params=_thd())
    assert kernels.used() == []
    ref = attention.sdpa_varlen_reference(q, k, v, _cu(), module.softmax_scale)
    assert torch.equal(out, ref.reshape(out.shape))


# ----------------------------------------------------------------------------- MLA head dims


@pytest.mark.parametrize(
    ("capability", "hkv", "kernel", "v_dim_given", "choice"),
    [
        ((9, 0), HQ, "fa4", 48, "fa4"),  # MLA (as many k/v heads as q heads): FA4 takes v unpadded
        ((10, 0), HQ, "fa4", 48, "fa4"),
        ((9, 0), HQ, "fa2", 64, "auto"),  # auto: MLA stays on the faster flash kernel, v padded
        ((9, 0), HKV, "fa2", 64, "auto"),  # GQA with unequal dims: FA4's SM90 backward refuses it
        ((8, 0), HQ, "fa2", 64, "auto"),  # flash-attn 2 gets v zero-padded to the q/k head dim
    ],
)
def test_v_is_padded_only_for_the_kernels_that_need_it(kernels, capability, hkv, kernel, v_dim_given, choice):
    kernels.gpu(capability)
    attention._choice = choice  # "fa4" past set_attention_kernel's device check (the fixture restores auto)
    q, k, v = _qkv(hkv=hkv, d=64, dv=48)
    out = _call(q, k, v)
    assert kernels.used() == [kernel] and getattr(kernels, kernel).calls[0]["v"].shape[-1] == v_dim_given
    assert out.shape == (TOTAL, HQ, 48)
    torch.testing.assert_close(out, sink_attention_reference(q, k, v, _cu(), _cu(), 0.25), rtol=1e-2, atol=1e-2)


@pytest.mark.parametrize(
    ("capability", "dims", "with_sink", "fa4"),
    [
        ((10, 0), (192, 128), False, True),
        ((10, 0), (256, 256), False, True),
        ((10, 0), (256, 256), True, False),  # FA4's SM100 hd256 backward takes no sink
        ((10, 0), (160, 160), False, False),
        ((9, 0), (160, 160), True, True),
        ((9, 0), (264, 264), False, False),
    ],
)
def test_fa4_head_dim_rules(kernels, capability, dims, with_sink, fa4):
    kernels.gpu(capability)
    q, k, v = (torch.empty(8, HQ, d, dtype=torch.bfloat16) for d in (dims[0], dims[0], dims[1]))
    sink = torch.zeros(HQ) if with_sink else None
    assert (attention._fa4_refusal(q, k, v, sink) is None) == fa4


# ----------------------------------------------------------------------------- context parallel


def test_context_parallel_gives_fa4_separate_q_and_k_lengths(kernels):
    """Simulated CP ranks (as tests/cpu/test_context_parallel.py): every rank's query chunks
    attend to their key prefix, so FA4 gets cu_seqlens_q != cu_seqlens_k; put back together the
    outputs equal attention over whole documents."""
    kernels.gpu((9, 0))
    cp = 2
    cu = [0]
    for n in DOCS:
        cu.append(cu[-1] + -(-n // (2 * cp)) * 2 * cp)
    q, k, v = _qkv(total=cu[-1])
    index = [local_token_index(cu, cp, r) for r in range(cp)]
    k_all, v_all = torch.cat([k[i] for i in index]), torch.cat([v[i] for i in index])
    out = q.new_zeros(q.shape)
    for r in range(cp):
        local = attention_on_gathered_kv(
            q[index[r]], k_all, v_all, plan_cp_attention(cu, cp, r), 0.25, attention.cp_kernel
        )
        out = out.index_put((index[r],), local)
    assert len(kernels.fa4.calls) == cp and kernels.used() == ["fa4"]
    for call in kernels.fa4.calls:
        assert call["cu_seqlens_q"].dtype == call["cu_seqlens_k"].dtype == torch.int32
        assert not torch.equal(call["cu_seqlens_q"], call["cu_seqlens_k"])
        assert call["max_seqlen_q"] < call["max_seqlen_k"] and call["causal"]
    ref = attention.sdpa_varlen_reference(q.float(), k.float(), v.float(), torch.tensor(cu), 0.25)
    torch.testing.assert_close(out.float(), ref, rtol=2e-2, atol=2e-2)


# ----------------------------------------------------------------------------- the planner's detection


def _package(root, name, files):
    for f in files:
        path = root / name / f
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text("")


@pytest.mark.parametrize(
    ("files", "expected"),
    [
        (["cute/__init__.py", "cute/interface.py"], (False, True)),  # flash-attn-4 alone: a namespace package
        (["__init__.py", "flash_attn_interface.py"], (True, False)),
        (["__init__.py", "cute/__init__.py"], (True, True)),
    ],
)
def test_planner_tells_flash_attn_2_from_4(tmp_path, monkeypatch, files, expected):
    import sys

    _package(tmp_path, "flash_attn", files)
    monkeypatch.delitem(sys.modules, "flash_attn", raising=False)
    monkeypatch.syspath_prepend(str(tmp_path))
    assert hardware.flash_attn_packages() == expected
    line = hardware.kernels(hardware.GPUS["h200_141gb"], "auto")[-1]
    assert ("flash-attn-4" in line) == expected[1]
    assert ("flash_attn.flash_attn_varlen_func" in line) == expected[0]
