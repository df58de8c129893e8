"""Multi-token prediction: converted, run, trained and exported with nothing lost.

fp32 CPU, tiny configs with one MTP layer, for every MTP layout: DeepSeek-V3's (`model.layers.{N}`;
reference from HF's own DeepseekV3 decoder-layer and norm modules, tests/deepseek_mtp.py) and the
Qwen3-Next / Qwen3.5 releases' (`mtp.*`; reference from transformers' Qwen3Next / Qwen3_5Moe
decoder layer and zero-centred RMSNorm with vLLM's fc / norm semantics, tests/qwen3_next_mtp.py).
GLM-4.5's layout is DeepSeek-V3's (tests/cpu/test_glm4_moe.py).
"""

from __future__ import annotations

import json
import random
from functools import partial

import pytest
import torch
import torch.nn.functional as F

from moe_sft.conversion import mapping
from moe_sft.conversion.convert import convert
from moe_sft.conversion.export import export, load_model_from_checkpoint
from moe_sft.models import registry
from moe_sft.models.family import UnsupportedConfigError
from moe_sft.models.forward import packed_batch
from tests import deepseek_mtp, qwen3_next_mtp
from tests.cpu.test_families import PARITY_TOL, _all_tensors
from tests.deepseek_mtp import write_tiny_deepseek_with_mtp
from tests.train_steps import PromptedDoc, adam_steps, random_batches

VOCAB = 300
DOC_LENGTHS = (19, 40, 7)

# family -> (write(path, vocab) -> (HF model, reference MTP), reference_logits(hf, ref, doc))
MTP_LAYOUTS = {
    "deepseek_v3": (write_tiny_deepseek_with_mtp, deepseek_mtp.reference_logits),
    "qwen3_next": (partial(qwen3_next_mtp.write_tiny_with_mtp, "qwen3_next"), qwen3_next_mtp.reference_logits),
    "qwen3_5_moe": (partial(qwen3_next_mtp.write_tiny_with_mtp, "qwen3_5_moe"), qwen3_next_mtp.reference_logits),
}


@pytest.fixture(scope="module", params=list(MTP_LAYOUTS))
def mtp_ckpt(request, tmp_path_factory):
    """(family, HF model, reference MTP, reference_logits, tmp): written to tmp/hf, converted to tmp/mcore."""
    write, reference = MTP_LAYOUTS[request.param]
    tmp = tmp_path_factory.mktemp(f"mtp_{request.param}")
    hf, ref = write(tmp / "hf", VOCAB)
    convert(tmp / "hf", tmp / "mcore")
    return registry.family_by_name(request.param), hf, ref, reference, tmp


def test_every_family_with_mtp_has_a_reference_test():
    """A family that converts MTP layers is checked against a reference MTP forward here (GLM-4.5's
    layout is DeepSeek-V3's, checked in test_glm4_moe.py; Kimi-K2 runs as DeepSeek-V3)."""
    with_mtp = {f.name for f in registry.FAMILIES if f.mtp_config_field}
    assert with_mtp - {"glm4_moe", "kimi_k2"} == set(MTP_LAYOUTS), with_mtp


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
    family, hf, _, _, tmp = mtp_ckpt
    on_disk = _all_tensors(tmp / "hf")
    entries = mapping.expand(family, hf.config)
    names = [n for e in entries for n in e.hf]
    assert sorted(names) == sorted(on_disk)
    mtp_names = {n for e in entries if e.mcore.startswith("mtp.") for n in e.hf}
    assert len(mtp_names) > 20  # the MTP layer with its experts is mapped
    if family.mtp_layer_hf_prefix:  # the release's names: the mtp.* file holds them all, nothing else
        assert mtp_names == set(_all_tensors_of(tmp / "hf" / "mtp.safetensors"))
    export(tmp / "mcore", tmp / "out", dtype="fp32")
    after = _all_tensors(tmp / "out")
    assert set(after) == set(on_disk)
    assert all(torch.equal(on_disk[k], after[k]) for k in on_disk)
    field = family.mtp_config_field
    assert json.loads((tmp / "out" / "config.json").read_text())[field] == 1


def _all_tensors_of(path):
    from safetensors.torch import load_file

    return load_file(str(path))


