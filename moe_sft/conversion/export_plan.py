"""What the streaming exporter reads, in which pieces, and what it writes, gated by completeness.py.

The megatron model is built on the meta device (no storage, meta_model.py); its sharded state dict,
with megatron's factories applied, says for every parameter which checkpoint keys hold it and how:
each ShardedTensor is a box (key, global offset, shape) whose data is a *view* of the parameter
(`View`: shape, strides, offset into the parameter's flat storage). Reading a box into the same
view of a buffer rebuilds the parameter's elements exactly as megatron's loader would, at whatever
layout the checkpoint was saved (DCP reads the overlaps of the box with the stored chunks).

A parameter is read in *units*, ranges of its slices:

* expert stacks (`Transform.expert_separable`): slice e is expert e's contiguous
  block of GroupedMLP's weight1/weight2, which alone gives expert e's HF tensors;
* row-separable tensors (`Transform.row_separable`, 2-D or more): slice r is
  row r, which is row r of each HF tensor (vocab padding rows are not exported);
* anything else (fused QKV, a dense MLP's gate/up, norms) is one slice, read whole.

A unit is at most `read_bytes` (or one slice, if larger); dcp_reader.py reads just its rows of
each stored chunk, whatever the chunking of the checkpoint. Before anything is read, the gates
check that every megatron parameter is exported, every model tensor of the checkpoint is consumed
(optimizer state aside), the checkpoint has every box the model needs, and the HF names and shapes
are exactly those transformers' own `save_pretrained` writes for this config (plus DeepSeek-V3's
MTP layers, which transformers' model does not hold).
"""

from __future__ import annotations

import dataclasses
import re
from collections import defaultdict

import torch

from moe_sft.conversion import completeness, mapping
from moe_sft.conversion.dcp_reader import DistCheckpointReader, IncompleteCheckpointError
from moe_sft.conversion.mapping import Entry, MappingError
from moe_sft.conversion.meta_model import MetaViewsStayViews, View, meta_model, view_of
from moe_sft.runtime.logs import get_logger

log = get_logger(__name__)

DEFAULT_READ_BYTES = 256 * 2**20
# Checkpoint tensors that are not model weights: the distributed optimizer's state
# (`optimizer.state.<exp_avg|exp_avg_sq|fp32_param>.<model key>`, megatron's make_sharded_optimizer_tensor).
NOT_MODEL_STATE = re.compile(r"optimizer\..*")


@dataclasses.dataclass(frozen=True)
class Piece:
    """One ShardedTensor of the meta model: checkpoint box (key, offsets, view.shape) ↔ elements."""

    key: str
    offsets: tuple[int, ...]
    view: View
    axis: int  # the view's outermost axis: boxes are cut along it
    slices: torch.Tensor | None  # slice of the parameter each index along `axis` falls in

    def restrict(self, first: int, stop: int) -> tuple[tuple[int, ...], View] | None:
        """(offsets, view) of the part of this box in slices [first, stop), or None."""
        if self.slices is None:  # read whole
            return self.offsets, self.view
        lo = int(torch.searchsorted(self.slices, first))
        hi = int(torch.searchsorted(self.slices, stop))
        if hi <= lo:
            return None
        offsets = list(self.offsets)
        offsets[self.axis] += lo
        return tuple(offsets), self.view.rows(self.axis, lo, hi)


@dataclasses.dataclass
class ParamPlan:
    """One megatron parameter: its mapping entry, how it is cut and the HF tensors it gives."""

    entry: Entry
    shape: tuple[int, ...]
    dtype: torch.dtype  # as stored in the checkpoint
    kind: str  # experts | rows | whole
    slice_shape: tuple[int, ...]  # one expert's block, one row, or the whole parameter
    slice_elems: int
    pieces: list[Piece]
    units: list[tuple[int, int]]  # slice ranges [first, stop)
    hf: list[tuple[str, tuple[int, ...]]]

    def unit_shape(self, first: int, stop: int) -> tuple[int, ...]:
        """Shape of slices [first, stop) as one tensor: (experts, *block), (rows, *row), shape."""
        return self.shape if self.kind == "whole" else (stop - first,) + self.slice_shape

    def largest_unit_bytes(self) -> int:
        return max(torch.Size(self.unit_shape(a, b)).numel() for a, b in self.units) * self.dtype.itemsize


@dataclasses.dataclass
class ExportPlan:
    params: list[ParamPlan]
    ctx: dict
    # Tensors transformers expects with no elements and no megatron parameter behind them
    # (zero-width modules, e.g. DeepSeek-V3's shared experts when n_shared_experts=0).
    empty: list[tuple[str, tuple[int, ...]]] = dataclasses.field(default_factory=list)
    # A multimodal source's tensors carried through (composite.py), written after the rest.
    carried: list[tuple[str, tuple[int, ...]]] = dataclasses.field(default_factory=list)

    def hf_specs(self) -> list[tuple[str, tuple[int, ...]]]:
        """(HF name, shape) of every tensor written, in mapping order (the shard order)."""
        return [spec for p in self.params for spec in p.hf] + self.empty + self.carried


