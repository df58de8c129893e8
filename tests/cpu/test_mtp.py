"""DeepSeek-V3 multi-token prediction: converted, run, trained and exported with nothing lost.

fp32 CPU, tiny config with one MTP layer. The reference MTP forward is built from HF's own
DeepseekV3 decoder-layer and norm modules (tests/deepseek_mtp.py).
"""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from moe_sft.conversion import mapping
from moe_sft.conversion.convert import convert
from moe_sft.conversion.export import export, load_model_from_checkpoint
from moe_sft.models import registry
from moe_sft.models.forward import packed_batch
from tests.cpu.test_families import PARITY_TOL, _all_tensors
from tests.deepseek_mtp import converted_tiny_deepseek_with_mtp, reference_logits, write_tiny_deepseek_with_mtp
from tests.train_steps import PromptedDoc, adam_steps, random_batches

VOCAB = 300
DOC_LENGTHS = (19, 40, 7)


@pytest.fixture(scope="module")
def mtp_ckpt(tmp_path_factory):
    return converted_tiny_deepseek_with_mtp(tmp_path_factory.mktemp("mtp"), VOCAB)


def _docs():
    g = torch.Generator().manual_seed(3)
    return [torch.randint(0, VOCAB, (n,), generator=g).tolist() for n in DOC_LENGTHS]


def _packed_outputs(model, docs):
    """Per document: (main logits [T, V], MTP logits [T - 1, V]) from one packed forward."""
    tokens, positions, params = packed_batch(docs)
    out = model(input_ids=tokens, position_ids=positions, attention_mask=None, packed_seq_params=params)
    out = out[0, :, :VOCAB].float()
    total = tokens.shape[1]
    lengths = [len(d) for d in docs]
    main = torch.split(out[:total], lengths)
    mtp = torch.split(out[total:], lengths)
    return [(m, t[:-1]) for m, t in zip(main, mtp)]  # the last position has no t_{i+2}


def test_mtp_tensors_are_mapped_and_round_trip_bit_exactly(mtp_ckpt):
    hf, _, tmp = mtp_ckpt
    family = registry.family_by_name("deepseek_v3")
    on_disk = _all_tensors(tmp / "hf")
    names = [n for e in mapping.expand(family, hf.config) for n in e.hf]
    assert sorted(names) == sorted(on_disk)
    assert sum(n.startswith("model.layers.2.") for n in names) > 20  # the MTP layer is mapped
    export(tmp / "mcore", tmp / "out", dtype="fp32")
    after = _all_tensors(tmp / "out")
    assert set(after) == set(on_disk)
    assert all(torch.equal(on_disk[k], after[k]) for k in on_disk)


def test_mtp_logits_match_the_reference_with_packed_documents(mtp_ckpt):
    hf, ref, tmp = mtp_ckpt
    model = load_model_from_checkpoint(tmp / "mcore").eval()
    model.run_mtp = True
    docs = _docs()
    with torch.no_grad():
        ours = _packed_outputs(model, docs)
    refs = [reference_logits(hf, ref, d) for d in docs]
    main_diff = max((r[0] - o[0]).abs().max().item() for r, o in zip(refs, ours))
    mtp_diff = max((r[1] - o[1]).abs().max().item() for r, o in zip(refs, ours))
    print(f"deepseek_v3 MTP: main {main_diff:.3e}, mtp {mtp_diff:.3e} max abs logit diff")
    assert main_diff <= PARITY_TOL and mtp_diff <= PARITY_TOL, (main_diff, mtp_diff)
    model.run_mtp = False  # eval / verify: the main logits only
    with torch.no_grad():
        tokens, positions, params = packed_batch(docs)
        plain = model(input_ids=tokens, position_ids=positions, attention_mask=None, packed_seq_params=params)
    assert plain.shape[1] == tokens.shape[1]


def test_mtp_loss_term_is_weighted_and_normalised_like_the_main_loss(mtp_ckpt):
    """The reported losses equal CE of the reference logits under the global token count."""
    from moe_sft.data.packing import build_micro_batch
    from moe_sft.trainer.step import run_forward_backward

    hf, ref, tmp = mtp_ckpt
    docs = _docs()
    batch = build_micro_batch([PromptedDoc(d) for d in docs])
    tokens = int(batch.loss_mask.sum())
    model = load_model_from_checkpoint(tmp / "mcore").eval()
    model.run_mtp = True
    total = run_forward_backward(
        [model], [batch], tokens, "cpu", VOCAB, seq_length=0, forward_only=True, mtp_weight=0.3
    )
    main_sum = mtp_sum = 0.0
    for d in docs:
        main, mtp = reference_logits(hf, ref, d)
        assistant = torch.tensor([i >= 4 for i in range(len(d))])
        # main: position i predicts t_{i+1}, counted when t_{i+1} is an assistant token
        main_sum += (F.cross_entropy(main[:-1], torch.tensor(d[1:]), reduction="none") * assistant[1:]).sum().item()
        # MTP: position i predicts t_{i+2}, counted when t_{i+2} is an assistant token
        mtp_sum += (F.cross_entropy(mtp[:-1], torch.tensor(d[2:]), reduction="none") * assistant[2:]).sum().item()
    assert total[1].item() == tokens
    assert total[0].item() == pytest.approx(main_sum, rel=1e-5)
    assert total[2].item() == pytest.approx(mtp_sum, rel=1e-5)


