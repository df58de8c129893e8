"""The LM head over the loss-carrying rows only (moe_sft/trainer/loss_rows.py).

The host's rows, targets and weights per MTP depth must be exactly the nonzero entries of the
shifted labels and masks the full path builds on the device (megatron's roll), and training with
the picked rows must give the full path's losses and gradients: Qwen3-MoE, and DeepSeek-V3 with
its MTP depth, fp32 on CPU.
"""

from __future__ import annotations

import pytest
import torch

from moe_sft.data.chat import TokenizedDoc
from moe_sft.data.packing import build_micro_batch
from moe_sft.models.forward import packed_seq_params
from moe_sft.models.mtp import shift_targets
from moe_sft.trainer import loss_rows
from tests.train_steps import random_batches

VOCAB = 300


def _weighted_docs(seed: int, lengths):
    g = torch.Generator().manual_seed(seed)
    docs = []
    for n in lengths:
        prompt = int(torch.randint(0, n, (1,), generator=g))
        weights = [0.0] * prompt + torch.rand(n - prompt, generator=g).add(0.1).tolist()  # float weights
        docs.append(TokenizedDoc(torch.randint(0, VOCAB, (n,), generator=g).tolist(), weights))
    return docs


@pytest.mark.parametrize("pad_to,doc_multiple", [(1, 1), (64, 1), (16, 8)])
@pytest.mark.parametrize("depths", [0, 1, 3])
def test_rows_are_the_nonzero_entries_of_the_shifted_targets(pad_to, doc_multiple, depths):
    mb = build_micro_batch(_weighted_docs(depths + pad_to, (21, 2, 40, 9, 1)), pad_to=pad_to, doc_multiple=doc_multiple)
    rows, targets, weights, counts = loss_rows.host_loss_rows(
        mb.labels.numpy(), mb.loss_mask.numpy(), mb.cu_seqlens.numpy(), depths
    )
    length, params = len(mb.labels), packed_seq_params(mb.cu_seqlens, mb.max_seqlen)
    labels, mask = mb.labels[None], mb.loss_mask[None]
    start = 0
    for k in range(depths + 1):
        if k:
            labels, mask = shift_targets(labels, mask, params)
        picked = torch.nonzero(mask[0]).flatten()
        assert counts[k] == len(picked) > 0
        assert rows[start : start + counts[k]].tolist() == (picked + k * length).tolist()
        assert targets[start : start + counts[k]].tolist() == labels[0, picked].tolist()
        assert weights[start : start + counts[k]].tolist() == mask[0, picked].tolist()
        start += counts[k]
    assert start == len(rows)


def test_a_micro_batch_without_loss_keeps_one_row_of_weight_zero():
    mb = build_micro_batch([TokenizedDoc(list(range(12)), [0.0] * 12)], pad_to=16)
    rows, targets, weights, counts = loss_rows.host_loss_rows(
        mb.labels.numpy(), mb.loss_mask.numpy(), mb.cu_seqlens.numpy(), 1
    )
    assert rows.tolist() == [0] and weights.tolist() == [0.0] and counts == (1, 0)


def _losses_and_grads(model, batches, picked: bool, mtp_weight: float = 0.0):
    from moe_sft.trainer.step import run_forward_backward

    tokens = sum(float(b.loss_mask.sum()) for b in batches)
    model.zero_grad(set_to_none=True)
    old, loss_rows.ENABLED = loss_rows.ENABLED, picked
    try:
        total = run_forward_backward([model], batches, tokens, "cpu", VOCAB, seq_length=0, mtp_weight=mtp_weight)
    finally:
        loss_rows.ENABLED = old
    grads = {n: p.grad.clone() for n, p in model.named_parameters() if p.grad is not None}
    return total, grads


def _assert_same(full, picked):
    (total_full, grads_full), (total_picked, grads_picked) = full, picked
    assert torch.allclose(total_picked, total_full, rtol=1e-6, atol=0), (total_picked, total_full)
    assert grads_picked.keys() == grads_full.keys()
    for name, grad in grads_full.items():
        assert torch.allclose(grads_picked[name], grad, rtol=1e-4, atol=1e-7), name
    head = next(n for n in grads_full if n.endswith("output_layer.weight"))
    assert grads_full[head].abs().sum() > 0


def test_qwen3_moe_trains_the_same_on_the_picked_rows():
    from moe_sft.conversion.single_rank import single_rank_model
    from moe_sft.models import qwen3_moe

    torch.manual_seed(0)
    model = single_rank_model(qwen3_moe.FAMILY, qwen3_moe.tiny_hf_config(vocab_size=VOCAB))
    batches = [build_micro_batch(_weighted_docs(1, (30, 17))), build_micro_batch(_weighted_docs(2, (50,)), pad_to=64)]
    _assert_same(_losses_and_grads(model, batches, False), _losses_and_grads(model, batches, True))


def test_deepseek_v3_with_mtp_trains_the_same_on_the_picked_rows(tmp_path):
    from moe_sft.conversion.export import load_model_from_checkpoint
    from tests.deepseek_mtp import converted_tiny_deepseek_with_mtp

    _, _, ckpt = converted_tiny_deepseek_with_mtp(tmp_path, VOCAB)
    model = load_model_from_checkpoint(ckpt / "mcore").train()
    model.run_mtp = True
    batches = random_batches(VOCAB, (24, 31, 5), micro_batches=2)
    full, picked = _losses_and_grads(model, batches, False, 0.3), _losses_and_grads(model, batches, True, 0.3)
    assert full[0][2] > 0  # the MTP term is there
    _assert_same(full, picked)
