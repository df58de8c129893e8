"""FP8 block-quantised checkpoints are dequantised while streaming, exactly as DeepSeek-V3's
reference `weight_dequant` does; missing scales are an error naming the file and tensor.

The FP8 checkpoint is made in the test: a tiny random model whose 2-D projection weights are
block-quantised (128x128 blocks, e4m3) with `*_scale_inv` tensors beside them."""

from __future__ import annotations

import json

import pytest
import torch
from safetensors.torch import load_file, save_file

from moe_sft.conversion import fp8
from moe_sft.conversion.convert import convert
from moe_sft.conversion.export import export
from moe_sft.conversion.hf_reader import CheckpointError
from moe_sft.models import qwen3_moe
from moe_sft.runtime import cpu_compat
from tests.safe_open_reader import SafeOpenHFReader


def _reference_dequant(weight, scale_inv, block=128):
    """Blockwise loop, independent of fp8.dequantize_blocks' vectorised form."""
    out = torch.empty(weight.shape, dtype=torch.float32)
    for i in range(scale_inv.shape[0]):
        for j in range(scale_inv.shape[1]):
            rows, cols = slice(i * block, (i + 1) * block), slice(j * block, (j + 1) * block)
            out[rows, cols] = weight[rows, cols].float() * scale_inv[i, j]
    return out.to(torch.bfloat16)


@pytest.fixture(scope="module")
def fp8_checkpoint(tmp_path_factory):
    tmp = tmp_path_factory.mktemp("fp8")
    cfg = qwen3_moe.tiny_hf_config(vocab_size=300, num_hidden_layers=1)
    with cpu_compat.suspended():
        torch.manual_seed(0)
        qwen3_moe.FAMILY.hf_model_class(cfg).save_pretrained(str(tmp / "bf16"))
    tensors = load_file(str(tmp / "bf16" / "model.safetensors"))
    quantised, expected = {}, {}
    for name, t in tensors.items():
        if t.dim() == 2 and "proj" in name:  # attention + expert projections, like DeepSeek-V3
            q, s = fp8.quantize_blocks(t)
            quantised[name], quantised[fp8.scale_name(name)] = q, s
            expected[name] = _reference_dequant(q, s)
        else:
            quantised[name] = t
    (tmp / "fp8").mkdir()
    save_file(quantised, str(tmp / "fp8" / "model.safetensors"))
    config = json.loads((tmp / "bf16" / "config.json").read_text())
    config["quantization_config"] = {
        "quant_method": "fp8",
        "fmt": "e4m3",
        "weight_block_size": [128, 128],
        "activation_scheme": "dynamic",
    }
    (tmp / "fp8" / "config.json").write_text(json.dumps(config))
    return tmp, quantised, expected


def test_dequantize_matches_the_reference_on_partial_edge_blocks():
    w = torch.randn(300, 200)  # neither dim a multiple of 128
    q, s = fp8.quantize_blocks(w)
    assert s.shape == (3, 2)
    assert torch.equal(fp8.dequantize_blocks(q, s), _reference_dequant(q, s))
    # e4m3 keeps ~2 significant bits of mantissa: the round trip is close, not exact
    assert (fp8.dequantize_blocks(q, s, dtype=torch.float32) - w).abs().max() < 0.08 * w.abs().max()


def test_reader_hides_scales_and_dequantises(fp8_checkpoint):
    tmp, quantised, expected = fp8_checkpoint
    reader = SafeOpenHFReader(tmp / "fp8")
    assert not any(n.endswith("_scale_inv") for n in reader.names())
    name = "model.layers.0.mlp.experts.3.gate_proj.weight"  # one 128x128 block
    assert reader.get(name).dtype == torch.bfloat16
    assert torch.equal(reader.get(name), expected[name])