def test_training_with_mtp_lowers_both_losses_and_updates_the_mtp_layer(mtp_ckpt):
    _, _, tmp = mtp_ckpt
    model = load_model_from_checkpoint(tmp / "mcore").train()
    model.run_mtp = True
    before = {k: v.clone() for k, v in model.state_dict().items() if k.startswith("mtp.") and torch.is_tensor(v)}

    def mtp_layer_gets_gradient(m):
        assert m.mtp.layers[0].eh_proj.weight.grad.abs().sum() > 0

    main, mtp = adam_steps(
        model,
        random_batches(VOCAB, (24, 31)),
        VOCAB,
        "cpu",
        steps=5,
        lr=3e-3,
        mtp_weight=0.3,
        after_backward=mtp_layer_gets_gradient,
    )
    assert main[-1] < main[0] - 0.5 and mtp[-1] < mtp[0] - 0.5, (main, mtp)
    after = model.state_dict()
    assert not torch.equal(before["mtp.layers.0.eh_proj.weight"], after["mtp.layers.0.eh_proj.weight"])


def test_mtp_copies_that_differ_name_the_tensors(tmp_path):
    from safetensors.torch import load_file, save_file

    hf, _ = write_tiny_deepseek_with_mtp(tmp_path / "hf", VOCAB)
    extra = load_file(str(tmp_path / "hf" / "mtp.safetensors"))
    extra["model.layers.2.embed_tokens.weight"] += 1.0
    save_file(extra, str(tmp_path / "hf" / "mtp.safetensors"))
    with pytest.raises(mapping.MappingError, match=r"model\.layers\.2\.embed_tokens\.weight.*copies"):
        convert(tmp_path / "hf", tmp_path / "mcore")


def test_full_recompute_with_mtp_and_packed_documents_gives_the_same_gradients(mtp_ckpt):
    """megatron-core 0.16.1 crashed here ("save_for_backward can only save variables": the MTP layer
    checkpointed its PackedSeqParams); runtime/megatron_fixes.py binds it outside the checkpoint."""
    _, _, tmp = mtp_ckpt
    docs = _docs()

    def grads(recompute: bool):
        model = load_model_from_checkpoint(tmp / "mcore").train()
        model.run_mtp = True
        if recompute:
            model.config.recompute_granularity, model.config.recompute_method = "full", "uniform"
            model.config.recompute_num_layers = 1
        loss = sum(m.square().mean() + t.square().mean() for m, t in _packed_outputs(model, docs))
        loss.backward()
        return {n: p.grad.clone() for n, p in model.named_parameters() if p.grad is not None}

    plain, recomputed = grads(False), grads(True)
    assert set(plain) == set(recomputed)
    assert any(n.startswith("mtp.") for n in plain)
    for name in plain:
        torch.testing.assert_close(recomputed[name], plain[name], rtol=1e-5, atol=1e-7, msg=name)


@pytest.mark.parametrize("lengths", [(5, 11, 3, 1), (20,), (4, 0, 9, 0, 7)])
@pytest.mark.parametrize("shape", ["[b, t]", "[t]", "[b, t] float"])
def test_sync_free_packed_roll_equals_megatron(lengths, shape):
    from megatron.core.packed_seq_params import PackedSeqParams

    from moe_sft.kernels import mtp_roll as mtp

    cu = torch.tensor((0, *torch.tensor(lengths).cumsum(0).tolist()), dtype=torch.int32)
    params = PackedSeqParams(qkv_format="thd", cu_seqlens_q=cu, cu_seqlens_kv=cu)
    tokens = int(cu[-1]) + 3  # three positions past the last document
    g = torch.Generator().manual_seed(len(lengths))
    t = torch.randint(1, 100, (tokens,), generator=g)
    t = {"[b, t]": t[None], "[t]": t, "[b, t] float": t[None].float().requires_grad_(True)}[shape]
    ours, ours_sum = mtp.roll_packed_left(t, -1, -1, params)
    ref, ref_sum = mtp._megatron_roll_packed(t, -1, -1, params)
    assert torch.equal(ours, ref) and torch.equal(ours_sum, ref_sum)
