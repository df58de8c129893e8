"""moe_sft/kernels/triton_launch.py's cache key on CPU: it must separate every case Triton compiles
separately (the launches themselves run on CUDA: tests/gpu/test_gpu_triton_launch.py)."""

import torch

from moe_sft.kernels.triton_launch import _arg_key


def test_the_key_separates_what_triton_specialises_on():
    x = torch.zeros(64)
    assert _arg_key(x) != _arg_key(x[1:])  # 16-byte aligned pointer or not
    assert _arg_key(x) != _arg_key(x.to(torch.bfloat16))  # pointer dtype
    assert _arg_key(x) == _arg_key(torch.ones(64))  # same dtype and alignment: one kernel
    assert len({_arg_key(n) for n in (1, 16, 17, 2**31)}) == 4  # ==1, divisible by 16, other, 64-bit
    assert _arg_key(32) == _arg_key(4096) and _arg_key(3) == _arg_key(4095)
    assert _arg_key(True) != _arg_key(1) and _arg_key(0.5) != _arg_key(0)
    assert _arg_key(torch.nn.Parameter(x)) == _arg_key(x)  # a weight passed as it is


def test_a_do_not_specialize_count_keys_on_its_width_only():
    """A token count declared do_not_specialize: one key for 16, 17 and 4096 (Triton compiles once),
    still two for a count past 32 bits (its signature type changes)."""
    from types import SimpleNamespace

    from moe_sft.kernels.triton_launch import unspecialised_positions

    class Kernel:  # the part of a JITFunction read: its KernelParams
        params = [SimpleNamespace(num=0, do_not_specialize=False), SimpleNamespace(num=1, do_not_specialize=True)]

    assert unspecialised_positions(Kernel()) == {1}
    assert unspecialised_positions(object()) == frozenset()  # a Triton without KernelParams
    assert len({_arg_key(n, specialised=False) for n in (1, 16, 17, 4096)}) == 1
    assert _arg_key(17, specialised=False) != _arg_key(2**31, specialised=False)
