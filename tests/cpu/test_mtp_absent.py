"""A checkpoint saved by transformers declares an MTP layer it does not hold.

`DeepseekV3Config` defaults `num_nextn_predict_layers=1` and transformers' model has no MTP module,
so `save_pretrained` writes a config.json with one MTP layer and no `model.layers.{N}.*` tensors;
a Qwen3-Next / Qwen3.5 release's config.json (`mtp_num_hidden_layers: 1`) loaded and saved by
transformers keeps the field and loses the `mtp.*` tensors. Such a checkpoint converts without MTP
(the converted `hf/config.json`, the meta and the export say so); one holding some MTP tensors but
not all is still refused, naming the missing ones.
"""

from __future__ import annotations

import json
import logging
from functools import partial

import pytest
import torch
from safetensors.torch import load_file, save_file

from moe_sft.conversion import mapping, mcore_io
from moe_sft.conversion.convert import convert
from moe_sft.conversion.export import export, load_model_from_checkpoint
from moe_sft.conversion.hf_source import load_hf_config
from moe_sft.models import registry
from moe_sft.models.forward import packed_logits
from moe_sft.runtime import cpu_compat
from tests.cpu.test_families import PARITY_TOL, _all_tensors
from tests.deepseek_mtp import write_tiny_deepseek_with_mtp
from tests.qwen3_next_mtp import write_tiny_with_mtp

VOCAB = 300
# family -> its MTP count field, and two of the MTP tensors its layout stores
LAYOUTS = {
    "deepseek_v3": ("num_nextn_predict_layers", ["model.layers.2.eh_proj.weight", "model.layers.2.enorm.weight"]),
    "qwen3_next": ("mtp_num_hidden_layers", ["mtp.fc.weight", "mtp.pre_fc_norm_embedding.weight"]),
}
WRITERS = {"deepseek_v3": write_tiny_deepseek_with_mtp, "qwen3_next": partial(write_tiny_with_mtp, "qwen3_next")}


@pytest.fixture(scope="module", params=list(LAYOUTS))
def saved_by_transformers(request, tmp_path_factory):
    """(HF model, tmp, meta, converter's log records, family, field): transformers' own save of a
    config with one MTP layer, converted to tmp/mcore."""
    family = registry.family_by_name(request.param)
    field = LAYOUTS[request.param][0]
    tmp = tmp_path_factory.mktemp(f"mtp_absent_{request.param}")
    cfg = family.tiny_hf_config(vocab_size=VOCAB, **{field: 1})
    with cpu_compat.suspended():
        torch.manual_seed(0)
        hf = family.hf_model_class(cfg).eval()
        for name, buf in hf.named_buffers():
            if name.endswith("e_score_correction_bias"):  # zeros at init: make it steer routing
                buf.copy_(torch.randn_like(buf) * 0.5)
        hf.save_pretrained(str(tmp / "hf"))
    records = []
    handler = logging.Handler()
    handler.emit = records.append
    logger = logging.getLogger("moe_sft")
    logger.addHandler(handler)
    try:
        meta = convert(tmp / "hf", tmp / "mcore")
    finally:
        logger.removeHandler(handler)
    return hf, tmp, meta, records, family, field


def test_transformers_saves_the_mtp_count_but_no_mtp_tensor(saved_by_transformers):
    hf, tmp, _, _, family, field = saved_by_transformers
    assert json.loads((tmp / "hf" / "config.json").read_text())[field] == 1
    mtp_names = {n for e in mapping.expand(family, hf.config) if e.mcore.startswith("mtp.") for n in e.hf}
    assert mtp_names and not mtp_names & set(_all_tensors(tmp / "hf"))


def test_converts_without_mtp_and_says_so_once(saved_by_transformers):
    _, tmp, meta, records, _, field = saved_by_transformers
    assert meta["mtp_dropped_from_config"] == {field: 1}
    assert mcore_io.read_meta(tmp / "mcore")["mtp_dropped_from_config"] == {field: 1}
    said = [r.getMessage() for r in records if field in r.getMessage()]
    assert said == [
        f"config.json declares {field}=1 but the checkpoint holds no MTP tensors (saved by "
        "transformers, which has no MTP module): converting without MTP"
    ], said
    assert mcore_io.checkpoint_problems(tmp / "mcore") == []


def test_the_converted_dir_says_no_mtp_to_every_reader(saved_by_transformers):
    """Trainer, export and planner all read the converted dir's hf/config.json."""
    hf, tmp, _, _, _, field = saved_by_transformers
    written = json.loads((tmp / "mcore" / "hf" / "config.json").read_text())
    assert written[field] == 0
    source = json.loads((tmp / "hf" / "config.json").read_text())
    assert {k: v for k, v in written.items() if k != field} == {k: v for k, v in source.items() if k != field}
    family, cfg = load_hf_config(tmp / "mcore" / "hf")
    assert family.num_mtp_layers(cfg) == 0
    model = load_model_from_checkpoint(tmp / "mcore").eval()
    assert not [k for k in model.state_dict() if k.startswith("mtp.")]
    seq = torch.randint(0, VOCAB, (23,), generator=torch.Generator().manual_seed(1)).tolist()
    with cpu_compat.suspended(), torch.no_grad():
        ref = hf(torch.tensor([seq])).logits[0].float()
    ours = packed_logits(model, [seq], VOCAB)[0]
    assert (ref - ours).abs().max().item() < PARITY_TOL


def test_export_round_trips_bit_exactly_and_says_no_mtp(saved_by_transformers):
    _, tmp, _, _, _, field = saved_by_transformers
    export(tmp / "mcore", tmp / "out", dtype="fp32")
    before, after = _all_tensors(tmp / "hf"), _all_tensors(tmp / "out")
    assert set(before) == set(after)
    assert all(torch.equal(before[k], after[k]) for k in before)
    assert json.loads((tmp / "out" / "config.json").read_text())[field] == 0


@pytest.mark.parametrize("name", list(LAYOUTS))
def test_some_mtp_tensors_but_not_all_is_refused_naming_them(name, tmp_path):
    WRITERS[name](tmp_path / "hf", VOCAB)
    extra = load_file(str(tmp_path / "hf" / "mtp.safetensors"))
    gone = LAYOUTS[name][1]
    assert all(name in extra for name in gone) and len(extra) > len(gone)
    save_file({k: v for k, v in extra.items() if k not in gone}, str(tmp_path / "hf" / "mtp.safetensors"))
    with pytest.raises(
        mapping.MappingError, match=r"lacks 2 tensor\(s\).*" + r", ".join(n.replace(".", r"\.") for n in gone)
    ):
        convert(tmp_path / "hf", tmp_path / "mcore")
    assert not (tmp_path / "mcore").exists()
