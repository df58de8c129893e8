"""GLM-4.5 (glm4_moe) beyond the registry-driven tests (test_families.py, test_config_space.py):
partial RoPE at several factors, qk-norm and q/k/v biases on and off, the MTP layer (released
layout: converted, round trip bit-exact, MTP logits against a reference), an FP8 block-quantised
source, the pure shape of the released configs, and config fields refused by name."""

from __future__ import annotations

import json

import pytest
import torch
from safetensors.torch import load_file, save_file

from moe_sft.conversion import fp8, mapping, mcore_io, parity
from moe_sft.conversion.convert import convert
from moe_sft.conversion.export import export, load_model_from_checkpoint
from moe_sft.conversion.hf_source import prepare
from moe_sft.conversion.single_rank import single_rank_model
from moe_sft.models import glm4_moe
from moe_sft.models.family import UnsupportedConfigError
from tests.cpu.test_families import PARITY_TOL, _all_tensors
from tests.cpu.test_mtp import _packed_outputs
from tests.glm4_moe_mtp import reference_logits, write_tiny_glm4_moe_with_mtp

FAMILY = glm4_moe.FAMILY
VOCAB = 300


def _check(tmp_path, cfg, seed=0):
    FAMILY.check_supported(cfg)
    result = parity.check_config(FAMILY, cfg, seed, tmp_path)
    print(f"glm4_moe: max abs logit diff {result.max_logit_diff:.3e} {result.details}")
    assert result.passed, (result.error, result.max_logit_diff, result.details)


@pytest.mark.parametrize("head_dim,factor", [(32, 0.25), (32, 0.75), (32, 1.0), (24, 0.6), (48, 0.5)])
def test_partial_rotary_matches_transformers(tmp_path, head_dim, factor):
    """Rotate-half over the first int(head_dim * factor) dims, the rest passed through (24 x 0.6
    truncates to 14); documents long enough for the rotary positions to matter."""
    rope = {"rope_type": "default", "rope_theta": 10000.0, "partial_rotary_factor": factor}
    cfg = glm4_moe.tiny_hf_config(vocab_size=301, head_dim=head_dim, rope_parameters=rope)
    assert glm4_moe.gpt_model_kwargs(cfg)["rotary_percent"] == factor
    _check(tmp_path, cfg)


def test_wrong_rotary_dims_are_caught(tmp_path):
    """The check above fails when megatron rotates the whole head (the factor ignored)."""
    cfg = glm4_moe.tiny_hf_config(vocab_size=301, rope_parameters={"rope_type": "default", "rope_theta": 1e4})
    model = parity.perturbed_hf_model(FAMILY, cfg, seed=0)
    with parity.cpu_compat.suspended():
        model.save_pretrained(str(tmp_path / "hf"))
    convert(tmp_path / "hf", tmp_path / "mcore")
    full = load_model_from_checkpoint(tmp_path / "mcore").eval()
    docs = [list(range(3, 90))]
    with parity.cpu_compat.suspended(), torch.no_grad():
        ref = model(torch.tensor(docs)).logits[0]
    from moe_sft.models.forward import packed_logits

    assert (packed_logits(full, docs, 301)[0] - ref).abs().max().item() <= PARITY_TOL
    cfg_full = glm4_moe.tiny_hf_config(
        vocab_size=301, rope_parameters={"rope_type": "default", "rope_theta": 1e4, "partial_rotary_factor": 1.0}
    )
    with parity.cpu_compat.suspended(), torch.no_grad():
        other = FAMILY.hf_model_class(cfg_full).eval()
        other.load_state_dict(model.state_dict())
        assert (other(torch.tensor(docs)).logits[0] - ref).abs().max().item() > 100 * PARITY_TOL


@pytest.mark.parametrize("qk_norm,bias", [(False, False), (True, False), (False, True)])
def test_qk_norm_and_biases_on_and_off(tmp_path, qk_norm, bias):
    """(True, True) is the tiny config of test_families.py; GLM-4.5-Air is (False, True)."""
    _check(tmp_path, glm4_moe.tiny_hf_config(vocab_size=301, use_qk_norm=qk_norm, attention_bias=bias))


def test_released_routing_shapes(tmp_path):
    """GLM-4.5's router: one group, top-8 of many, scaled 2.5, no shared-expert-free variant."""
    _check(
        tmp_path,
        glm4_moe.tiny_hf_config(
            vocab_size=301, n_routed_experts=16, num_experts_per_tok=8, n_group=1, topk_group=1, n_shared_experts=2
        ),
    )


# ----------------------------------------------------------------------------- MTP


