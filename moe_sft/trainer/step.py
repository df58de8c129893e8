"""One training step around megatron-core's pipeline schedule.

Loss normalisation: loss = Σ w_t · token loss_t / Σ w_t over the whole global batch, w_t being
the token's loss weight (1 on assistant tokens, 0 elsewhere, or per-message weights; `loss_mask`).
The batch plan gives every rank that global weight sum without communication. megatron's
schedule divides each micro-batch loss by `num_microbatches` and DDP averages gradients over the
data-parallel group, so each micro-batch returns `local_sum / global_tokens * num_mb * dp` —
after both reductions the gradient is exactly that of the global per-token mean (not a mean
of per-micro-batch means, which overweights short micro-batches).

Context parallel (moe_sft/trainer/cp_sharding.py): each CP rank returns the loss sum over
its own tokens with the same scale. megatron 0.16.1's `forward_step_calc_loss` multiplies a
two-output loss by the CP size and DDP divides gradients by the dp×cp group size, so the two
cancel and the gradient is again Σ over all dp×cp ranks of local sums / global tokens.

Multi-token prediction (DeepSeek-V3): with D MTP depths the model returns D + 1 logit blocks;
depth k is scored against the labels k tokens further ahead within each document, and the loss
adds `mtp_loss_weight / D * Σ_k` of those sums under the same global normaliser.
"""

from __future__ import annotations

from functools import partial

import torch
import torch.distributed as dist
from megatron.core import parallel_state
from megatron.core.pipeline_parallel import get_forward_backward_func
from megatron.core.utils import get_attr_wrapped_model

from moe_sft.data.packing import PackedMicroBatch
from moe_sft.kernels import cross_entropy
from moe_sft.models.forward import packed_seq_params
from moe_sft.models.mtp import shift_targets
from moe_sft.runtime.device import host_to_device
from moe_sft.trainer import cp_sharding, loss_rows


def _to_device(mb: PackedMicroBatch, device: str) -> dict:
    if isinstance(mb, cp_sharding.CPShard):
        return mb.to_device(device)
    padding = None
    if mb.num_padding:  # padding tokens (per document and trailing) must not be routed nor counted in the aux loss
        padding = host_to_device(mb.padding_mask[None], device)
    return dict(
        tokens=host_to_device(mb.tokens[None], device),
        labels=host_to_device(mb.labels[None], device),
        loss_mask=host_to_device(mb.loss_mask[None], device),
        position_ids=host_to_device(mb.position_ids[None], device),
        params=packed_seq_params(host_to_device(mb.cu_seqlens, device), mb.max_seqlen, mb.cu_seqlens),
        padding=padding,
    )


def masked_token_losses(logits: torch.Tensor, labels: torch.Tensor, vocab_size: int) -> torch.Tensor:
    """Per-token CE [b, s] over the vocab-parallel logits [b, s, V/tp], ignoring padded vocab rows.

    The vocabulary is padded to a multiple of 128 for TP; padded columns take no probability mass
    and their output rows never train (the exported model is unchanged). The fused kernel reads the
    logits in their dtype without a copy (moe_sft/kernels/cross_entropy.py).
    """
    group = None
    if parallel_state.get_tensor_model_parallel_world_size() > 1:
        group = parallel_state.get_tensor_model_parallel_group()
    return cross_entropy.vocab_parallel_cross_entropy(logits, labels, vocab_size, group)


def _depth_sums(batch: dict, output: torch.Tensor, vocab_size: int, mtp_depths: int) -> torch.Tensor:
    """Σ weight x token loss per depth (the main head first), over every position.

    output: [b, (1 + D) s, V/tp], the main head's logits then each MTP depth's. One cross entropy
    over all of them, against the labels shifted once more per depth: one logits gradient the size
    of the output (per-depth slices each made a full-size gradient in backward: docs/log.md)."""
    b, seq = output.shape[0], output.shape[1] // (1 + mtp_depths)
    labels, masks = [batch["labels"]], [batch["loss_mask"]]
    for _ in range(mtp_depths):
        shifted = shift_targets(labels[-1], masks[-1], batch["params"], _cp_group())
        labels.append(shifted[0])
        masks.append(shifted[1])
    losses = masked_token_losses(output, torch.cat(labels, dim=1), vocab_size)
    return (losses * torch.cat(masks, dim=1)).view(b, 1 + mtp_depths, seq).sum(dim=(0, 2))


def _loss_func(
    batch: dict,
    scale: float,
    vocab_size: int,
    mtp_depths: int,
    mtp_weight: float,
    rows: loss_rows.LossRows | None,
    output: torch.Tensor,
):
    if rows is None:
        per_depth = _depth_sums(batch, output, vocab_size, mtp_depths)
    else:  # output [1, N, V/tp]: the head ran over the rows with loss weight only
        losses = (masked_token_losses(output, rows.targets, vocab_size) * rows.weights)[0]
        per_depth = torch.stack([part.sum() for part in losses.split(rows.counts)])
    local_sum = per_depth[0]
    count = batch["loss_mask"].sum().detach()
    mtp_sum = torch.zeros_like(local_sum)
    total = local_sum
    if mtp_depths:
        mtp_sum = per_depth[1:].sum() / mtp_depths
        total = local_sum + mtp_weight * mtp_sum
    reported = torch.stack([local_sum.detach(), count, mtp_sum.detach()])
    return total * scale, {"lm_loss": reported}


