"""The training step's loss normalisation and the padded-vocab masking, against direct autograd.

Two micro-batches with very different assistant-token counts: megatron's schedule + our scale
must give the gradient of Σ token losses / (assistant tokens of the global batch), which differs
from the mean of per-micro-batch means."""

from __future__ import annotations

import pytest
import torch

from moe_sft.data.packing import build_micro_batch
from moe_sft.models import qwen3_moe


class _Doc:
    def __init__(self, ids, mask):
        self.input_ids, self.assistant_mask = ids, mask


@pytest.fixture(scope="module")
def model_and_batches():
    from moe_sft.conversion.single_rank import single_rank_model

    torch.manual_seed(0)
    hf_cfg = qwen3_moe.tiny_hf_config(vocab_size=300)  # padded to 384: masking is exercised
    model = single_rank_model(qwen3_moe.FAMILY, hf_cfg)
    g = torch.Generator().manual_seed(1)

    def doc(n, loss_from):
        return _Doc(torch.randint(0, 300, (n,), generator=g).tolist(), [i >= loss_from for i in range(n)])

    mb_small = build_micro_batch([doc(20, 17)])  # 2 loss tokens
    mb_large = build_micro_batch([doc(30, 5), doc(25, 1)])  # 25 + 24 loss tokens
    return model, hf_cfg, [mb_small, mb_large]


def _grads(model):
    return torch.cat([p.grad.flatten() if p.grad is not None else torch.zeros(p.numel()) for p in model.parameters()])


def _reference_loss(model, batches, vocab_size, per_microbatch_mean=False):
    from moe_sft.models.forward import packed_seq_params

    total, count = 0.0, sum(int(b.loss_mask.sum()) for b in batches)
    for b in batches:
        logits = model(
            input_ids=b.tokens[None],
            position_ids=b.position_ids[None],
            attention_mask=None,
            packed_seq_params=packed_seq_params(b.cu_seqlens, b.max_seqlen),
        )[0, :, :vocab_size]
        token_losses = torch.nn.functional.cross_entropy(logits.float(), b.labels, reduction="none")
        summed = (token_losses * b.loss_mask).sum()
        total = total + (summed / b.loss_mask.sum() / len(batches) if per_microbatch_mean else summed / count)
    return total


def test_gradient_is_that_of_the_global_token_mean(model_and_batches):
    from moe_sft.trainer.step import run_forward_backward

    model, hf_cfg, batches = model_and_batches
    model.config.moe_aux_loss_coeff = 0.0  # compare the LM loss alone
    global_tokens = sum(int(b.loss_mask.sum()) for b in batches)
    model.zero_grad(set_to_none=True)
    totals = run_forward_backward([model], batches, global_tokens, "cpu", hf_cfg.vocab_size, seq_length=0)
    ours = _grads(model).clone()

    model.zero_grad(set_to_none=True)
    ref_loss = _reference_loss(model, batches, hf_cfg.vocab_size)
    ref_loss.backward()
    reference = _grads(model).clone()

    model.zero_grad(set_to_none=True)
    _reference_loss(model, batches, hf_cfg.vocab_size, per_microbatch_mean=True).backward()
    mean_of_means = _grads(model).clone()

    assert totals[1].item() == global_tokens == 3 + 25 + 24  # shifted assistant tokens per doc
    assert (totals[0] / totals[1]).item() == pytest.approx(ref_loss.item(), rel=1e-5)
    assert torch.allclose(ours, reference, rtol=1e-4, atol=1e-7)  # measured: equal to ~1e-7
    assert not torch.allclose(ours, mean_of_means, rtol=1e-2, atol=1e-5)


def test_padded_vocab_columns_take_no_probability(model_and_batches):
    from moe_sft.trainer.step import masked_token_losses

    _, _, _ = model_and_batches  # parallel state initialised
    logits = torch.randn(1, 5, 384)
    labels = torch.randint(0, 300, (1, 5))
    ours = masked_token_losses(logits, labels, vocab_size=300)
    expected = torch.nn.functional.cross_entropy(logits[0, :, :300], labels[0], reduction="none")
    assert torch.allclose(ours[0], expected, atol=1e-5)


