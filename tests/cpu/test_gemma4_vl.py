"""Gemma 4 multimodal checkpoints (`Gemma4ForConditionalGeneration`, the releases' class) for text
SFT: the language model is converted and trained, the vision and audio towers and their embedders
carried through untouched and written back, so the export loads as the multimodal class again
(moe_sft/conversion/composite.py; the pattern of tests/cpu/test_qwen3_5_vl.py)."""

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
from moe_sft.conversion.mapping import MappingError
from moe_sft.conversion.verify import verify
from moe_sft.models import gemma4, registry
from moe_sft.models.forward import packed_logits
from moe_sft.plan.shapes import shape_from_hf_dict
from moe_sft.runtime import cpu_compat
from tests.train_steps import adam_steps, random_batches
from tests.vl_checkpoints import DOCS, PARITY_TOL, load_vl, max_diff, tensors, text_logits

VOCAB = 300
VL = gemma4.COMPOSITE.hf_model_class
LANGUAGE = "model.language_model."
# what each carried part is called in the conversion's line, by its prefix in the checkpoint
PARTS = {
    "model.vision_tower.": "vision tower",
    "model.embed_vision.": "vision embedder",
    "model.audio_tower.": "audio tower",
    "model.embed_audio.": "audio embedder",
}


def _carried_by_part(names) -> dict[str, list[str]]:
    out: dict[str, list[str]] = {}
    for n in names:
        part = next((what for prefix, what in PARTS.items() if n.startswith(prefix)), None)
        if part:
            out.setdefault(part, []).append(n)
    return out


@pytest.fixture(scope="module")
def vl(tmp_path_factory):
    """A tiny random multimodal source (one-layer vision and audio towers) and its conversion's log."""
    tmp = tmp_path_factory.mktemp("gemma4_vl")
    with cpu_compat.suspended():
        torch.manual_seed(0)
        VL(gemma4.COMPOSITE.tiny_hf_config(vocab_size=VOCAB)).save_pretrained(str(tmp / "hf"))
    log = io.StringIO()
    with contextlib.redirect_stdout(log):  # the one logger writes to the current stdout
        convert(tmp / "hf", tmp / "mcore")
    return tmp, log.getvalue()


def test_conversion_carries_every_tensor_outside_the_language_model(vl):
    """Vision tower, audio tower (clipped linears' bounds included) and both embedders: each named
    in the conversion's line, stored in hf/carried/, counted in the meta; nothing else is carried."""
    tmp, log = vl
    source = tensors(tmp / "hf")
    outside = sorted(n for n in source if not n.startswith(LANGUAGE) and n != "lm_head.weight")
    parts = _carried_by_part(outside)
    assert set(parts) == set(PARTS.values()), parts  # the tiny model has all four parts
    assert sorted(n for names in parts.values() for n in names) == outside  # no other tensor outside
    assert any(n.endswith(".input_max") for n in parts["audio tower"])  # buffers, not only weights
    assert any(n.endswith(".std_scale") for n in parts["vision tower"])
    for what, names in parts.items():
        assert f"{len(names)} {what} tensor{'s' if len(names) != 1 else ''}" in log, (what, log)
    assert "carried through, not trained" in log, log
    carried = tensors(tmp / "mcore" / mcore_io.HF_SUBDIR / mcore_io.CARRIED_DIR)
    assert sorted(carried) == outside
    assert all(torch.equal(carried[n], source[n]) for n in outside)
    meta = mcore_io.read_meta(tmp / "mcore")
    assert meta["model_type"] == "gemma4"
    assert meta["carried_tensors"] == {what: len(names) for what, names in parts.items()}
    assert mcore_io.checkpoint_problems(tmp / "mcore") == []  # vocab_size read from text_config


def test_the_language_model_is_the_text_family(vl):
    """Config and planner shape come from text_config; `--verify` (the multimodal model on text)
    agrees with the conversion."""
    tmp, _ = vl
    config = json.loads((tmp / "hf" / "config.json").read_text())
    family = registry.family_for_model_type(config["model_type"])
    assert family.name == "gemma4"
    assert shape_from_hf_dict(config) == family.shape(config["text_config"])
    assert shape_from_hf_dict(config).model_type == "gemma4_text"
    assert verify(tmp / "hf", tmp / "mcore") <= PARITY_TOL


def test_round_trip_without_training_is_the_source(vl):
    """convert → export: every tensor bit-identical, the multimodal config back, transformers loads
    it whole and its text logits are the source's."""
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


def test_trained_on_text_exports_the_multimodal_model(vl):
    """A few Adam steps on text, saved as the trainer saves a checkpoint (its hf side files, the
    carried tensors with them), exported: the multimodal class loads it with no missing or
    unexpected key, every carried tensor is the source's bit for bit, the language model is the
    trained one and its text logits equal ours within 1e-4."""
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
    carried = [n for names in _carried_by_part(source).values() for n in names]
    assert all(torch.equal(source[n], written[n]) for n in carried)
    language = [n for n in source if n.startswith(LANGUAGE)]
    trained = [n for n in language if not torch.equal(source[n], written[n])]
    assert len(trained) > len(language) // 2  # the language model changed
    with torch.no_grad():
        ours = packed_logits(model.eval(), DOCS, VOCAB)
    assert max_diff(text_logits(exported), ours) <= PARITY_TOL


def test_a_tensor_neither_mapped_nor_carried_fails_the_gate(vl, tmp_path):
    """Only the four known parts are carried: another tensor outside the language model still
    stops the conversion, by name."""
    src, _ = vl
    shutil.copytree(src / "hf", tmp_path / "hf")
    extra = "model.video_tower.proj.weight"
    save_file({extra: torch.zeros(2, 2)}, str(tmp_path / "hf" / "extra.safetensors"))
    index = tmp_path / "hf" / mcore_io.EXPORT_INDEX
    if index.is_file():
        data = json.loads(index.read_text())
        data["weight_map"][extra] = "extra.safetensors"
        index.write_text(json.dumps(data))
    with pytest.raises(MappingError, match=r"neither loads nor lists as dropped: model\.video_tower\.proj\.weight"):
        convert(tmp_path / "hf", tmp_path / "mcore")
    assert not (tmp_path / "mcore").exists()


def test_the_peft_adapter_export_of_a_multimodal_run_is_refused_naming_the_merged_export(vl, tmp_path):
    """The PEFT-format adapter would target the text-only class: refused before anything is read
    (the end-of-training export logs it and writes the merged multimodal model)."""
    from moe_sft.peft.hf_adapter import AdapterExportError, check_adapter_export

    src, _ = vl
    run = tmp_path / "checkpoints" / "step_0000001"
    shutil.copytree(src / "mcore", run)
    (run / "checksums.json").unlink(missing_ok=True)
    base = {"path": str(src / "mcore"), "id": mcore_io.base_identity(src / "mcore")}
    mcore_io.write_meta(run, dict(mcore_io.read_meta(src / "mcore"), peft={"method": "lora"}, peft_base=base))
    with pytest.raises(AdapterExportError, match=r"Gemma4ForConditionalGeneration.*merged export"):
        check_adapter_export(run, tmp_path / "adapter")
