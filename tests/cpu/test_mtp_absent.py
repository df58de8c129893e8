"""A DeepSeek-V3 checkpoint saved by transformers declares an MTP layer it does not hold.

`DeepseekV3Config` defaults `num_nextn_predict_layers=1` and transformers' model has no MTP module,
so `save_pretrained` writes a config.json with one MTP layer and no `model.layers.{N}.*` tensors.
Such a checkpoint converts without MTP (the converted `hf/config.json`, the meta and the export say
so); one holding some MTP tensors but not all is still refused, naming the missing ones.
"""

from __future__ import annotations

import json
import logging

import pytest
import torch
from safetensors.torch import load_file, save_file

from moe_sft.conversion import mapping, mcore_io
from moe_sft.conversion.convert import convert
from moe_sft.conversion.export import export, load_model_from_checkpoint
from moe_sft.conversion.hf_source import load_hf_config
from moe_sft.models import deepseek_v3
from moe_sft.models.forward import packed_logits
from moe_sft.runtime import cpu_compat
from tests.cpu.test_families import PARITY_TOL, _all_tensors
from tests.deepseek_mtp import write_tiny_deepseek_with_mtp

VOCAB = 300
FIELD = "num_nextn_predict_layers"


@pytest.fixture(scope="module")
def saved_by_transformers(tmp_path_factory):
    """(HF model, tmp, converter's log records): transformers' own save of a config with one MTP layer,
    converted to tmp/mcore."""
    tmp = tmp_path_factory.mktemp("mtp_absent")
    cfg = deepseek_v3.tiny_hf_config(vocab_size=VOCAB, num_nextn_predict_layers=1)
    with cpu_compat.suspended():
        torch.manual_seed(0)
        hf = deepseek_v3.FAMILY.hf_model_class(cfg).eval()
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
    return hf, tmp, meta, records


def test_transformers_saves_the_mtp_count_but_no_mtp_tensor(saved_by_transformers):
    _, tmp, _, _ = saved_by_transformers
    assert json.loads((tmp / "hf" / "config.json").read_text())[FIELD] == 1
    n = deepseek_v3.tiny_hf_config().num_hidden_layers
    assert not [k for k in _all_tensors(tmp / "hf") if k.startswith(f"model.layers.{n}.")]


def test_converts_without_mtp_and_says_so_once(saved_by_transformers):
    _, tmp, meta, records = saved_by_transformers
    assert meta["mtp_dropped_from_config"] == {FIELD: 1}
    assert mcore_io.read_meta(tmp / "mcore")["mtp_dropped_from_config"] == {FIELD: 1}
    said = [r.getMessage() for r in records if FIELD in r.getMessage()]
    assert said == [
        f"config.json declares {FIELD}=1 but the checkpoint holds no MTP tensors (saved by "
        "transformers, which has no MTP module): converting without MTP"
    ], said
    assert mcore_io.checkpoint_problems(tmp / "mcore") == []


def test_the_converted_dir_says_no_mtp_to_every_reader(saved_by_transformers):
    """Trainer, export and planner all read the converted dir's hf/config.json."""
    hf, tmp, _, _ = saved_by_transformers
    written = json.loads((tmp / "mcore" / "hf" / "config.json").read_text())
    assert written[FIELD] == 0
    source = json.loads((tmp / "hf" / "config.json").read_text())
    assert {k: v for k, v in written.items() if k != FIELD} == {k: v for k, v in source.items() if k != FIELD}
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
    _, tmp, _, _ = saved_by_transformers
    export(tmp / "mcore", tmp / "out", dtype="fp32")
    before, after = _all_tensors(tmp / "hf"), _all_tensors(tmp / "out")
    assert set(before) == set(after)
    assert all(torch.equal(before[k], after[k]) for k in before)
    assert json.loads((tmp / "out" / "config.json").read_text())[FIELD] == 0


def test_some_mtp_tensors_but_not_all_is_refused_naming_them(tmp_path):
    write_tiny_deepseek_with_mtp(tmp_path / "hf", VOCAB)
    extra = load_file(str(tmp_path / "hf" / "mtp.safetensors"))
    gone = ["model.layers.2.eh_proj.weight", "model.layers.2.enorm.weight"]
    assert all(name in extra for name in gone) and len(extra) > len(gone)
    save_file({k: v for k, v in extra.items() if k not in gone}, str(tmp_path / "hf" / "mtp.safetensors"))
    with pytest.raises(
        mapping.MappingError, match=r"lacks 2 tensor\(s\).*" + r", ".join(n.replace(".", r"\.") for n in gone)
    ):
        convert(tmp_path / "hf", tmp_path / "mcore")
    assert not (tmp_path / "mcore").exists()
