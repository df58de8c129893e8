"""Shared by the family/MTP tests (CPU and GPU): random packed batches and a few Adam steps
through megatron's schedule (trainer/step.py), returning the per-step losses."""

from __future__ import annotations

import torch

from moe_sft.data.packing import build_micro_batch


class PromptedDoc:
    """A token sequence whose first `prompt` tokens are prompt (no loss), the rest assistant."""

    def __init__(self, ids, prompt: int = 4):
        self.input_ids, self.assistant_mask = ids, [i >= prompt for i in range(len(ids))]


def random_batches(vocab: int, lengths, micro_batches: int = 1, prompt: int = 4, seed: int = 5):
    g = torch.Generator().manual_seed(seed)
    return [
        build_micro_batch([PromptedDoc(torch.randint(0, vocab, (n,), generator=g).tolist(), prompt) for n in lengths])
        for _ in range(micro_batches)
    ]


def adam_steps(
    model, batches, vocab: int, device: str, steps: int, lr: float, mtp_weight: float = 0.0, after_backward=None
):
    """(loss per step, MTP loss per step) over `steps` Adam updates on the same batches;
    `after_backward(model)` runs every step before the update (e.g. to check gradients)."""
    from moe_sft.trainer.step import run_forward_backward

    tokens = sum(int(b.loss_mask.sum()) for b in batches)
    opt = torch.optim.Adam(model.parameters(), lr=lr)
    main, mtp = [], []
    for _ in range(steps):
        opt.zero_grad(set_to_none=True)
        total = run_forward_backward([model], batches, tokens, device, vocab, seq_length=0, mtp_weight=mtp_weight)
        main.append((total[0] / total[1]).item())
        mtp.append((total[2] / total[1]).item())
        if after_backward is not None:
            after_backward(model)
        opt.step()
    return main, mtp