def _parity(family, hf, ref, reference_logits, tmp, label: str):
    model = load_model_from_checkpoint(tmp / "mcore").eval()
    model.run_mtp = True
    docs = _docs()
    with torch.no_grad():
        ours = _packed_outputs(model, docs)
    refs = [reference_logits(hf, ref, d) for d in docs]
    main_diff = max((r[0] - o[0]).abs().max().item() for r, o in zip(refs, ours))
    mtp_diff = max((r[1] - o[1]).abs().max().item() for r, o in zip(refs, ours))
    print(f"{label} MTP: main {main_diff:.3e}, mtp {mtp_diff:.3e} max abs logit diff")
    assert main_diff <= PARITY_TOL and mtp_diff <= PARITY_TOL, (main_diff, mtp_diff)
    return model, docs


def test_mtp_logits_match_the_reference_with_packed_documents(mtp_ckpt):
    family, hf, ref, reference_logits, tmp = mtp_ckpt
    model, docs = _parity(family, hf, ref, reference_logits, tmp, family.name)
    model.run_mtp = False  # eval / verify: the main logits only
    with torch.no_grad():
        tokens, positions, params = packed_batch(docs)
        plain = model(input_ids=tokens, position_ids=positions, attention_mask=None, packed_seq_params=params)
    assert plain.shape[1] == tokens.shape[1]


def _sampled_with_mtp(family, seed: int):
    """A sampled config of the family's space that may carry the release's MTP layer: every layer
    MoE (qwen3_next._check_mtp); odd seeds end the stack with a Gated DeltaNet layer, so the MTP
    layer (gated full attention) differs from the last decoder layer's mixer."""
    cfg = family.sample_hf_config(random.Random(seed), VOCAB)
    if hasattr(cfg, "decoder_sparse_step"):
        cfg.decoder_sparse_step, cfg.mlp_only_layers = 1, []
    if seed % 2:
        cfg.layer_types = [*cfg.layer_types[:-1], "linear_attention"]
    return cfg


@pytest.mark.parametrize("seed", [0, 1, 2])
@pytest.mark.parametrize("name", ["qwen3_next", "qwen3_5_moe"])
def test_mtp_logits_match_the_reference_on_sampled_configs(name, seed, tmp_path):
    from megatron.core.transformer.attention import SelfAttention

    family = registry.family_by_name(name)
    cfg = _sampled_with_mtp(family, seed)
    hf, ref = qwen3_next_mtp.write_tiny_with_mtp(name, tmp_path / "hf", VOCAB, cfg=cfg, seed=seed)
    convert(tmp_path / "hf", tmp_path / "mcore")
    model, _ = _parity(family, hf, ref, qwen3_next_mtp.reference_logits, tmp_path, f"{name} seed {seed}")
    attention = model.mtp.layers[0].transformer_layer.self_attention
    assert isinstance(attention, SelfAttention) and attention.config.attention_output_gate
    last = model.decoder.layers[-1].self_attention
    assert isinstance(last, SelfAttention) != (cfg.layer_types[-1] == "linear_attention")


@pytest.mark.parametrize("name", ["qwen3_next", "qwen3_5_moe"])
def test_mtp_layouts_megatron_cannot_hold_are_refused_by_name(name):
    family = registry.family_by_name(name)
    with pytest.raises(UnsupportedConfigError, match="mtp_num_hidden_layers=2"):
        family.check_supported(family.tiny_hf_config(vocab_size=VOCAB, mtp_num_hidden_layers=2))
    if name == "qwen3_next":  # Qwen3.5 has no dense layers
        cfg = family.tiny_hf_config(vocab_size=VOCAB, mtp_num_hidden_layers=1, decoder_sparse_step=2)
        with pytest.raises(UnsupportedConfigError, match="decoder_sparse_step=2"):
            family.check_supported(cfg)
        family.check_supported(family.tiny_hf_config(vocab_size=VOCAB, decoder_sparse_step=2))  # fine without MTP


def test_mtp_loss_term_is_weighted_and_normalised_like_the_main_loss(mtp_ckpt):
    """The reported losses equal CE of the reference logits under the global token count."""
    from moe_sft.data.packing import build_micro_batch
    from moe_sft.trainer.step import run_forward_backward

    _, hf, ref, reference_logits, tmp = mtp_ckpt
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
    *_, tmp = mtp_ckpt
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
    *_, tmp = mtp_ckpt
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
