"""moe_sft/kernels/one_rank_collectives.py: a one-rank group gets its input back with no autograd
node in between; larger groups go to megatron's functions."""

import torch
from megatron.core.tensor_parallel import layers
from megatron.core.transformer.moe import moe_utils, token_dispatcher

from moe_sft.kernels import one_rank_collectives as ours


class _Group:
    def __init__(self, size):
        self._size = size

    def size(self):
        return self._size


def test_installed_where_megatron_imported_the_names():
    from moe_sft.config import KernelsConfig
    from moe_sft.kernels import install
    from moe_sft.runtime import megatron_fixes

    megatron_fixes.apply_megatron_fixes()
    install.install(KernelsConfig())
    assert token_dispatcher.all_to_all is ours.all_to_all
    assert moe_utils.reduce_from_tensor_model_parallel_region is ours.reduce_from_tensor_model_parallel_region
    assert layers.copy_to_tensor_model_parallel_region is ours.copy_to_tensor_model_parallel_region
    assert layers.reduce_from_tensor_model_parallel_region is ours.reduce_from_tensor_model_parallel_region


def test_one_rank_returns_the_input_and_two_ranks_call_megatron(monkeypatch):
    x = torch.randn(4, 3, requires_grad=True)
    y = x * 2
    one = _Group(1)
    assert ours.all_to_all(one, y) is y
    assert ours.copy_to_tensor_model_parallel_region(y, group=one) is y
    assert ours.reduce_from_tensor_model_parallel_region(y, group=one) is y
    calls = []
    monkeypatch.setitem(ours._megatron, "all_to_all", lambda *a: calls.append(a) or "megatron")
    monkeypatch.setitem(
        ours._megatron, "reduce_from_tensor_model_parallel_region", lambda *a: calls.append(a) or "megatron"
    )
    two = _Group(2)
    assert ours.all_to_all(two, y, [1, 3], [2, 2]) == "megatron"
    assert ours.reduce_from_tensor_model_parallel_region(y, group=two) == "megatron"
    assert calls[0] == (two, y, [1, 3], [2, 2]) and calls[1] == (y, two)
