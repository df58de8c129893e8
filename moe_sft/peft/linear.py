"""LoRA / DoRA beside one of megatron's tensor-parallel linears, exact at every TP/SP layout.

The adapter adds scale * B(A(dropout(x))) to the linear's output (a forward hook: the base
module, its names and its checkpoint keys stay megatron's). How the factors are split follows the
base weight (W: out x in, split on out for a ColumnParallelLinear, on in for a RowParallelLinear):

- column: A (r x in) is whole on every TP rank, B (out/tp x r) is split like W. Under sequence
  parallelism A runs on this rank's tokens and the r-wide result is all-gathered (cheap), so A's
  gradient is partial over TP: it carries `sequence_parallel`, which megatron's
  finalize_model_grads sums over TP as it does for norms. Without SP the r-wide result's gradient
  is all-reduced (megatron's copy-to-TP region), the same way the base input's is.
- row: A (r x in/tp) is split like W and B (out x r) whole; the partial r-wide result is summed
  over TP (reduce-scattered to the sequence shards under SP, then B's gradient is partial:
  `sequence_parallel` again).

A fused base (GQA's linear_qkv = q, k, v; a gated linear_fc1 = gate, up) gets one A/B pair per
part, as transformers' separate q/k/v and gate/up projections have, so the adapters match a peft
adapter on the HF model exactly. Their outputs are laid out like the fused weight's rows
(`combine`, models/transforms.py). Where one transformers projection holds several parts (the
Gated DeltaNet's in_proj = q, k, v, z, b, a, of which Qwen3.5's in_proj_qkv holds q, k and v,
Qwen3-Next's in_proj_qkvz four), those parts share one A, named by the parts it serves
(`lora_A_qkv`), and keep a B each (`lora_B_q`, ...): each part is split over TP on its own, so a
B per part reshards like megatron's in_proj does (its checkpoint splits it into the same parts).
DoRA's magnitude is likewise kept per part (`split_magnitude`) when the parts are concatenated
(in_proj, gate/up), where a single vector split over TP would hold [q0, k0, ..., q1, k1, ...] and
reshard wrongly; linear_qkv's query groups split over TP whole, so one vector is exact there (and
its names must not depend on the TP degree: one query group per rank is still linear_qkv's layout).

DoRA (Liu et al. 2024, as peft computes it): y = base + (m/|W'| - 1) * base_nobias +
(m/|W'|) * scale * B A x, with W' = W + scale * B A, |.| the norm of each output row taken without
gradient (the paper's section 4.3), and m initialised to |W|. |W'| changes only at the optimizer
step, so inside `norms_once` (the trainer's forward-backward of one step, and an evaluation) the
first forward computes it and the step's other micro-batches and recomputed forwards reuse that
tensor: the same values, without reading W in fp32 and all-reducing the row-parallel norms per
micro-batch.
"""

from __future__ import annotations

import contextlib
from dataclasses import dataclass

import torch
import torch.distributed as dist
import torch.nn.functional as F
from megatron.core.tensor_parallel import mappings

from moe_sft.models.transforms import combine
from moe_sft.peft.parallel import mark_sharded


@dataclass(frozen=True)
class Part:
    """One projection of a fused linear: its name (q, k, v, z, b, a, gate, up; '' when not fused),
    its output rows on this rank, and the A it shares with the other parts of its transformers
    projection (None: its own)."""

    name: str
    out_local: int
    shared_a: str | None = None

    @property
    def a(self) -> str:
        return self.name if self.shared_a is None else self.shared_a


