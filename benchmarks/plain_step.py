"""What the reference arms (transformers, torchtitan) share: the loss and the optimizer update of a
plain PyTorch SFT step, each inside its profiler phase scope (phases.py)."""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch.autograd.profiler import record_function

from benchmarks.phases import SCOPE


def token_loss(logits: torch.Tensor, mb, loss_tokens: float, device) -> torch.Tensor:
    """This micro-batch's share of the step's loss: masked token CE over the step's loss tokens
    (the trainer's normalisation)."""
    with record_function(SCOPE + "loss"):
        ce = F.cross_entropy(logits[0].float(), mb.labels.to(device), reduction="none")
        return (ce * mb.loss_mask.to(device)).sum() / loss_tokens


def optimizer_update(params, optimizer: torch.optim.Optimizer, clip_grad: float) -> None:
    with record_function(SCOPE + "optimizer"):
        torch.nn.utils.clip_grad_norm_(params, clip_grad)
        optimizer.step()
