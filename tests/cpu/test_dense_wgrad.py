"""moe_sft/kernels/dense_wgrad.py: which layers get megatron's gradient accumulation fusion, and
the accumulation itself where CPU can run it (fp32; the bf16 -> fp32 GEMM is CUDA's:
tests/gpu/test_gpu_parity.py compares main grads with and without it under DDP)."""

import torch
from megatron.core.tensor_parallel import layers as tp_layers

from moe_sft.kernels import dense_wgrad


def test_fp32_accumulation_adds_the_weight_gradient_into_main_grad():
    g = torch.Generator().manual_seed(0)
    x, dy = torch.randn(9, 5, generator=g), torch.randn(9, 3, generator=g)
    main_grad = torch.randn(3, 5, generator=g)
    expected = main_grad + dy.t() @ x
    dense_wgrad.TORCH_WGRAD_ACCUM.wgrad_gemm_accum_fp32(x, dy, main_grad)
    torch.testing.assert_close(main_grad, expected)


def test_only_trainable_dense_linears_with_a_main_grad_are_fused_and_only_on_cuda(monkeypatch):
    monkeypatch.setattr(tp_layers, "_grad_accum_fusion_available", False)
    monkeypatch.setattr(tp_layers, "fused_weight_gradient_mlp_cuda", None, raising=False)

    def linear(trainable=True, main_grad=True):
        layer = tp_layers.ColumnParallelLinear.__new__(tp_layers.ColumnParallelLinear)
        torch.nn.Module.__init__(layer)
        layer.weight = torch.nn.Parameter(torch.zeros(2, 2), requires_grad=trainable)
        if main_grad:
            layer.weight.main_grad = torch.zeros(2, 2)
        layer.gradient_accumulation_fusion = False
        return layer

    chunk = torch.nn.ModuleList([linear(), linear(trainable=False), linear(main_grad=False), torch.nn.Linear(2, 2)])
    assert dense_wgrad.fuse_dense_wgrad([chunk], "cpu") == 0
    assert not tp_layers._grad_accum_fusion_available
    assert dense_wgrad.fuse_dense_wgrad([chunk], "cuda") == 1
    assert [getattr(m, "gradient_accumulation_fusion", None) for m in chunk] == [True, False, False, None]
    assert tp_layers.fused_weight_gradient_mlp_cuda is dense_wgrad.TORCH_WGRAD_ACCUM
    assert dense_wgrad.fuse_dense_wgrad([chunk], "cuda", enable=False) == 1
    assert not chunk[0].gradient_accumulation_fusion


class _Group:
    def size(self):
        return 1


def _embedding(vocab=11, hidden=4, tied=False):
    module = tp_layers.VocabParallelEmbedding.__new__(tp_layers.VocabParallelEmbedding)
    torch.nn.Module.__init__(module)
    module.tp_group, module.reduce_scatter_embeddings, module.deterministic_mode = _Group(), False, False
    module.vocab_start_index, module.vocab_end_index = 0, vocab
    module.weight = torch.nn.Parameter(torch.randn(vocab, hidden, dtype=torch.bfloat16))
    module.weight.main_grad = torch.zeros(vocab, hidden)
    if tied:
        module.weight.zero_out_wgrad = True  # megatron's mark of an embedding tied to the LM head
    return module


def test_embedding_gradient_rows_go_into_main_grad(monkeypatch):
    """The fused embedding adds exactly F.embedding's weight gradient (repeated ids summed, in fp32)
    into main_grad, sets DDP's skip flag, and unfuses back to megatron's forward."""
    monkeypatch.setattr(tp_layers, "reduce_from_tensor_model_parallel_region", lambda x, group=None: x)
    torch.manual_seed(0)
    module, tied = _embedding(), _embedding(tied=True)
    ids = torch.tensor([[3, 7, 3, 0, 10, 3]])
    grad_out = torch.randn(1, 6, 4, dtype=torch.bfloat16)
    plain = module(ids)
    plain.backward(grad_out)
    expected = module.weight.grad.float()
    module.weight.grad = None
    assert dense_wgrad.fuse_dense_wgrad([torch.nn.ModuleList([module, tied])], "cuda") == 1  # not the tied one
    assert "forward" not in tied.__dict__
    fused = module(ids)
    assert torch.equal(fused, plain)
    fused.backward(grad_out)
    assert module.weight.grad_added_to_main_grad
    exact = torch.zeros(11, 4).index_add_(0, ids[0], grad_out[0].float())
    assert torch.equal(module.weight.main_grad, exact)  # fp32 sums of the bf16 rows
    assert torch.allclose(module.weight.main_grad, expected, atol=2e-2)  # F.embedding's (bf16) gradient
    assert dense_wgrad.fuse_dense_wgrad([torch.nn.ModuleList([module])], "cuda", enable=False) == 1
    assert "forward" not in module.__dict__