def test_padding_is_kept_out_of_routing_and_aux_loss(model_and_batches):
    """Padding a micro-batch (PP / allgather EP need one shape) must not change any gradient:
    without megatron's padding_mask the padding tokens were routed and moved the aux loss."""
    from moe_sft.trainer.step import run_forward_backward

    model, hf_cfg, _ = model_and_batches
    model.config.moe_aux_loss_coeff = 0.01  # the aux loss is what padding used to disturb
    g = torch.Generator().manual_seed(2)
    docs = [_Doc(torch.randint(0, 300, (n,), generator=g).tolist(), [i >= 3 for i in range(n)]) for n in (40, 23)]
    grads = []
    for pad_to in (1, 128):
        batch = build_micro_batch(docs, pad_to=pad_to)
        assert batch.num_padding == (0 if pad_to == 1 else 128 - 63)
        model.zero_grad(set_to_none=True)
        run_forward_backward([model], [batch], batch.num_loss_tokens, "cpu", hf_cfg.vocab_size, seq_length=0)
        grads.append(_grads(model).clone())
    assert torch.allclose(grads[0], grads[1], rtol=1e-4, atol=1e-7)


def test_float_loss_weights_are_normalised_by_their_sum(model_and_batches):
    """Per-message weights reach the loss as a float weight per token: loss = Σ w·CE / Σ w, also when
    Σ w < 1 (a clamp of the normaliser at 1, right for token counts, would be wrong here)."""
    from moe_sft.data.chat import TokenizedDoc
    from moe_sft.trainer.step import run_forward_backward

    model, hf_cfg, _ = model_and_batches
    model.config.moe_aux_loss_coeff = 0.0
    g = torch.Generator().manual_seed(3)
    ids = [torch.randint(0, 300, (n,), generator=g).tolist() for n in (24, 17)]
    docs = [TokenizedDoc(ids[0], [0.0] * 10 + [0.02] * 8 + [0.05] * 6), TokenizedDoc(ids[1], [0.0] * 9 + [0.01] * 8)]
    batch = build_micro_batch(docs)
    weight = batch.loss_weight_sum
    assert weight == pytest.approx(0.02 * 8 + 0.05 * 6 + 0.01 * 8) and weight < 1  # labels shifted: w[1:]
    model.zero_grad(set_to_none=True)
    totals = run_forward_backward([model], [batch], weight, "cpu", hf_cfg.vocab_size, seq_length=0)
    ours = _grads(model).clone()
    model.zero_grad(set_to_none=True)
    from moe_sft.models.forward import packed_seq_params

    logits = model(
        input_ids=batch.tokens[None],
        position_ids=batch.position_ids[None],
        attention_mask=None,
        packed_seq_params=packed_seq_params(batch.cu_seqlens, batch.max_seqlen),
    )[0, :, : hf_cfg.vocab_size]
    ce = torch.nn.functional.cross_entropy(logits.float(), batch.labels, reduction="none")
    ref = (ce * batch.loss_mask).sum() / batch.loss_mask.sum()
    ref.backward()
    assert (totals[0] / totals[1]).item() == pytest.approx(ref.item(), rel=1e-5)
    assert torch.allclose(ours, _grads(model), rtol=1e-4, atol=1e-7)


def test_per_document_padding_changes_no_gradient(model_and_batches):
    """Context parallelism pads every document to a multiple of 2*CP*TP; the padding sits inside the
    documents' segments, so it is masked out of routing and the loss wherever it is."""
    from moe_sft.trainer.step import run_forward_backward

    model, hf_cfg, _ = model_and_batches
    model.config.moe_aux_loss_coeff = 0.01
    g = torch.Generator().manual_seed(4)
    docs = [_Doc(torch.randint(0, 300, (n,), generator=g).tolist(), [i >= 3 for i in range(n)]) for n in (21, 30, 9)]
    grads = []
    for doc_multiple in (1, 8):
        batch = build_micro_batch(docs, pad_to=16, doc_multiple=doc_multiple)
        assert batch.num_padding == (4 if doc_multiple == 1 else 3 + 2 + 7 + 8)  # 24 + 32 + 16 -> 80
        model.zero_grad(set_to_none=True)
        run_forward_backward([model], [batch], batch.loss_weight_sum, "cpu", hf_cfg.vocab_size, seq_length=0)
        grads.append(_grads(model).clone())
    assert torch.allclose(grads[0], grads[1], rtol=1e-4, atol=1e-7)