# ------------------------------------------------------------------------------------------------
# Cutting a parameter into slices and a box into the part each unit needs
# ------------------------------------------------------------------------------------------------


def _outer_axis(view: View) -> int:
    sized = [a for a, n in enumerate(view.shape) if n > 1]
    return max(sized, key=lambda a: view.stride[a]) if sized else 0


def _index_slices(view: View, axis: int, slice_elems: int) -> torch.Tensor | None:
    """Slice of each index along `axis`, or None when an index's elements straddle two slices."""
    inner = sum((n - 1) * s for a, (n, s) in enumerate(zip(view.shape, view.stride)) if a != axis)
    starts = view.offset + torch.arange(view.shape[axis], dtype=torch.int64) * view.stride[axis]
    first, last = starts // slice_elems, (starts + inner) // slice_elems
    if not torch.equal(first, last) or any(s <= 0 for s in view.stride if s):
        return None
    return first


def _kind(entry: Entry, shape: tuple[int, ...], hf_shapes: list, experts: int) -> tuple[str, int]:
    """(kind, number of slices) for a parameter of `shape`."""
    if entry.transform.expert_separable and experts > 0 and len(entry.hf) % experts == 0:
        return "experts", experts
    if (
        entry.transform.row_separable
        and len(shape) >= 2
        and all(tuple(s[1:]) == tuple(shape[1:]) and s[0] <= shape[0] for s in hf_shapes)
    ):
        return "rows", shape[0]
    return "whole", 1


