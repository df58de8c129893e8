"""A step whose routing exceeded a static row capacity runs again, without static rows.

Why: the allgather dispatcher's static-row permutation (moe_sft/kernels/permute.py) holds at most
`model.moe_static_rows_capacity` x a rank's expected routed rows. Past EP2 the worst case is more
(4x at EP4 with top-8), and sizing for it would cost that many times the experts' activations;
the cap keeps the permutation static, and so CUDA-graphable, at 2x. Routing above the cap is rare,
but the rows it cuts would be missing from the update: dropless training must not drop them.

So each capped layer records on the device the most rows its routing sent above the capacity.
After the forward and backward, one all-reduce (every rank re-runs together: DDP has already
reduced the gradients) reads that; when any layer overflowed, the gradients and the state the
forward and backward changed (expert-bias counts and the biases megatron updated from them, the
aux-loss tracker, the routing statistics, the RNG) are put back, and the same micro-batches run
again with each rank's exact row count and without the CUDA graphs. The step's result is then
what it would have been without static rows. A re-run costs a second forward and backward: it is
logged with the layers and their excess, and counted (train/row_capacity_reruns).
"""

from __future__ import annotations

import contextlib

import torch
import torch.distributed as dist
from megatron.core.tensor_parallel import get_cuda_rng_tracker
from megatron.core.transformer.moe import moe_utils

from moe_sft.kernels import permute
from moe_sft.trainer import cuda_graphs


class RowCapacity:
    """The capped static-row layers of the model chunks, and the re-runs their overflows cost.

    `collective`: the run has an allgather dispatcher at EP x expert-TP > 1, the same on every rank,
    so every rank reads the excess each step, also a pipeline stage whose own layers are not capped
    (dense layers only): the re-run is the whole step's, on every rank."""

    def __init__(self, chunks, num_layers: int, collective: bool, routing_stats=None):
        self.chunks = chunks
        self.num_layers = num_layers  # megatron's layer numbers are global across pipeline stages
        self.collective = collective and dist.is_initialized()
        self.capped = []  # read in each step's before_step: a benchmark re-enables static rows per budget
        self.routing_stats = routing_stats
        self.reruns = 0
        self._saved = None

    @property
    def watching(self) -> bool:
        return bool(self.capped) or self.collective

    def before_step(self) -> None:
        """Keep what a forward and backward change besides the gradients (small tensors)."""
        self.capped = permute.capped_dispatchers(self.chunks)
        if not self.watching:
            return
        biases = [(b, b.clone()) for b in _expert_biases(self.chunks)]
        stats = self.routing_stats.acc.clone() if self.routing_stats is not None else None
        rng = (
            torch.get_rng_state(),
            torch.cuda.get_rng_state() if self._device().type == "cuda" else None,
            get_cuda_rng_tracker().get_states(),
        )
        self._saved = (biases, stats, rng)

    def overflows(self) -> list[str]:
        """The layers whose routing exceeded the capacity on any rank this step (empty: none)."""
        if not self.watching:
            return []
        excess = torch.zeros(self.num_layers, dtype=torch.long, device=self._device())
        if self.capped:
            numbers = torch.tensor([n - 1 for n, _ in self.capped], device=excess.device)
            excess.index_copy_(0, numbers, torch.stack([d.moe_sft_excess for _, d in self.capped]))
        if self.collective:
            dist.all_reduce(excess, op=dist.ReduceOp.MAX)
        for _, d in self.capped:
            d.moe_sft_excess.zero_()
        return [f"layer {n + 1}: {rows:,} rows above the capacity" for n, rows in enumerate(excess.tolist()) if rows]

    def _device(self) -> torch.device:
        return next(p for chunk in self.chunks for p in chunk.parameters()).device

    def restore(self) -> None:
        """Put back what `before_step` kept and clear what the step accumulated."""
        biases, stats, (cpu_rng, cuda_rng, tracker) = self._saved
        for chunk in self.chunks:
            chunk.zero_grad_buffer()
        moe_utils.clear_aux_losses_tracker()
        for bias, saved in biases:
            bias.copy_(saved)
        for router in _routers(self.chunks):
            if getattr(router, "local_tokens_per_expert", None) is not None:
                router.local_tokens_per_expert.zero_()
        if stats is not None:
            self.routing_stats.acc.copy_(stats)
        torch.set_rng_state(cpu_rng)
        if cuda_rng is not None:
            torch.cuda.set_rng_state(cuda_rng)
        get_cuda_rng_tracker().set_states(tracker)
        self.reruns += 1

    @contextlib.contextmanager
    def exact_rows(self):
        """Every capped layer counts its rows (one host wait per layer) and runs eagerly."""
        self.capped = permute.capped_dispatchers(self.chunks)
        for _, d in self.capped:
            d.moe_sft_static_rows = False
        replay, cuda_graphs.REPLAY = cuda_graphs.REPLAY, False
        try:
            yield
        finally:
            cuda_graphs.REPLAY = replay
            for _, d in self.capped:
                d.moe_sft_static_rows = True


def _routers(chunks):
    from megatron.core.transformer.moe.router import TopKRouter

    for chunk in chunks:
        for module in chunk.modules():
            if isinstance(module, TopKRouter):
                yield module


def _expert_biases(chunks) -> list[torch.Tensor]:
    return [r.expert_bias for r in _routers(chunks) if getattr(r, "expert_bias", None) is not None]
