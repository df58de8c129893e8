"""PackedSeqParams that also carry the document bounds as the host built them."""

from __future__ import annotations

from dataclasses import dataclass

import torch
from megatron.core.packed_seq_params import PackedSeqParams


@dataclass
class HostPackedSeqParams(PackedSeqParams):
    """megatron's PackedSeqParams plus `cu_seqlens_host`, the CPU tensor the device bounds were copied
    from: a layer that needs the bounds on the host (Gated DeltaNet's fla kernels size their grids
    from them) reads them here instead of copying them back, which would wait for the GPU."""

    cu_seqlens_host: torch.Tensor | None = None