@pytest.fixture(scope="module")
def mtp_ckpt(tmp_path_factory):
    tmp = tmp_path_factory.mktemp("glm_mtp")
    hf, ref = write_tiny_glm4_moe_with_mtp(tmp / "hf", VOCAB)
    convert(tmp / "hf", tmp / "mcore")
    return hf, ref, tmp


def test_mtp_layer_in_the_released_layout_round_trips_bit_exactly(mtp_ckpt):
    hf, _, tmp = mtp_ckpt
    on_disk = _all_tensors(tmp / "hf")
    names = [n for e in mapping.expand(FAMILY, hf.config) for n in e.hf]
    assert sorted(names) == sorted(on_disk)
    mtp = {n for n in names if n.startswith("model.layers.2.")}
    for released in ("enorm", "hnorm", "eh_proj", "shared_head.norm", "shared_head.head", "embed_tokens"):
        assert f"model.layers.2.{released}.weight" in mtp
    assert "model.layers.2.self_attn.q_proj.bias" in mtp and "model.layers.2.mlp.experts.7.down_proj.weight" in mtp
    export(tmp / "mcore", tmp / "out", dtype="fp32")
    after = _all_tensors(tmp / "out")
    assert set(after) == set(on_disk)
    assert all(torch.equal(on_disk[k], after[k]) for k in on_disk)
    assert json.loads((tmp / "out" / "config.json").read_text())["num_nextn_predict_layers"] == 1


def test_mtp_logits_match_the_reference_with_packed_documents(mtp_ckpt):
    hf, ref, tmp = mtp_ckpt
    model = load_model_from_checkpoint(tmp / "mcore").eval()
    model.run_mtp = True
    g = torch.Generator().manual_seed(3)
    docs = [torch.randint(0, VOCAB, (n,), generator=g).tolist() for n in (19, 40, 7)]
    with torch.no_grad():
        ours = _packed_outputs(model, docs)
    refs = [reference_logits(hf, ref, d) for d in docs]
    main_diff = max((r[0] - o[0]).abs().max().item() for r, o in zip(refs, ours))
    mtp_diff = max((r[1] - o[1]).abs().max().item() for r, o in zip(refs, ours))
    print(f"glm4_moe MTP: main {main_diff:.3e}, mtp {mtp_diff:.3e} max abs logit diff")
    assert main_diff <= PARITY_TOL and mtp_diff <= PARITY_TOL, (main_diff, mtp_diff)


# GLM-4.6's release stores its MTP layer without the copies of the embedding and the LM head that
# GLM-4.5 and DeepSeek-V3 carry (llama.cpp issue #16359): they hold nothing, megatron's MTP uses
# the main ones, so conversion accepts their absence and the export writes back what was stored.
EMBED_COPY, HEAD_COPY = "model.layers.2.embed_tokens.weight", "model.layers.2.shared_head.head.weight"


def _without(src, dst, names) -> None:
    """A copy of the checkpoint `src` with the HF tensors `names` deleted from its shards."""
    dst.mkdir()
    for f in src.iterdir():
        if f.suffix == ".safetensors":
            save_file({k: v for k, v in load_file(str(f)).items() if k not in names}, str(dst / f.name))
        elif f.is_file():
            (dst / f.name).write_bytes(f.read_bytes())


@pytest.mark.parametrize("absent", [(EMBED_COPY, HEAD_COPY), (EMBED_COPY,)], ids=["glm_4_6", "embed_copy_only"])
def test_mtp_layer_without_the_embedding_and_head_copies(mtp_ckpt, tmp_path, absent):
    hf, ref, tmp = mtp_ckpt
    _without(tmp / "hf", tmp_path / "hf", absent)
    source = _all_tensors(tmp_path / "hf")
    meta = convert(tmp_path / "hf", tmp_path / "mcore", max_chunk_bytes=2048)  # rows streamed in pieces
    assert meta[mcore_io.COPIES_ABSENT] == sorted(absent)
    assert mcore_io.read_meta(tmp_path / "mcore")[mcore_io.COPIES_ABSENT] == sorted(absent)
    model = load_model_from_checkpoint(tmp_path / "mcore").eval()
    with_copies = load_model_from_checkpoint(tmp / "mcore").state_dict()
    assert all(torch.equal(v, with_copies[k]) for k, v in model.state_dict().items() if isinstance(v, torch.Tensor))
    # the single-rank (in-memory) converter reads the same entries
    job = prepare(tmp_path / "hf")
    try:
        single = single_rank_model(job.family, job.hf_cfg, job.precision)
        mapping.load_hf_into_state(job.entries, job.reader.get, job.ctx, single.state_dict())
    finally:
        job.reader.close()
    assert all(torch.equal(v, with_copies[k]) for k, v in single.state_dict().items() if isinstance(v, torch.Tensor))
    model.run_mtp = True
    g = torch.Generator().manual_seed(3)
    docs = [torch.randint(0, VOCAB, (n,), generator=g).tolist() for n in (19, 40, 7)]
    with torch.no_grad():
        ours = _packed_outputs(model, docs)
    refs = [reference_logits(hf, ref, d) for d in docs]
    main_diff = max((r[0] - o[0]).abs().max().item() for r, o in zip(refs, ours))
    mtp_diff = max((r[1] - o[1]).abs().max().item() for r, o in zip(refs, ours))
    assert main_diff <= PARITY_TOL and mtp_diff <= PARITY_TOL, (main_diff, mtp_diff)
    export(tmp_path / "mcore", tmp_path / "out", dtype="fp32", read_bytes=4096)
    after = _all_tensors(tmp_path / "out")
    assert set(after) == set(source) and not set(absent) & set(after)
    assert all(torch.equal(source[k], after[k]) for k in source)


