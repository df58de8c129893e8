"""Pure tensor transforms between HF and megatron-core layouts, each an inverse pair.

`to_hf(from_hf(x)) == x` bit-exactly for every transform (tests/cpu/test_transforms.py): they
only slice, concatenate, transpose and reshape — no arithmetic. Names carry layouts:
`E` experts, `F` ffn width, `H` hidden, `G` query groups, `D` head dim.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable, Sequence
from dataclasses import dataclass

import torch

Tensors = Sequence[torch.Tensor]


@dataclass(frozen=True)
class Transform:
    """A named inverse pair. `ctx` carries the model dimensions a transform needs.

    Its streaming properties say which parts of the megatron tensor can be made (convert,
    tensor_source.py) or taken apart (export, export_plan.py) without the whole tensor:

    * `row_separable`: megatron row r is HF row r of the first tensor (or a zero padding row);
    * `expert_block`: set for expert stacks, whose megatron tensor is the concatenation of
      per-expert blocks, each made from that expert's HF tensors alone (checked in
      tests/cpu/test_streaming_convert.py); `expert_block(shape, experts)` is the shape of expert
      e's block as a tensor of its own.

    `copies`: the HF tensors after the first are copies of it (checked equal on the way in) that
    carry no information, so a checkpoint may lack any of them (`keeping`).
    """

    name: str
    from_hf: Callable[[Tensors, dict], torch.Tensor]
    to_hf: Callable[[torch.Tensor, dict], list[torch.Tensor]]
    row_separable: bool = False
    expert_block: Callable[[tuple[int, ...], int], tuple[int, ...]] | None = None
    copies: bool = False

    @property
    def expert_separable(self) -> bool:
        return self.expert_block is not None


def _identity_from(ts: Tensors, ctx: dict) -> torch.Tensor:
    return ts[0]


def _identity_to(t: torch.Tensor, ctx: dict) -> list[torch.Tensor]:
    return [t]


IDENTITY = Transform("identity", _identity_from, _identity_to, row_separable=True)


def _qkv_from(ts: Tensors, ctx: dict) -> torch.Tensor:
    """q [G*R*D, H], k [G*D, H], v [G*D, H] → megatron's per-group interleave [G*(R+2)*D, H]."""
    q, k, v = ts
    groups, dim = ctx["num_query_groups"], ctx["head_dim"]
    hidden = q.shape[-1]
    q_GRDH = q.reshape(groups, -1, dim, hidden)
    k_G1DH = k.reshape(groups, 1, dim, hidden)
    v_G1DH = v.reshape(groups, 1, dim, hidden)
    return torch.cat([q_GRDH, k_G1DH, v_G1DH], dim=1).reshape(-1, hidden)


def _qkv_to(t: torch.Tensor, ctx: dict) -> list[torch.Tensor]:
    groups, dim = ctx["num_query_groups"], ctx["head_dim"]
    hidden = t.shape[-1]
    per_group = t.reshape(groups, -1, dim, hidden)
    heads_per_group = per_group.shape[1] - 2
    q, k, v = torch.split(per_group, [heads_per_group, 1, 1], dim=1)
    return [q.reshape(-1, hidden).contiguous(), k.reshape(-1, hidden).contiguous(), v.reshape(-1, hidden).contiguous()]


QKV_INTERLEAVE = Transform("qkv_interleave", _qkv_from, _qkv_to)


def _qkv_bias_from(ts: Tensors, ctx: dict) -> torch.Tensor:
    return _qkv_from([t.unsqueeze(-1) for t in ts], ctx).squeeze(-1)


def _qkv_bias_to(t: torch.Tensor, ctx: dict) -> list[torch.Tensor]:
    return [x.squeeze(-1) for x in _qkv_to(t.unsqueeze(-1), ctx)]


QKV_BIAS_INTERLEAVE = Transform("qkv_bias_interleave", _qkv_bias_from, _qkv_bias_to)


def _gate_up_from(ts: Tensors, ctx: dict) -> torch.Tensor:
    """gate [F, H], up [F, H] → linear_fc1 [2F, H] (megatron's SwiGLU: first half is gated)."""
    return torch.cat([ts[0], ts[1]], dim=0)


def _gate_up_to(t: torch.Tensor, ctx: dict) -> list[torch.Tensor]:
    gate, up = torch.chunk(t, 2, dim=0)
    return [gate.contiguous(), up.contiguous()]


GATE_UP_FUSE = Transform("gate_up_fuse", _gate_up_from, _gate_up_to)


def _experts_fc1_from(ts: Tensors, ctx: dict) -> torch.Tensor:
    """[gate_0, up_0, gate_1, up_1, ...] each [F, H] → GroupedMLP.weight1 [H, E*2F].

    GroupedMLP views weight1 as w1_EH2F = weight1.view(E, H, 2F): expert e's block is
    contiguous and holds (gate_e ‖ up_e)ᵀ.
    """
    gates, ups = ts[0::2], ts[1::2]
    w1_EH2F = torch.stack([torch.cat([g, u], 0).t() for g, u in zip(gates, ups)])
    hidden = w1_EH2F.shape[1]
    return w1_EH2F.contiguous().view(hidden, -1)