def test_fp8_checkpoint_converts_and_exports_dequantised_weights(fp8_checkpoint):
    tmp, _, expected = fp8_checkpoint
    convert(tmp / "fp8", tmp / "mcore")
    export(tmp / "mcore", tmp / "out", dtype="bf16")
    out = {}
    for f in (tmp / "out").glob("*.safetensors"):
        out.update(load_file(str(f)))
    assert not any(n.endswith("_scale_inv") for n in out)
    assert all(torch.equal(out[n], expected[n]) for n in expected), "dequantised weights changed"
    assert "quantization_config" not in json.loads((tmp / "out" / "config.json").read_text())


def test_missing_scale_names_file_and_tensor(fp8_checkpoint, tmp_path):
    tmp, quantised, _ = fp8_checkpoint
    victim = "model.layers.0.self_attn.q_proj.weight"
    broken = {k: v for k, v in quantised.items() if k != fp8.scale_name(victim)}
    save_file(broken, str(tmp_path / "model.safetensors"))
    (tmp_path / "config.json").write_text((tmp / "fp8" / "config.json").read_text())
    with pytest.raises(CheckpointError) as err:
        convert(tmp_path, tmp_path / "mcore")
    assert "model.safetensors" in str(err.value) and victim in str(err.value)
    assert "_scale_inv" in str(err.value)


# ------------------------------------------------------------------------------------------------
# --verify of an FP8 DeepSeek-V3: the reference holds the weights a correct conversion stores
# ------------------------------------------------------------------------------------------------


@pytest.fixture(scope="module")
def fp8_deepseek(tmp_path_factory):
    """A tiny DeepSeek-V3 whose projections are FP8 128x128 blocks (q_b_proj's 192 rows end in a
    partial block), converted; (dir, the FP8 tensors)."""
    from moe_sft.models import deepseek_v3

    tmp = tmp_path_factory.mktemp("fp8_ds")
    cfg = deepseek_v3.tiny_hf_config(vocab_size=300)
    with cpu_compat.suspended():
        torch.manual_seed(0)
        deepseek_v3.FAMILY.hf_model_class(cfg).to(torch.bfloat16).save_pretrained(str(tmp / "bf16"))
    quantised = {}
    for name, t in load_file(str(tmp / "bf16" / "model.safetensors")).items():
        if t.dim() == 2 and "proj" in name:  # attention, dense and expert projections, as released
            quantised[name], quantised[fp8.scale_name(name)] = fp8.quantize_blocks(t)
        else:
            quantised[name] = t
    _write_fp8(tmp / "fp8", quantised, tmp / "bf16" / "config.json")
    convert(tmp / "fp8", tmp / "mcore")
    return tmp, quantised


def _write_fp8(out, tensors, config_file):
    out.mkdir()
    save_file(tensors, str(out / "model.safetensors"))
    config = json.loads(config_file.read_text())
    config["quantization_config"] = {
        "quant_method": "fp8",
        "fmt": "e4m3",
        "weight_block_size": [128, 128],
        "activation_scheme": "dynamic",
    }
    (out / "config.json").write_text(json.dumps(config))


def test_verify_passes_a_correct_fp8_conversion(fp8_deepseek):
    """transformers' own CPU load of the FP8 checkpoint was the reference before: 2.6e-3 away."""
    from moe_sft.conversion.verify import LOGIT_TOLERANCE, verify

    tmp, _ = fp8_deepseek
    assert verify(tmp / "fp8", tmp / "mcore") <= LOGIT_TOLERANCE


def test_verify_still_fails_a_wrong_fp8_conversion(fp8_deepseek):
    """The shared expert's FP8 block scale 5% off in the source the checkpoint is compared with: the
    conversion no longer holds that source's weights, and verify says so."""
    from moe_sft.conversion.verify import LOGIT_TOLERANCE, verify

    tmp, quantised = fp8_deepseek
    victim = fp8.scale_name("model.layers.1.mlp.shared_experts.down_proj.weight")
    perturbed = dict(quantised, **{victim: quantised[victim] * 1.05})
    _write_fp8(tmp / "perturbed", perturbed, tmp / "bf16" / "config.json")
    assert verify(tmp / "perturbed", tmp / "mcore") > 100 * LOGIT_TOLERANCE
