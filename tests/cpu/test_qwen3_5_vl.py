"""Qwen3.5 vision-language checkpoints (`Qwen3_5MoeForConditionalGeneration`) for text SFT: the
language model is converted and trained, the vision tower carried through untouched and written
back, so the export loads as the VL class again (moe_sft/conversion/composite.py)."""

from __future__ import annotations

import contextlib
import io
import json
import shutil

import pytest
import torch
from safetensors.torch import save_file

from moe_sft.conversion import mcore_io
from moe_sft.conversion.convert import convert
from moe_sft.conversion.export import export, load_model_from_checkpoint
from moe_sft.conversion.hf_reader import CheckpointError
from moe_sft.conversion.mapping import MappingError
from moe_sft.conversion.verify import verify, verify_layers
from moe_sft.models import qwen3_5_moe, registry
from moe_sft.models.forward import packed_logits
from moe_sft.plan.shapes import shape_from_hf_dict
from moe_sft.runtime import cpu_compat
from tests.train_steps import adam_steps, random_batches
from tests.vl_checkpoints import DOCS, PARITY_TOL, load_vl, max_diff, tensors, text_logits

VOCAB = 300
VL = qwen3_5_moe.COMPOSITE.hf_model_class


@pytest.fixture(scope="module")
def vl(tmp_path_factory):
    """A tiny random VL source (one-block vision tower) and its conversion's log."""
    tmp = tmp_path_factory.mktemp("qwen3_5_vl")
    with cpu_compat.suspended():
        torch.manual_seed(0)
        VL(qwen3_5_moe.COMPOSITE.tiny_hf_config(vocab_size=VOCAB)).save_pretrained(str(tmp / "hf"))
    log = io.StringIO()
    with contextlib.redirect_stdout(log):  # the one logger writes to the current stdout
        convert(tmp / "hf", tmp / "mcore")
    return tmp, log.getvalue()


def test_conversion_names_the_vision_tensors_it_carries(vl):
    tmp, log = vl
    vision = [n for n in tensors(tmp / "hf") if n.startswith("model.visual.")]
    assert len(vision) > 10
    assert f"{len(vision)} vision tensors carried through, not trained" in log, log
    carried = tensors(tmp / "mcore" / mcore_io.HF_SUBDIR / mcore_io.CARRIED_DIR)
    assert sorted(carried) == sorted(vision)
    meta = mcore_io.read_meta(tmp / "mcore")
    assert meta["model_type"] == "qwen3_5_moe" and meta["carried_tensors"] == {"vision": len(vision)}
    assert mcore_io.checkpoint_problems(tmp / "mcore") == []  # vocab_size read from text_config


def test_the_language_model_is_the_text_family(vl):
    """Config and planner shape come from text_config; `--verify` (the VL model on text) and
    `--verify-layers` (its language model's layers) agree with the conversion."""
    tmp, _ = vl
    config = json.loads((tmp / "hf" / "config.json").read_text())
    family = registry.family_for_model_type(config["model_type"])
    assert family.name == "qwen3_5_moe"
    assert shape_from_hf_dict(config) == family.shape(config["text_config"])
    assert verify(tmp / "hf", tmp / "mcore") <= PARITY_TOL
    layers = verify_layers(tmp / "hf", tmp / "mcore", "all", tokens=48)
    assert len(layers) == config["text_config"]["num_hidden_layers"]
    assert all(r.max_abs_diff <= 1e-5 * max(r.scale, 1.0) for r in layers), layers


def test_round_trip_without_training_is_the_source(vl):
    """convert → export: every tensor bit-identical, the VL config back, transformers loads it whole."""
    tmp, _ = vl
    out = export(tmp / "mcore", tmp / "round_trip", dtype="fp32")
    before, after = tensors(tmp / "hf"), tensors(out)
    assert sorted(before) == sorted(after)
    assert all(torch.equal(before[k], after[k]) for k in before)
    index = json.loads((out / mcore_io.EXPORT_INDEX).read_text())
    assert sorted(index["weight_map"]) == sorted(before)
    source = json.loads((tmp / "hf" / "config.json").read_text())
    assert json.loads((out / "config.json").read_text()) == source  # fp32 source exported fp32
    assert not (out / mcore_io.CARRIED_DIR).exists()
    _, info = load_vl(VL, out)
    assert not info["missing_keys"] and not info["unexpected_keys"], info


def test_trained_on_text_exports_the_vl_model(vl):
    """A few Adam steps on text, saved as the trainer saves a checkpoint (its hf side files, the
    carried tensors with them), exported: the VL class loads it with no missing or unexpected key,
    the vision tower is the source's bit for bit, the language model is the trained one."""
    from megatron.core import dist_checkpointing

    from moe_sft.trainer.checkpoint import model_sharded_state

    tmp, _ = vl
    model = load_model_from_checkpoint(tmp / "mcore").train()
    losses, _ = adam_steps(model, random_batches(VOCAB, (24, 31)), VOCAB, "cpu", steps=3, lr=3e-3)
    assert losses[-1] < losses[0], losses
    ckpt = tmp / "run" / "checkpoints" / "step_0000003"
    ckpt.mkdir(parents=True)
    dist_checkpointing.save(model_sharded_state([model]), str(ckpt))
    mcore_io.write_meta(ckpt, dict(mcore_io.read_meta(tmp / "mcore"), step=3))
    mcore_io.copy_hf_side_files(tmp / "mcore" / mcore_io.HF_SUBDIR, ckpt / mcore_io.HF_SUBDIR)
    out = export(ckpt, tmp / "run" / "hf", dtype="fp32")

    exported, info = load_vl(VL, out)
    assert not info["missing_keys"] and not info["unexpected_keys"] and not info["mismatched_keys"], info
    source, written = tensors(tmp / "hf"), tensors(out)
    assert sorted(source) == sorted(written)
    vision = [n for n in source if n.startswith("model.visual.")]
    assert all(torch.equal(source[n], written[n]) for n in vision)
    trained = [n for n in source if n not in vision and not torch.equal(source[n], written[n])]
    assert len(trained) > len(source) // 2  # the language model changed
    with torch.no_grad():
        ours = packed_logits(model.eval(), DOCS, VOCAB)
    assert max_diff(text_logits(exported), ours) <= PARITY_TOL


