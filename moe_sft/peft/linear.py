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
(`combine`, models/transforms.py).

DoRA (Liu et al. 2024, as peft computes it): y = base + (m/|W'| - 1) * base_nobias +
(m/|W'|) * scale * B A x, with W' = W + scale * B A, |.| the norm of each output row taken without
gradient (the paper's section 4.3), and m initialised to |W|.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.distributed as dist
import torch.nn.functional as F
from megatron.core.tensor_parallel import mappings

from moe_sft.models.transforms import combine
from moe_sft.peft.parallel import mark_sharded


@dataclass(frozen=True)
class Part:
    """One projection of a fused linear: its name (q, k, v, gate, up; '' when not fused) and its
    output rows on this rank."""

    name: str
    out_local: int


class LinearAdapter(torch.nn.Module):
    def __init__(
        self,
        base: torch.nn.Module,
        *,
        column: bool,
        parts: list[Part],
        groups: int,
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
        self.scale = alpha / rank
        self.tp_group = tp_group
        self.tp = dist.get_world_size(tp_group) if tp_group is not None else 1
        self.sequence_parallel = sequence_parallel and self.tp > 1
        self.dropout = torch.nn.Dropout(dropout) if dropout > 0 else torch.nn.Identity()
        kw = dict(device=base.weight.device, dtype=base.weight.dtype)
        for part in parts:
            a = torch.nn.Parameter(torch.empty(rank, in_local, **kw))
            b = torch.nn.Parameter(torch.zeros(part.out_local, rank, **kw))
            if column:
                mark_sharded(b, 0)
                a.sequence_parallel = self.sequence_parallel
            else:
                mark_sharded(a, 1)
                b.sequence_parallel = self.sequence_parallel
            self.register_parameter(self._name("lora_A", part.name), a)
            self.register_parameter(self._name("lora_B", part.name), b)
        if dora:
            with torch.no_grad():
                norm = self._row_norm(base.weight.detach().float()).to(base.weight.dtype)
            self.lora_magnitude = torch.nn.Parameter(norm)
            if column:
                mark_sharded(self.lora_magnitude, 0)
            else:
                self.lora_magnitude.sequence_parallel = self.sequence_parallel
        self._base_has_bias_in_output = getattr(base, "bias", None) is not None and not base.skip_bias_add

    @staticmethod
    def _name(kind: str, part: str) -> str:
        return f"{kind}_{part}" if part else kind

    def factors(self, part: str) -> tuple[torch.nn.Parameter, torch.nn.Parameter]:
        return getattr(self, self._name("lora_A", part)), getattr(self, self._name("lora_B", part))

    def reset_a(self, initial_a, in_offset: int) -> None:
        """A from `initial_a(part)` (the whole input dim), sliced to this rank's input columns."""
        for part in self.part_names:
            a, _ = self.factors(part)
            with torch.no_grad():
                a.copy_(initial_a(part)[:, in_offset : in_offset + a.shape[1]])

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
        a_all = torch.cat([self.factors(p)[0] for p in self.part_names])
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
        hs = h.split([self.factors(p)[0].shape[0] for p in self.part_names], dim=-1)
        outs = [F.linear(hp, self.factors(p)[1]) for hp, p in zip(hs, self.part_names)]
        return combine(outs, self.groups) * self.scale

    def output(self, base: torch.nn.Module, x: torch.Tensor, base_out: torch.Tensor) -> torch.Tensor:
        lora = self._low_rank(x).view(base_out.shape)
        if not self.dora:
            return base_out + lora
        with torch.no_grad():
            weight = base.weight.detach().float() + self.delta_weight().detach().float()
            norm = self._row_norm(weight).to(base_out.dtype)
        mag_scale = self.lora_magnitude / norm
        base_nobias = base_out - base.bias if self._base_has_bias_in_output else base_out
        return base_out + (mag_scale - 1) * base_nobias + mag_scale * lora


def add_adapter_output(module: torch.nn.Module, args, output):
    """Forward hook of an adapted linear: (out, bias) -> (out + adapter, bias)."""
    out, bias = output
    return module.adapter.output(module, args[0], out), bias