def _units(count: int, slice_bytes: int, budget: int) -> list[tuple[int, int]]:
    """Slice ranges of at most `budget` bytes (one slice if a slice is larger)."""
    step = max(1, budget // max(slice_bytes, 1))
    return [(first, min(first + step, count)) for first in range(0, count, step)]


# ------------------------------------------------------------------------------------------------
# The plan and its gates
# ------------------------------------------------------------------------------------------------


def _pieces_by_param(model) -> tuple[dict, dict]:
    """{parameter: [(ShardedTensor, View)]} and {parameter: tensor} of the meta model."""
    from megatron.core.dist_checkpointing.dict_utils import nested_values
    from megatron.core.dist_checkpointing.mapping import ShardedTensor, apply_factories

    state = model.state_dict(keep_vars=True)
    tensors = {n: t for n, t in state.items() if isinstance(t, torch.Tensor)}
    ids = {id(t): n for n, t in tensors.items()}
    with MetaViewsStayViews():  # factories applied here, so their outputs are parameter views
        sharded = model.sharded_state_dict()
        apply_factories(sharded)
    found, seen = defaultdict(list), set()
    for sh in nested_values(sharded):
        if not isinstance(sh, ShardedTensor):
            continue
        if sh.flattened_range is not None:
            raise RuntimeError(f"{sh.key}: flattened sharded tensors are not supported")
        view = view_of(sh, ids)
        if view.param is None:
            raise RuntimeError(
                f"megatron's sharded state has {sh.key!r}, which is no view of a "
                "model parameter; the exporter does not know which HF tensor it is"
            )
        if (sh.key, tuple(sh.global_offset)) not in seen:
            seen.add((sh.key, tuple(sh.global_offset)))
            found[view.param].append((sh, view))
    return found, tensors


def _check_checkpoint_keys(found: dict, stored: dict, path) -> None:
    """Every box the model needs is in the checkpoint; every model tensor stored is consumed."""
    needed = {sh.key: tuple(sh.global_shape) for pairs in found.values() for sh, _ in pairs}
    missing = sorted(k for k in needed if k not in stored)
    if missing:
        raise IncompleteCheckpointError(
            f"{path}: the checkpoint lacks {len(missing)} tensor(s) the model needs: {mapping._list(missing)}"
        )
    shapes = [f"{k} {tuple(stored[k].size)} (model: {s})" for k, s in needed.items() if tuple(stored[k].size) != s]
    if shapes:
        raise IncompleteCheckpointError(
            f"{path}: tensors of another shape than the model's: "
            f"{'; '.join(shapes[:10])}; is config.json the one it was "
            "trained with?"
        )
    holes = [
        f"{k} ({sum(c.sizes.numel() for c in stored[k].chunks)} of {stored[k].size.numel()} elements)"
        for k in needed
        if sum(c.sizes.numel() for c in stored[k].chunks) != stored[k].size.numel()
    ]
    if holes:  # DCP's chunks never overlap, so a shortfall is a hole
        raise IncompleteCheckpointError(
            f"{path}: the stored chunks do not cover {len(holes)} "
            f"tensor(s): {'; '.join(holes[:10])}; a rank's files are "
            "missing from .metadata, re-save the checkpoint"
        )
    unconsumed = [k for k in stored if k not in needed and not NOT_MODEL_STATE.fullmatch(k)]
    if unconsumed:
        raise MappingError(
            f"{path}: the checkpoint holds {len(unconsumed)} model tensor(s) the "
            f"export would not write: {mapping._list(unconsumed)}. Refusing to "
            "export silently incomplete weights."
        )


def _param_plan(entry: Entry, tensor, pairs, stored: dict, ctx: dict, budget: int) -> ParamPlan:
    shape = tuple(tensor.shape)
    dtypes = {stored[sh.key].properties.dtype for sh, _ in pairs}
    if len(dtypes) != 1:
        raise IncompleteCheckpointError(f"{entry.mcore}: stored in several dtypes {sorted(map(str, dtypes))}")
    dtype = dtypes.pop()
    hf_shapes = [tuple(t.shape) for t in entry.transform.to_hf(torch.empty(shape, device="meta"), ctx)]
    if len(hf_shapes) != len(entry.hf):
        raise MappingError(
            f"{entry.transform.name} gives {len(hf_shapes)} tensors for {len(entry.hf)} HF names ({entry.mcore})"
        )
    covered = sum(torch.Size(view.shape).numel() for _, view in pairs)
    if covered != tensor.numel():
        raise MappingError(f"{entry.mcore}: megatron's sharded state covers {covered} of its {tensor.numel()} elements")
    kind, count = _kind(entry, shape, hf_shapes, ctx["num_experts"])
    slice_elems = tensor.numel() // count
    pieces = []
    for sh, view in pairs:
        axis = _outer_axis(view)
        slices = _index_slices(view, axis, slice_elems) if kind != "whole" else None
        if kind != "whole" and slices is None:
            log.warning("%s: a checkpoint box straddles %s; read whole", entry.mcore, kind)
            return _param_plan_whole(entry, shape, dtype, pairs, hf_shapes)
        pieces.append(Piece(sh.key, tuple(sh.global_offset), view, axis, slices))
    units = _units(count, slice_elems * dtype.itemsize, budget)
    slice_shape = (
        entry.transform.expert_block(shape, count) if kind == "experts" else shape[1:] if kind == "rows" else shape
    )
    return ParamPlan(entry, shape, dtype, kind, slice_shape, slice_elems, pieces, units, list(zip(entry.hf, hf_shapes)))


def _param_plan_whole(entry, shape, dtype, pairs, hf_shapes) -> ParamPlan:
    pieces = [Piece(sh.key, tuple(sh.global_offset), view, 0, None) for sh, view in pairs]
    return ParamPlan(
        entry, shape, dtype, "whole", shape, torch.Size(shape).numel(), pieces, [(0, 1)], list(zip(entry.hf, hf_shapes))
    )


def build(
    family,
    hf_cfg,
    reader: DistCheckpointReader,
    read_bytes: int = DEFAULT_READ_BYTES,
    copies_absent=(),
    whole=None,
    carried: list[tuple[str, tuple[int, ...]]] = (),
) -> ExportPlan:
    """Plan the export of the checkpoint `reader` reads; every gate runs here, before any read.
    `copies_absent`: the HF copies the converted source did not store (mapping.without_copies),
    left out of the export too. `whole`: a multimodal source's composite view (the language
    model's names as it spells them) and `carried`: (name, shape) of the tensors carried through."""
    model = meta_model(family, hf_cfg, "fp32")
    entries = mapping.expand(family, hf_cfg)
    if whole is not None:
        entries = whole.rename(entries)
    entries = mapping.without_copies(entries, copies_absent)
    completeness.check_produced(entries, model.state_dict(keep_vars=True))  # every megatron parameter exported
    found, tensors = _pieces_by_param(model)
    stored = reader.tensors()
    _check_checkpoint_keys(found, stored, reader.path)
    ctx = mapping.transform_context(family, hf_cfg)
    unexported = set(found) - {e.mcore for e in entries}
    if unexported:
        raise MappingError(f"checkpoint tensors of no mapped parameter: {mapping._list(unexported)}")
    params = [_param_plan(e, tensors[e.mcore], found[e.mcore], stored, ctx, read_bytes) for e in entries]
    mapped = {name for p in params for name, _ in p.hf} | {name for name, _ in carried}
    empty = [
        (name, shape)
        for name, shape in completeness.hf_expected(family, hf_cfg, whole).items()
        if 0 in shape and name not in mapped
    ]
    plan = ExportPlan(params, ctx, empty, list(carried))
    completeness.check_hf_names(family, hf_cfg, plan.hf_specs(), whole)
    return plan