def test_a_tensor_neither_mapped_nor_carried_fails_the_gate(vl, tmp_path):
    """Only the vision tower is carried: another non-language tensor still stops the conversion."""
    src, _ = vl
    shutil.copytree(src / "hf", tmp_path / "hf")
    save_file({"model.audio_tower.proj.weight": torch.zeros(2, 2)}, str(tmp_path / "hf" / "extra.safetensors"))
    index = tmp_path / "hf" / mcore_io.EXPORT_INDEX
    if index.is_file():
        data = json.loads(index.read_text())
        data["weight_map"]["model.audio_tower.proj.weight"] = "extra.safetensors"
        index.write_text(json.dumps(data))
    with pytest.raises(MappingError, match=r"neither loads nor lists as dropped: model\.audio_tower\.proj\.weight"):
        convert(tmp_path / "hf", tmp_path / "mcore")
    assert not (tmp_path / "mcore").exists()


def test_an_export_without_the_carried_tensors_is_refused(vl, tmp_path):
    """A checkpoint of a VL source that lost hf/carried/ stops the export before anything is
    written, naming the directory and the fix (an export without the vision tower would not load
    as the VL class)."""
    src, _ = vl
    shutil.copytree(src / "mcore", tmp_path / "mcore")
    shutil.rmtree(tmp_path / "mcore" / mcore_io.HF_SUBDIR / mcore_io.CARRIED_DIR)
    (tmp_path / "mcore" / "checksums.json").unlink(missing_ok=True)
    with pytest.raises(CheckpointError, match=r"hf/carried: missing .* reconvert the source"):
        export(tmp_path / "mcore", tmp_path / "out", dtype="fp32")
    assert not (tmp_path / "out").exists()


def test_an_fp8_vision_tower_is_dequantised_like_the_language_model(vl, tmp_path):
    """An FP8 release (scales beside the weights, `quantization_config` at the top of the VL
    config.json, here with 32x32 blocks): the carried vision weights are dequantised with the
    config's block size, as the language model is, since the export has no quantization_config."""
    from moe_sft.conversion import fp8

    src, _ = vl
    block = (32, 32)
    fp8_source, expected = {}, {}
    for name, t in tensors(src / "hf").items():
        t = t.to(torch.bfloat16)
        if t.dim() == 2 and name.startswith("model.visual.") and name.endswith("proj.weight"):
            q, s = fp8.quantize_blocks(t, block)
            fp8_source[name], fp8_source[fp8.scale_name(name)] = q, s
            expected[name] = fp8.dequantize_blocks(q, s, block)
        else:
            fp8_source[name] = expected[name] = t
    assert any(n.endswith("_scale_inv") for n in fp8_source)
    (tmp_path / "fp8").mkdir()
    save_file(fp8_source, str(tmp_path / "fp8" / "model.safetensors"))
    config = json.loads((src / "hf" / "config.json").read_text())
    config["quantization_config"] = {"quant_method": "fp8", "fmt": "e4m3", "weight_block_size": list(block)}
    (tmp_path / "fp8" / "config.json").write_text(json.dumps(config))
    convert(tmp_path / "fp8", tmp_path / "mcore")
    out = export(tmp_path / "mcore", tmp_path / "out", dtype="bf16")
    written = tensors(out)
    assert sorted(written) == sorted(expected)
    assert all(torch.equal(written[n], expected[n]) for n in expected)
    assert "quantization_config" not in json.loads((out / "config.json").read_text())


def test_the_peft_adapter_export_of_a_vl_run_is_refused_naming_the_merged_export(vl, tmp_path):
    """The PEFT-format adapter would target the text-only class: refused before anything is read
    (the end-of-training export logs it and writes the merged VL model)."""
    from moe_sft.peft.hf_adapter import AdapterExportError, check_adapter_export

    src, _ = vl
    run = tmp_path / "checkpoints" / "step_0000001"
    shutil.copytree(src / "mcore", run)
    (run / "checksums.json").unlink(missing_ok=True)
    base = {"path": str(src / "mcore"), "id": mcore_io.base_identity(src / "mcore")}
    mcore_io.write_meta(run, dict(mcore_io.read_meta(src / "mcore"), peft={"method": "lora"}, peft_base=base))
    with pytest.raises(AdapterExportError, match=r"Qwen3_5MoeForConditionalGeneration.*merged export"):
        check_adapter_export(run, tmp_path / "adapter")