class LinearAdapter(torch.nn.Module):
    def __init__(
        self,
        base: torch.nn.Module,
        *,
        column: bool,
        parts: list[Part],
        groups: int,
        split_magnitude: bool,
        rank: int,
        alpha: float,
        dropout: float,
        dora: bool,
        tp_group,
        sequence_parallel: bool,
    ):
        super().__init__()
        out_local, in_local = base.weight.shape
        assert sum(p.out_local for p in parts) == out_local, (parts, out_local)
        self.column, self.groups, self.dora = column, groups, dora
        self.part_names = [p.name for p in parts]
        self.a_of = {p.name: p.a for p in parts}
        self.a_names = list(dict.fromkeys(p.a for p in parts))
        assert all(a == "".join(p.name for p in parts if p.a == a) for a in self.a_names), parts  # contiguous
        self.split_magnitude = split_magnitude and len(parts) > 1
        self.scale = alpha / rank
        self.tp_group = tp_group
        self.tp = dist.get_world_size(tp_group) if tp_group is not None else 1
        self.sequence_parallel = sequence_parallel and self.tp > 1
        self.dropout = torch.nn.Dropout(dropout) if dropout > 0 else torch.nn.Identity()
        kw = dict(device=base.weight.device, dtype=base.weight.dtype)
        for name in self.a_names:
            a = torch.nn.Parameter(torch.empty(rank, in_local, **kw))
            if column:
                a.sequence_parallel = self.sequence_parallel
            else:
                mark_sharded(a, 1)
            self.register_parameter(self._name("lora_A", name), a)
        for part in parts:
            b = torch.nn.Parameter(torch.zeros(part.out_local, rank, **kw))
            if column:
                mark_sharded(b, 0)
            else:
                b.sequence_parallel = self.sequence_parallel
            self.register_parameter(self._name("lora_B", part.name), b)
        if dora:
            magnitudes = {self._name("lora_magnitude", p.name): p.out_local for p in parts}
            if not self.split_magnitude:
                magnitudes = {"lora_magnitude": out_local}
            self.magnitude_names = list(magnitudes)
            for name, rows in magnitudes.items():
                param = torch.nn.Parameter(torch.zeros(rows, **kw))
                if column:
                    mark_sharded(param, 0)
                else:
                    param.sequence_parallel = self.sequence_parallel
                self.register_parameter(name, param)
            with torch.no_grad():
                self.set_magnitude(self._row_norm(base.weight.detach().float()))
        self._base_has_bias_in_output = getattr(base, "bias", None) is not None and not base.skip_bias_add
        self.keep_norm = False  # set by `norms_once`
        self._kept_norm: torch.Tensor | None = None

    @staticmethod
    def _name(kind: str, part: str) -> str:
        return f"{kind}_{part}" if part else kind

    def factors(self, part: str) -> tuple[torch.nn.Parameter, torch.nn.Parameter]:
        return getattr(self, self._name("lora_A", self.a_of[part])), getattr(self, self._name("lora_B", part))

    def magnitude(self) -> torch.Tensor:
        """DoRA's magnitude of every output row, in the base weight's local row order."""
        if not self.split_magnitude:
            return self.lora_magnitude
        return combine([getattr(self, n).unsqueeze(0) for n in self.magnitude_names], 1)[0]

    def set_magnitude(self, rows: torch.Tensor) -> None:
        """DoRA's magnitude from one value per local output row (under no_grad)."""
        params = [getattr(self, n) for n in self.magnitude_names]
        for param, value in zip(params, rows.split([p.shape[0] for p in params])):
            param.copy_(value.to(param.dtype))

    def reset_a(self, initial_a, in_offset: int) -> None:
        """A from `initial_a(name)` (the whole input dim; name: the parts it serves), sliced to
        this rank's input columns."""
        for name in self.a_names:
            a = getattr(self, self._name("lora_A", name))
            with torch.no_grad():
                a.copy_(initial_a(name)[:, in_offset : in_offset + a.shape[1]])

    # ------------------------------------------------------------------ math
    def delta_weight(self) -> torch.Tensor:
        """scale * B @ A in the base weight's local layout (out_local x in_local)."""
        rows = [(b @ a).t() for a, b in (self.factors(p) for p in self.part_names)]
        return combine(rows, self.groups).t() * self.scale

    def _row_norm(self, weight: torch.Tensor) -> torch.Tensor:
        """Norm of each output row of the full (unsplit) weight."""
        squares = weight.pow(2).sum(dim=1)
        if not self.column and self.tp > 1:
            dist.all_reduce(squares, group=self.tp_group)
        return squares.sqrt()

    def _low_rank(self, x: torch.Tensor) -> torch.Tensor:
        """scale * B A x as rows (tokens x out_local): 2-D throughout. On a 3-D input whose last dim
        is a strided slice (a part of the r-wide activation), F.linear ran one tiny GEMM per token,
        which dominated the step on the GPU (docs/log.md)."""
        x = self.dropout(x).reshape(-1, x.shape[-1])  # [s, b, h] is s-major: the SP collectives' dim 0
        a_all = torch.cat([getattr(self, self._name("lora_A", n)) for n in self.a_names])
        h = F.linear(x, a_all)
        if self.column:
            if self.sequence_parallel:
                h = mappings.gather_from_sequence_parallel_region(h, group=self.tp_group)
            elif self.tp > 1:
                h = mappings.copy_to_tensor_model_parallel_region(h, group=self.tp_group)
        elif self.sequence_parallel:
            h = mappings.reduce_scatter_to_sequence_parallel_region(h, group=self.tp_group)
        elif self.tp > 1:
            h = mappings.reduce_from_tensor_model_parallel_region(h, group=self.tp_group)
        h = h * self.scale  # on the rank-wide product: a pass over tokens x rank, not tokens x out
        hs = dict(zip(self.a_names, h.split(a_all.shape[0] // len(self.a_names), dim=-1)))
        outs = [F.linear(hs[self.a_of[p]], self.factors(p)[1]) for p in self.part_names]
        return combine(outs, self.groups)

    def output(self, base: torch.nn.Module, x: torch.Tensor, base_out: torch.Tensor) -> torch.Tensor:
        lora = self._low_rank(x).view(base_out.shape)
        if not self.dora:
            return base_out + lora
        norm = self._weight_norm(base, base_out.dtype)
        mag_scale = self.magnitude() / norm
        base_nobias = base_out - base.bias if self._base_has_bias_in_output else base_out
        return base_out + (mag_scale - 1) * base_nobias + mag_scale * lora

    def _weight_norm(self, base: torch.nn.Module, dtype: torch.dtype) -> torch.Tensor:
        """|W + scale * B A| per output row, without gradient (kept while `keep_norm`)."""
        if self._kept_norm is not None:
            return self._kept_norm
        with torch.no_grad():
            weight = base.weight.detach().float() + self.delta_weight().detach().float()
            norm = self._row_norm(weight).to(dtype)
        if self.keep_norm:
            self._kept_norm = norm
        return norm


@contextlib.contextmanager
def norms_once(adapters):
    """Within: each DoRA adapter of `adapters` computes its weight norm once and reuses it. Only
    while the weights stay as they are (one step's micro-batches, an evaluation): leaving forgets
    the norms."""
    dora = [a for a in adapters if isinstance(a, LinearAdapter) and a.dora]
    for adapter in dora:
        adapter.keep_norm = True
    try:
        yield
    finally:
        for adapter in dora:
            adapter.keep_norm, adapter._kept_norm = False, None


def add_adapter_output(module: torch.nn.Module, args, output):
    """Forward hook of an adapted linear: (out, bias) -> (out + adapter, bias)."""
    out, bias = output
    return module.adapter.output(module, args[0], out), bias
