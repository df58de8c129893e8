"""Building and loading a model whose frozen base lives in FP8 (peft.fp8_base; the storage and the
GEMMs: fp8_base.py) without the whole base ever resident in bf16: `placeholder_base()` builds the
model with placeholder base weights (one element of storage each, initialisation skipped),
`load_quantised` reads the converted checkpoint one decoder layer at a time into bf16 buffers of
that layer only and quantises each right after, and `materialise_placeholders` gives real storage
to the placeholders left (the LM head, trainable weights)."""

from __future__ import annotations

import contextlib

import torch
from megatron.core.tensor_parallel.layers import ColumnParallelLinear, RowParallelLinear

from moe_sft.peft.fp8_base import _LAYER, _weights, fp8_modules, is_placeholder, quantize_module
from moe_sft.runtime import patches


def _group_of(name: str) -> str:
    match = _LAYER.match(name)
    return match.group(1) if match else ""


def load_quantised(chunks, load) -> int:
    """Fill the FP8 storage from a checkpoint without its whole base in bf16: for each decoder (or
    MTP) layer in turn, its FP8 modules get bf16 buffers, `load(keep)` loads the chunk entries whose
    local state key `keep(key)` accepts into the chunks, and the buffers are quantised and freed.
    Everything else (embedding, norms, routers, LM head, adapters' base) comes in one last call.
    Returns the number of `load` calls."""
    groups: dict[str, list] = {}
    for chunk_index, chunk in enumerate(chunks):
        for name, module in fp8_modules(chunk):
            groups.setdefault(f"{chunk_index}:{_group_of(name)}", []).append((chunk_index, name, module))
    fp8_prefixes = {(c, f"{n}.") for members in groups.values() for c, n, _ in members}
    calls = 0
    for members in groups.values():
        for _, _, module in members:
            for pname, _ in _weights(module):
                buffer = _bf16_like(module, pname)
                delattr(module, pname)  # the FP8 buffer: a parameter again while the checkpoint fills it
                module.register_parameter(pname, torch.nn.Parameter(buffer, requires_grad=False))
        prefixes = {(c, f"{n}.") for c, n, _ in members}
        load(lambda c, key, p=prefixes: any(c == pc and key.startswith(pre) for pc, pre in p))
        calls += 1
        for _, _, module in members:
            quantize_module(module, module.fp8_block)
    load(lambda c, key: not any(c == pc and key.startswith(pre) for pc, pre in fp8_prefixes))
    return calls + 1


def fill_random(chunks, std: float) -> int:
    """No checkpoint to load (the benchmark's random initialisation): each FP8 weight gets N(0, std)
    values, megatron's init_method_std, quantised a layer at a time as `load_quantised` does; the
    rest keeps megatron's initialisation. Returns the weights filled."""
    targets = {
        (c, f"{name}.{p}") for c, chunk in enumerate(chunks) for name, m in fp8_modules(chunk) for p, _ in _weights(m)
    }
    filled = []

    def load(keep):
        with torch.no_grad():
            for c, chunk in enumerate(chunks):
                for key, param in chunk.named_parameters():
                    if (c, key) in targets and keep(c, key):
                        param.normal_(0.0, std)
                        filled.append(key)

    load_quantised(chunks, load)
    return len(filled)


def _bf16_like(module, pname: str) -> torch.Tensor:
    fp8 = getattr(module, pname)
    return torch.empty(fp8.shape, dtype=module.base_dtype, device=fp8.device)


# ----------------------------------------------------------------------------- building without the bf16 base


@contextlib.contextmanager
def placeholder_base():
    """Build the model with the Column/RowParallelLinear and grouped-expert weights as placeholders
    (right shape, dtype and device, one element of storage: expanded views), initialisation skipped
    for them. `install` then gives them FP8 storage and `materialise_placeholders` real storage to
    any left (the LM head, trainable weights); the checkpoint fills both. The swaps are
    runtime/patches.py's group "fp8_placeholders", restored when the block ends."""
    from megatron.core.tensor_parallel import layers as tp_layers
    from megatron.core.transformer.moe import experts as mcore_experts

    classes = (ColumnParallelLinear, RowParallelLinear, mcore_experts.GroupedMLP)
    mode = _PlaceholderMode()
    init_fns = [
        (mod, fn)
        for mod in (tp_layers, mcore_experts)
        for fn in ("_initialize_affine_weight_gpu", "_initialize_affine_weight_cpu")
        if hasattr(mod, fn)
    ]

    def wrapped(original):
        def __init__(self, *args, **kwargs):
            mode.depth += 1
            try:
                original(self, *args, **kwargs)
            finally:
                mode.depth -= 1

        return __init__

    def skip_placeholder(original, dim_at: int, stride_at: int):
        def init(weight, *args, **kwargs):
            if not is_placeholder(weight):
                return original(weight, *args, **kwargs)
            # what megatron's initialisers set besides the values
            dim = kwargs.get("partition_dim", args[dim_at - 1] if len(args) >= dim_at else 0)
            stride = kwargs.get("stride", args[stride_at - 1] if len(args) >= stride_at else 1)
            tp_layers.set_tensor_model_parallel_attributes(tensor=weight, is_parallel=True, dim=dim, stride=stride)
            return None

        return init

    positions = {"_initialize_affine_weight_gpu": (2, 3), "_initialize_affine_weight_cpu": (4, 6)}
    group, reason = patches.FP8_PLACEHOLDERS, "FP8 base built with placeholder weights"
    try:
        for cls in classes:
            patches.swap(cls, "__init__", wrapped(cls.__init__), group=group, reason=reason)
        for mod, fn in init_fns:
            patches.swap(mod, fn, skip_placeholder(getattr(mod, fn), *positions[fn]), group=group, reason=reason)
        with mode:
            yield
    finally:
        patches.restore(group)


class _PlaceholderMode(torch.overrides.TorchFunctionMode):
    """Inside a linear's / grouped MLP's __init__, a >= 2-D torch.empty is an expanded one-element
    tensor (the bias, 1-D, stays real)."""

    def __init__(self):
        super().__init__()
        self.depth = 0

    def __torch_function__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        if self.depth and getattr(func, "__name__", None) == "empty":  # (cpu_compat wraps torch.empty)
            size = args[0] if len(args) == 1 and isinstance(args[0], (tuple, list, torch.Size)) else args
            if len(size) >= 2:
                one = torch.empty(1, dtype=kwargs.get("dtype"), device=kwargs.get("device"))
                return one.expand(*size)
        return func(*args, **kwargs)


def materialise_placeholders(chunks) -> int:
    """Real storage for any placeholder weight `install` did not turn into FP8 (the LM head), drawn
    N(0, init_method_std) as megatron would have: the checkpoint load overwrites it, and a run
    without one (the benchmark's random initialisation) must not read uninitialised memory (NaN
    losses, seen once an earlier arm had used the memory)."""
    count = 0
    for chunk in chunks:
        for module in chunk.modules():
            std = getattr(getattr(module, "config", None), "init_method_std", 0.02)
            for pname, param in list(module.named_parameters(recurse=False)):
                if is_placeholder(param):
                    values = torch.empty(param.shape, dtype=param.dtype, device=param.device).normal_(0.0, std)
                    real = torch.nn.Parameter(values)
                    real.requires_grad_(param.requires_grad)
                    real.__dict__.update({k: v for k, v in param.__dict__.items() if not k.startswith("_")})
                    setattr(module, pname, real)
                    count += 1
    return count