def test_copies_absent_per_mtp_layer():
    """With two MTP layers, each layer's copies are left out or kept on their own."""
    cfg = glm4_moe.tiny_hf_config(vocab_size=VOCAB, num_nextn_predict_layers=2)
    entries = mapping.expand(FAMILY, cfg)
    absent = ["model.layers.3.embed_tokens.weight", "model.layers.2.shared_head.head.weight"]
    kept = {e.mcore: e for e in mapping.without_copies(entries, absent)}
    embed, head = kept["embedding.word_embeddings.weight"], kept["output_layer.weight"]
    assert embed.hf == ("model.embed_tokens.weight", "model.layers.2.embed_tokens.weight")
    assert head.hf == ("lm_head.weight", "model.layers.3.shared_head.head.weight")
    ctx = mapping.transform_context(FAMILY, cfg)
    weight = torch.randn(ctx["padded_vocab_size"], cfg.hidden_size)
    assert all(torch.equal(t, weight[:VOCAB]) for t in embed.transform.to_hf(weight, ctx))
    assert len(embed.transform.to_hf(weight, ctx)) == 2
    assert mapping.absent_copies(entries, {n for e in entries for n in e.hf} - set(absent)) == sorted(absent)
    # only copies: a missing main tensor or MTP module stays in, for the completeness gate
    assert mapping.without_copies(entries, ["lm_head.weight", "model.layers.2.eh_proj.weight"]) == entries


def test_mtp_layer_missing_a_module_tensor_is_refused_by_name(mtp_ckpt, tmp_path):
    _, _, tmp = mtp_ckpt
    _without(tmp / "hf", tmp_path / "hf", (EMBED_COPY, HEAD_COPY, "model.layers.2.eh_proj.weight"))
    with pytest.raises(mapping.MappingError, match=r"lacks 1 tensor\(s\).*model\.layers\.2\.eh_proj\.weight"):
        convert(tmp_path / "hf", tmp_path / "mcore")


# ----------------------------------------------------------------------------- FP8


def test_fp8_block_quantised_source_converts_dequantised(tmp_path):
    """As GLM-4.5-FP8 / DeepSeek-V3: 2-D projection weights (MTP layer's too) in e4m3 with
    128x128 `weight_scale_inv` blocks; conversion dequantises while streaming, export writes bf16."""
    write_tiny_glm4_moe_with_mtp(tmp_path / "bf16", VOCAB)
    (tmp_path / "fp8").mkdir()
    expected = {}
    for f in (tmp_path / "bf16").glob("*.safetensors"):
        quantised = {}
        for name, t in load_file(str(f)).items():
            t = t.to(torch.bfloat16)
            if t.dim() == 2 and "proj" in name:
                q, s = fp8.quantize_blocks(t)
                quantised[name], quantised[fp8.scale_name(name)] = q, s
                expected[name] = fp8.dequantize_blocks(q, s)
            else:
                quantised[name] = expected[name] = t
        save_file(quantised, str(tmp_path / "fp8" / f.name))
    config = json.loads((tmp_path / "bf16" / "config.json").read_text())
    config["quantization_config"] = {"quant_method": "fp8", "fmt": "e4m3", "weight_block_size": [128, 128]}
    (tmp_path / "fp8" / "config.json").write_text(json.dumps(config))
    convert(tmp_path / "fp8", tmp_path / "mcore")
    export(tmp_path / "mcore", tmp_path / "out", dtype="bf16")
    out = _all_tensors(tmp_path / "out")
    assert not any(n.endswith(fp8.SCALE_SUFFIX) for n in out) and set(out) == set(expected)
    assert any(n.startswith("model.layers.2.") and "proj" in n for n in expected)  # the MTP layer too
    assert all(torch.equal(out[n], expected[n]) for n in expected), "dequantised weights changed"
    assert "quantization_config" not in json.loads((tmp_path / "out" / "config.json").read_text())