def _experts_fc1_to(t: torch.Tensor, ctx: dict) -> list[torch.Tensor]:
    experts, hidden = ctx["num_experts"], t.shape[0]
    out = []
    # reshape, not contiguous().view(): a strided block (the exporter reads one expert laid out
    # as the checkpoint stores it, [2F, H]) is viewed, so gate/up below need no copy at all
    for w_H2F in t.reshape(experts, hidden, -1):
        gate, up = torch.chunk(w_H2F.t(), 2, dim=0)
        out += [gate.contiguous(), up.contiguous()]
    return out


# Expert e's block as a tensor of its own: weight1 [H, E*2F] = w1.view(E, H, 2F) → block [H, 2F].
EXPERTS_FC1 = Transform(
    "experts_gate_up_stack",
    _experts_fc1_from,
    _experts_fc1_to,
    expert_block=lambda shape, experts: (shape[0], shape[1] // experts),
)


def _experts_fc2_from(ts: Tensors, ctx: dict) -> torch.Tensor:
    """[down_0, down_1, ...] each [H, F] → GroupedMLP.weight2 [E*F, H] (block e = down_eᵀ)."""
    w2_EFH = torch.stack([d.t() for d in ts])
    return w2_EFH.contiguous().view(-1, w2_EFH.shape[-1])


def _experts_fc2_to(t: torch.Tensor, ctx: dict) -> list[torch.Tensor]:
    experts, hidden = ctx["num_experts"], t.shape[-1]
    return [w_FH.t().contiguous() for w_FH in t.reshape(experts, -1, hidden)]  # as in fc1


# Expert e's block: weight2 [E*F, H] = w2.view(E, F, H) → block [F, H].
EXPERTS_FC2 = Transform(
    "experts_down_stack",
    _experts_fc2_from,
    _experts_fc2_to,
    expert_block=lambda shape, experts: (shape[0] // experts, shape[1]),
)


def _pad_vocab_from(ts: Tensors, ctx: dict) -> torch.Tensor:
    """[V, H] → [V_padded, H] with zero rows: TP shards the vocab evenly."""
    t = ts[0]
    padded = ctx["padded_vocab_size"]
    if padded == t.shape[0]:
        return t
    return torch.cat([t, t.new_zeros(padded - t.shape[0], *t.shape[1:])], dim=0)


def _pad_vocab_to(t: torch.Tensor, ctx: dict) -> list[torch.Tensor]:
    return [t[: ctx["vocab_size"]].contiguous()]  # padded rows are never exported


PAD_VOCAB = Transform("pad_vocab", _pad_vocab_from, _pad_vocab_to, row_separable=True)


class CopiesDifferError(ValueError):
    """HF tensors that must be copies of one megatron tensor are not equal."""


def _shared_vocab_from(ts: Tensors, ctx: dict) -> torch.Tensor:
    """The main embedding (or head) + its copies in each MTP layer → one padded megatron tensor.

    DeepSeek-V3 stores `model.layers.{N}.embed_tokens` / `shared_head.head` as copies of the main
    embedding / lm_head; megatron's MTP uses the main ones. Copies that differ would be lost, so
    they are refused rather than silently dropped.
    """
    differing = [i for i, t in enumerate(ts[1:], 1) if not torch.equal(t, ts[0])]
    if differing:
        raise CopiesDifferError(f"copies at positions {differing} differ from the first tensor")
    return _pad_vocab_from(ts[:1], ctx)


def _shared_vocab_to(t: torch.Tensor, ctx: dict) -> list[torch.Tensor]:
    main = _pad_vocab_to(t, ctx)[0]
    return [main] + [main.clone() for _ in range(ctx["num_mtp_layers"])]


# Vocab padding + one copy per MTP layer (DeepSeek-V3's and GLM-4.5's checkpoints carry them,
# GLM-4.6's does not: `keeping`).
PAD_VOCAB_MTP_SHARED = Transform(
    "pad_vocab_mtp_shared", _shared_vocab_from, _shared_vocab_to, row_separable=True, copies=True
)


def keeping(transform: Transform, positions: Sequence[int]) -> Transform:
    """`transform` (a `copies` one) for the HF tensors at `positions` of its names only: the main
    tensor (position 0) and the copies a checkpoint stores. Copies are interchangeable, so the
    stored ones go in as they are and only those come out."""
    if not transform.copies or not positions or positions[0] != 0:
        raise ValueError(f"{transform.name}: only copies after the first may be left out, not {list(positions)}")
    kept = tuple(positions)

    def to_hf(t: torch.Tensor, ctx: dict) -> list[torch.Tensor]:
        tensors = transform.to_hf(t, ctx)
        return [tensors[i] for i in kept]

    return dataclasses.replace(transform, to_hf=to_hf)


def combine(outputs: list[torch.Tensor], groups: int) -> torch.Tensor:
    """Part outputs (last dim; an adapter's, one per part of a fused linear) laid out as the fused
    weight's rows: `groups` interleaved groups (megatron's linear_qkv: per query group [q heads, k,
    v]); groups=1 concatenates."""
    if len(outputs) == 1:
        return outputs[0]
    return torch.cat([o.unflatten(-1, (groups, -1)) for o in outputs], dim=-1).flatten(-2)


ALL_TRANSFORMS = (
    IDENTITY,
    QKV_INTERLEAVE,
    QKV_BIAS_INTERLEAVE,
    GATE_UP_FUSE,
    EXPERTS_FC1,
    EXPERTS_FC2,
    PAD_VOCAB,
    PAD_VOCAB_MTP_SHARED,
)
