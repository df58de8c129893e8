"""Launch Triton kernels through their compiled launcher once their specialisation is known.

The training step is host-bound (docs/benchmarks.md): the GPU waits for Python to queue kernels.
`kernel[grid](...)` binds every argument, builds a cache key from the specialisation and the
options and looks it up before it launches, several times the cost of the compiled kernel's own
launcher (docs/log.md); our kernels take 10-20 arguments, and a layer's forward and backward
launch about 30 of them per micro-batch.

`launch(kernel, grid, *args, **kwargs)` is `kernel[grid](*args, **kwargs)`. The first call of each
specialisation goes through Triton (which compiles and launches, and returns the compiled kernel);
later calls with the same key launch that kernel directly. The key is at least as fine as Triton's
own specialisation: per argument its type, for tensors the dtype and 16-byte alignment, for ints
whether they equal 1, divide by 16 and fit 32 bits (only the last for a parameter the kernel
names in `do_not_specialize`); plus every keyword (constexprs, num_warps) and the device. Where
the compiled launcher cannot be used (the Triton interpreter, another Triton API), every call goes
through Triton's entry.
"""

from __future__ import annotations

import torch

_cache: dict = {}
_UNUSABLE = object()
_TENSOR_TYPES = (torch.Tensor, torch.nn.Parameter)


_loose_cache: dict = {}  # kernel -> positions of its do_not_specialize parameters


def _arg_key(arg, specialised: bool = True) -> tuple:
    """What Triton specialises an argument on (a superset: see the module docstring)."""
    kind = type(arg)
    if kind in _TENSOR_TYPES:
        return arg.dtype, arg.data_ptr() & 15 == 0
    if kind is int:
        fits_32_bits = -(2**31) <= arg < 2**31  # i32 or i64 in the signature, specialised or not
        return (arg == 1, arg & 15 == 0, fits_32_bits) if specialised else (fits_32_bits,)
    return (kind,) if kind is not bool else (kind, arg)


def unspecialised_positions(kernel) -> frozenset:
    """Positions of the parameters `kernel` declares with `do_not_specialize` (Triton's KernelParam):
    a token count there compiles once, not once per (== 1, divides by 16) class it meets mid-run."""
    positions = _loose_cache.get(kernel)
    if positions is None:
        positions = frozenset(p.num for p in getattr(kernel, "params", ()) if getattr(p, "do_not_specialize", False))
        _loose_cache[kernel] = positions
    return positions


def _direct(compiled, kernel, args, kwargs):
    """(launcher, function, metadata, constexpr values in parameter order), or _UNUSABLE where
    this Triton's compiled kernel has no launcher to call."""
    try:
        compiled._init_handles()
        run, function, metadata = compiled.run, compiled.function, compiled.packed_metadata
    except AttributeError:
        return _UNUSABLE
    return run, function, metadata, tuple(kwargs[name] for name in kernel.arg_names[len(args) :])


def launch(kernel, grid, *args, **kwargs):
    """`kernel[grid](*args, **kwargs)`: positional runtime arguments (the first a tensor), then every
    remaining kernel parameter (the constexprs) and the launch options by keyword."""
    first = args[0]
    if not first.is_cuda:  # the Triton interpreter's CPU tensors
        kernel[grid](*args, **kwargs)
        return
    device = first.get_device()
    loose = unspecialised_positions(kernel)
    keys = map(_arg_key, args) if not loose else (_arg_key(a, i not in loose) for i, a in enumerate(args))
    key = (kernel, device, tuple(kwargs.items()), *keys)
    entry = _cache.get(key)
    if entry is None:
        compiled = kernel[grid](*args, **kwargs)
        usable = compiled is not None and hasattr(compiled, "run")
        _cache[key] = _direct(compiled, kernel, args, kwargs) if usable else _UNUSABLE
        return
    if entry is _UNUSABLE:
        kernel[grid](*args, **kwargs)
        return
    run, function, metadata, constexprs = entry
    run(
        grid[0],
        grid[1] if len(grid) > 1 else 1,
        grid[2] if len(grid) > 2 else 1,
        torch._C._cuda_getCurrentRawStream(device),
        function,
        metadata,
        None,
        None,
        None,
        *args,
        *constexprs,
    )