# ----------------------------------------------------------------------------- shape and refusals

GLM_4_5 = {  # zai-org/GLM-4.5 config.json (the fields shape() reads)
    "model_type": "glm4_moe",
    "hidden_size": 5120,
    "num_hidden_layers": 92,
    "num_attention_heads": 96,
    "num_key_value_heads": 8,
    "head_dim": 128,
    "intermediate_size": 12288,
    "moe_intermediate_size": 1536,
    "n_routed_experts": 160,
    "n_shared_experts": 1,
    "num_experts_per_tok": 8,
    "first_k_dense_replace": 3,
    "num_nextn_predict_layers": 1,
    "use_qk_norm": True,
    "vocab_size": 151552,
    "tie_word_embeddings": False,
    "partial_rotary_factor": 0.5,
}


def test_shape_of_the_released_config_json():
    s = glm4_moe.shape(GLM_4_5, "GLM-4.5")
    assert (s.num_layers, sum(s.moe_layers), s.head_dim, s.num_kv_heads, s.mtp_layers) == (92, 89, 128, 8, 1)
    assert s.shared_ffn == 1536 and s.qk_norm
    air = glm4_moe.shape(dict(GLM_4_5, num_hidden_layers=46, first_k_dense_replace=1, use_qk_norm=False))
    assert sum(air.moe_layers) == 45 and not air.qk_norm


@pytest.mark.parametrize(
    "overrides,field",
    [
        ({"hidden_act": "gelu"}, "hidden_act"),
        ({"rope_parameters": {"rope_type": "linear", "rope_theta": 1e4, "factor": 2.0}}, "rope_type"),
        (
            {"rope_parameters": {"rope_type": "default", "rope_theta": 1e4, "partial_rotary_factor": 0.3}},
            "partial_rotary_factor",
        ),
        ({"head_dim": 3, "rope_parameters": {"rope_type": "default", "rope_theta": 1e4}}, "partial_rotary_factor"),
        ({"num_key_value_heads": 3}, "num_key_value_heads"),
        ({"n_group": 3}, "n_group"),
        ({"n_group": 8, "topk_group": 1, "num_experts_per_tok": 1}, "n_group"),
        ({"topk_group": 4}, "topk_group"),
        ({"num_nextn_predict_layers": 1, "tie_word_embeddings": True}, "tie_word_embeddings"),
        ({"num_nextn_predict_layers": 1, "first_k_dense_replace": 2}, "first_k_dense_replace"),
    ],
)
def test_unsupported_fields_are_refused_by_name(overrides, field):
    with pytest.raises(UnsupportedConfigError, match=field):
        FAMILY.check_supported(glm4_moe.tiny_hf_config(vocab_size=301, **overrides))


def test_conversion_refuses_before_reading_any_shard(tmp_path):
    cfg = glm4_moe.tiny_hf_config(vocab_size=301, hidden_act="gelu")
    cfg.save_pretrained(str(tmp_path))
    (tmp_path / "model.safetensors").write_bytes(b"not a safetensors file")
    with pytest.raises(UnsupportedConfigError, match="hidden_act='gelu'"):
        convert(tmp_path, tmp_path / "mcore")


def test_experts_given_no_token_keep_weights_and_probs_in_the_graph(mtp_ckpt):
    """GLM's expert bias leaves an EP rank's experts without tokens for whole micro-batches. That
    rank must still run the backward of the probs' all-gather (a collective): without the probs
    in its graph, EP2 deadlocked on gloo (tests/dist/test_family_layouts.py)."""
    _, _, tmp = mtp_ckpt
    model = load_model_from_checkpoint(tmp / "mcore").train()
    experts = model.decoder.layers[1].mlp.experts
    x = torch.zeros(0, experts.config.hidden_size, requires_grad=True)
    probs = torch.zeros(0, requires_grad=True)
    out, _ = experts(x, torch.zeros(experts.num_local_experts, dtype=torch.long), probs)
    out.sum().backward()
    assert out.shape == (0, experts.config.hidden_size)
    assert probs.grad is not None and x.grad is not None
    assert experts.weight1.grad is not None and experts.weight2.grad is not None
