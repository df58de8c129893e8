"""The converter's megatron model on the meta device, and what each checkpoint item shows of it.

`meta_model` builds the same single-rank GPTModel as the in-memory converter, but every tensor
factory allocates on `meta`: names, shapes, dtypes and the sharded state dict are real, storage is
not (a 671B model costs nothing). `view_of` says which elements of which parameter a megatron
ShardedTensor holds: its data is the parameter itself or a view of it (shape, stride, offset into
the parameter's contiguous storage), provided megatron's factories ran under `MetaViewsStayViews`.
"""

from __future__ import annotations

import dataclasses

import torch
from torch.overrides import TorchFunctionMode

from moe_sft.conversion.single_rank import build_single_rank_model, init_single_rank
from moe_sft.runtime.logs import get_logger

log = get_logger(__name__)


# ------------------------------------------------------------------------------------------------
# The model on the meta device
# ------------------------------------------------------------------------------------------------


def meta_model(family, hf_cfg, precision: str):
    """The converter's single-rank GPTModel with every parameter on the meta device (no memory)."""
    init_single_rank(precision)  # process group and parallel state: real tensors
    # Factories without a device allocate on meta; megatron's few explicit-device buffers (rotary
    # frequencies, router counters) stay real and small (compat primes torch's factory cache so
    # the context works under its wrappers).
    with torch.device("meta"):
        model = build_single_rank_model(family, hf_cfg, precision)
    real = {n: t for n, t in model.state_dict(keep_vars=True).items() if isinstance(t, torch.Tensor) and not t.is_meta}
    real_bytes = sum(t.nbytes for t in real.values())
    if real_bytes > 64 * 2**20:
        log.warning("meta model still allocates %.1f MB on the CPU: %s", real_bytes / 2**20, sorted(real)[:10])
    return model


class MetaViewsStayViews(TorchFunctionMode):
    """`.contiguous()` of a meta tensor returns the tensor itself, so megatron's sharded-tensor
    factories produce views of the parameter (whose strides say which elements they show)."""

    def __torch_function__(self, func, types, args=(), kwargs=None):
        if func is torch.Tensor.contiguous and args and isinstance(args[0], torch.Tensor) and args[0].is_meta:
            return args[0]
        return func(*args, **(kwargs or {}))


# ------------------------------------------------------------------------------------------------
# Which elements of which parameter each checkpoint item holds
# ------------------------------------------------------------------------------------------------


@dataclasses.dataclass(frozen=True)
class View:
    """`param.view(-1).as_strided(shape, stride, offset)` is the item's data (or `literal`)."""

    param: str | None
    shape: tuple[int, ...]
    stride: tuple[int, ...]
    offset: int
    literal: torch.Tensor | None = None

    def rows(self, axis: int, start: int, stop: int) -> View:
        shape = self.shape[:axis] + (stop - start,) + self.shape[axis + 1 :]
        return dataclasses.replace(self, shape=shape, offset=self.offset + start * self.stride[axis])

    def span(self) -> tuple[int, int]:
        """[first, last + 1) element of the parameter's flat storage the view touches."""
        if any(s == 0 for s in self.shape):
            return self.offset, self.offset
        if any(s < 0 for s in self.stride):
            raise ValueError(f"{self.param}: negative strides {self.stride} are not supported")
        last = self.offset + sum((n - 1) * s for n, s in zip(self.shape, self.stride))
        return self.offset, last + 1


def view_of(sh_ten, params: dict[int, str]) -> View:
    """Legacy layer-stacked tensors (prepend_axis_num > 0) get their leading size-1 axes."""
    view = _unprepended_view_of(sh_ten, params)
    ones = (1,) * sh_ten.prepend_axis_num
    return dataclasses.replace(view, shape=ones + view.shape, stride=(0,) * len(ones) + view.stride)


def _unprepended_view_of(sh_ten, params: dict[int, str]) -> View:
    data = sh_ten.data
    root = data if id(data) in params else data._base
    name = params.get(id(root)) if root is not None else None
    if name is None:
        if data.is_meta:
            raise RuntimeError(
                f"megatron's sharded state has {sh_ten.key!r}, which is no view of a "
                "model parameter; the streaming converter cannot produce it"
            )
        literal = data.detach().contiguous().clone()
        return View(None, tuple(literal.shape), tuple(literal.stride()), 0, literal=literal.view(-1))
    if root.storage_offset() != 0 or not root.is_contiguous():
        raise RuntimeError(f"{name}: parameter storage is not contiguous")
    return View(name, tuple(data.shape), tuple(data.stride()), data.storage_offset())