def _cp_group():
    if parallel_state.get_context_parallel_world_size() == 1:
        return None
    return parallel_state.get_context_parallel_group()


def _sequence_parallel_slice(padding: torch.Tensor, model) -> torch.Tensor:
    """This rank's sequence-parallel share of a [1, s] padding mask.

    megatron 0.16.1 scatters the padding mask for sequence parallelism only on the first pipeline
    stage (with the embedding); later stages see [s/tp] hidden states, so the mask is cut here.
    """
    if not get_attr_wrapped_model(model, "config").sequence_parallel:
        return padding
    tp, rank = parallel_state.get_tensor_model_parallel_world_size(), parallel_state.get_tensor_model_parallel_rank()
    share = padding.shape[1] // tp
    return padding[:, rank * share : (rank + 1) * share]


def make_forward_step(
    device: str,
    scale: float,
    vocab_size: int,
    mtp_depths: int = 0,
    mtp_weight: float = 0.0,
    pick_loss_rows: bool = False,
):
    def forward_step(data_iterator, model):
        micro_batch = next(data_iterator)
        batch = _to_device(micro_batch, device)
        if batch["padding"] is not None and not get_attr_wrapped_model(model, "pre_process"):
            batch["padding"] = _sequence_parallel_slice(batch["padding"], model)
        rows = loss_rows.loss_rows(micro_batch, mtp_depths, device) if pick_loss_rows else None
        output = model(
            input_ids=batch["tokens"],
            position_ids=batch["position_ids"],
            attention_mask=None,
            packed_seq_params=batch["params"],
            padding_mask=batch["padding"],
            loss_rows=rows,
        )
        return output, partial(_loss_func, batch, scale, vocab_size, mtp_depths, mtp_weight, rows)

    return forward_step


def run_forward_backward(
    model_chunks,
    micro_batches,
    global_loss_tokens: int,
    device: str,
    vocab_size: int,
    seq_length: int,
    forward_only: bool = False,
    mtp_weight: float = 0.0,
    fixed_shape: bool = False,
):
    """Forward+backward over this rank's micro-batches.

    `fixed_shape`: every micro-batch of every rank has `seq_length` tokens (pipeline p2p,
    allgather expert dispatch); context parallel then pads them all to one common length.
    Returns the local [loss sum, loss tokens, MTP loss sum (mean over depths)].
    """
    cp = parallel_state.get_context_parallel_world_size()
    if cp > 1:
        config = get_attr_wrapped_model(model_chunks[0], "config")
        micro_batches, seq_length = cp_sharding.shard_micro_batches(
            micro_batches,
            cp,
            parallel_state.get_context_parallel_rank(),
            config.tensor_model_parallel_size if config.sequence_parallel else 1,
            fixed_shape,
            device,
        )
    num_mb = len(micro_batches)
    dp = parallel_state.get_data_parallel_world_size()
    scale = num_mb * dp / max(global_loss_tokens, 1e-12)  # a float weight sum may be < 1
    mtp_depths = get_attr_wrapped_model(model_chunks[-1], "mtp_depths")()
    pick_rows = loss_rows.applies(cp)
    iterators = [iter(micro_batches) for _ in model_chunks]
    fb = get_forward_backward_func()
    outputs = fb(
        forward_step_func=make_forward_step(device, scale, vocab_size, mtp_depths, mtp_weight, pick_rows),
        data_iterator=iterators if len(model_chunks) > 1 else iterators[0],
        model=model_chunks if len(model_chunks) > 1 else model_chunks[0],
        num_microbatches=num_mb,
        seq_length=seq_length,
        micro_batch_size=1,
        forward_only=forward_only,
    )
    total = torch.zeros(3, dtype=torch.float64, device=device)
    for out in outputs or []:
        total += out["lm_loss"].to(total)
    return total


def global_loss(local_total: torch.Tensor) -> tuple[float, float]:
    """(loss, MTP loss): Σ / Σ tokens over the data- and context-parallel ranks of the last
    pipeline stage (each CP rank holds the sums over its own tokens)."""
    counted = (
        parallel_state.is_pipeline_last_stage(ignore_virtual=True)
        and parallel_state.get_tensor_model_parallel_rank() == 0
    )
    total = local_total if counted else torch.zeros_like(local_total)
    dist.all_reduce(total)
    tokens = total[1].clamp(min=1e-12)  # Σ loss weights (float)
    return (total[0] / tokens).item(), (total[2] / tokens).item()
