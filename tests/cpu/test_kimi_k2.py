"""Kimi-K2: its config.json (`model_type: kimi_k2`, DeepseekV3ForCausalLM, an auto_map into remote
code, the remote code's own fields) converts and exports back to the same model type; every field
that differs from DeepSeek-V3's meaning is refused by name before any conversion work; the FP8
release format converts. Parity with DeepseekV3ForCausalLM on Kimi's values is the registry-driven
tests' (tests/cpu/test_families.py, test_config_space.py: `-k kimi_k2`)."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file, save_file

from moe_sft.conversion import fp8
from moe_sft.conversion.convert import convert
from moe_sft.conversion.export import export
from moe_sft.conversion.hf_source import load_hf_config
from moe_sft.models import kimi_k2
from moe_sft.models.family import UnsupportedConfigError
from moe_sft.runtime import cpu_compat

VOCAB = 300
REMOTE_CODE = {
    "auto_map": {
        "AutoConfig": "configuration_deepseek.DeepseekV3Config",
        "AutoModel": "modeling_deepseek.DeepseekV3Model",
        "AutoModelForCausalLM": "modeling_deepseek.DeepseekV3ForCausalLM",
    },
    "aux_loss_alpha": 0.001,
    "ep_size": 1,
    "moe_layer_freq": 1,
    "scoring_func": "sigmoid",
    "seq_aux": True,
    "topk_method": "noaux_tc",
}


def _as_released(config: dict) -> dict:
    """A config.json laid out as Kimi-K2-Instruct's: legacy rope_theta + rope_scaling, remote fields."""
    config = dict(config, **REMOTE_CODE)
    rope = dict(config.pop("rope_parameters"))
    config["rope_theta"] = rope.pop("rope_theta")
    rope.pop("rope_type")
    config["rope_scaling"] = dict(rope, type="yarn")
    config["torch_dtype"] = config.pop("dtype", "float32")
    return config


def _all_tensors(path: Path) -> dict:
    out = {}
    for f in sorted(path.glob("*.safetensors")):
        out.update(load_file(str(f)))
    return out


@pytest.fixture(scope="module")
def released(tmp_path_factory):
    """A tiny random Kimi-K2 checkpoint whose config.json is laid out as the released one."""
    tmp = tmp_path_factory.mktemp("kimi")
    cfg = kimi_k2.tiny_hf_config(vocab_size=VOCAB)
    with cpu_compat.suspended():
        torch.manual_seed(0)
        model = kimi_k2.FAMILY.hf_model_class(cfg).eval()
        for name, buf in model.named_buffers():
            if name.endswith("e_score_correction_bias"):
                buf.copy_(torch.randn_like(buf) * 0.5)
        model.save_pretrained(str(tmp / "hf"))
    config = _as_released(json.loads((tmp / "hf" / "config.json").read_text()))
    (tmp / "hf" / "config.json").write_text(json.dumps(config, indent=2))
    return tmp, config


def test_released_layout_reads_as_deepseek_v3_under_kimis_type(released):
    tmp, _ = released
    family, cfg = load_hf_config(tmp / "hf")
    assert family.name == "kimi_k2" and cfg.model_type == "kimi_k2"
    assert isinstance(cfg, kimi_k2.DeepseekV3Config)
    rope = cfg.rope_parameters
    assert (rope["rope_type"], rope["rope_theta"], rope["factor"]) == ("yarn", 50000.0, 32.0)
    assert (rope["beta_fast"], rope["beta_slow"], rope["original_max_position_embeddings"]) == (1.0, 1.0, 4096)
    kw = family.transformer_config_kwargs(cfg)
    assert kw["rotary_base"] == 50000.0 and kw["rotary_scaling_factor"] == 32.0
    assert kw["moe_router_num_groups"] == 1 and kw["moe_router_topk_scaling_factor"] == 2.827
    assert kw["moe_layer_freq"] == [0, 1] and kw["mtp_num_layers"] is None


def test_convert_and_export_keep_model_type_architectures_and_auto_map(released, capsys):
    tmp, source = released
    (tmp / "hf" / "modeling_deepseek.py").write_text("raise SystemExit('remote code must never run')\n")
    convert(tmp / "hf", tmp / "mcore")
    said = capsys.readouterr().out
    assert (
        "ships its own modeling code (auto_map ['AutoConfig', 'AutoModel', 'AutoModelForCausalLM'], "
        "modeling_deepseek.py): moe-sft reads config.json and the safetensors weights only" in said
    ), said
    assert "that code is never run (no trust_remote_code)" in said
    meta = json.loads((tmp / "mcore" / "moe_sft_meta.json").read_text())
    assert meta["family"] == "kimi_k2" and meta["model_type"] == "kimi_k2"
    assert json.loads((tmp / "mcore" / "hf" / "config.json").read_text()) == source  # copied as given
    export(tmp / "mcore", tmp / "out", dtype="fp32")
    out = json.loads((tmp / "out" / "config.json").read_text())
    assert out["model_type"] == "kimi_k2"
    assert out["architectures"] == ["DeepseekV3ForCausalLM"]
    for key, value in REMOTE_CODE.items():
        assert out[key] == value, key
    family, cfg = load_hf_config(tmp / "out")  # and it reads back as the same model
    assert family.name == "kimi_k2" and cfg.rope_parameters["factor"] == 32.0
    before, after = _all_tensors(tmp / "hf"), _all_tensors(tmp / "out")
    assert set(before) == set(after) and all(torch.equal(before[k], after[k]) for k in before)


def _refused(tmp_path: Path, source: dict, **changes) -> str:
    config = dict(source)
    for key, value in changes.items():
        if value is None:
            config.pop(key, None)
        else:
            config[key] = value
    (tmp_path / "config.json").write_text(json.dumps(config))
    with pytest.raises(UnsupportedConfigError) as err:
        load_hf_config(tmp_path)
    return str(err.value)


@pytest.mark.parametrize(
    "changes, named",
    [
        (dict(scoring_func="softmax"), "scoring_func='softmax'"),
        (dict(topk_method="greedy"), "topk_method='greedy'"),
        (dict(moe_layer_freq=2), "moe_layer_freq=2"),
        (dict(num_key_value_heads=2), "num_key_value_heads=2"),
        (dict(architectures=["KimiLinearForCausalLM"]), "architectures=['KimiLinearForCausalLM']"),
        (dict(hidden_act="gelu"), "hidden_act='gelu'"),
        (dict(attention_bias=True), "attention_bias=true"),
        (dict(n_group=3), "n_group=3"),
        (dict(topk_group=2), "topk_group=2"),
        (dict(pretraining_tp=2), "pretraining_tp=2"),
        (dict(rope_scaling={"type": "dynamic", "factor": 2.0}), "rope type 'dynamic'"),
        (
            dict(
                rope_scaling={
                    "type": "yarn",
                    "factor": 32.0,
                    "original_max_position_embeddings": 4096,
                    "long_factor": [1.0],
                }
            ),
            "rope_scaling.long_factor",
        ),
        (
            dict(quantization_config={"quant_method": "compressed-tensors", "format": "pack-quantized"}),
            "quantization_config.quant_method='compressed-tensors'",
        ),
        (
            dict(quantization_config={"quant_method": "fp8", "fmt": "e5m2", "weight_block_size": [128, 128]}),
            "quantization_config.fmt='e5m2'",
        ),
    ],
)
def test_fields_that_differ_from_deepseek_v3_are_refused_by_name(released, tmp_path, changes, named):
    _, source = released
    message = _refused(tmp_path, source, **changes)
    assert named in message, message


def test_a_field_only_the_remote_code_knows_is_refused_saying_it_is_never_run(released, tmp_path):
    _, source = released
    message = _refused(tmp_path, source, use_muon_clip_heads=True)
    assert "use_muon_clip_heads=True" in message
    assert "config.json and the weights only" in message and "remote modeling code" in message


def test_refused_before_any_conversion_work(released, tmp_path):
    _, source = released
    (tmp_path / "hf").mkdir()
    (tmp_path / "hf" / "config.json").write_text(json.dumps(dict(source, scoring_func="softmax")))
    with pytest.raises(UnsupportedConfigError, match="scoring_func"):  # no shard: none was opened
        convert(tmp_path / "hf", tmp_path / "mcore")
    assert not (tmp_path / "mcore").exists() and not (tmp_path / "mcore.tmp").exists()


def test_fp8_release_converts_and_exports_dequantised(released, tmp_path):
    """Kimi-K2-Instruct's format: e4m3 weights with 128x128 `weight_scale_inv` blocks."""
    tmp, source = released
    quantised, expected = {}, {}
    for name, t in _all_tensors(tmp / "hf").items():
        if t.dim() == 2 and "proj" in name:  # attention and expert projections, as released
            q, s = fp8.quantize_blocks(t)
            quantised[name], quantised[fp8.scale_name(name)] = q, s
            expected[name] = fp8.dequantize_blocks(q, s)
        else:
            quantised[name] = t.to(torch.bfloat16)
    (tmp_path / "fp8").mkdir()
    save_file(quantised, str(tmp_path / "fp8" / "model.safetensors"))
    quant = {"activation_scheme": "dynamic", "fmt": "e4m3", "quant_method": "fp8", "weight_block_size": [128, 128]}
    config = dict(source, quantization_config=quant, torch_dtype="bfloat16")
    (tmp_path / "fp8" / "config.json").write_text(json.dumps(config))
    convert(tmp_path / "fp8", tmp_path / "mcore")
    export(tmp_path / "mcore", tmp_path / "out", dtype="bf16")
    out = _all_tensors(tmp_path / "out")
    assert not any(n.endswith("_scale_inv") for n in out)
    assert all(torch.equal(out[n], expected[n]) for n in expected), "dequantised weights changed"
    written = json.loads((tmp_path / "out" / "config.json").read_text())
    assert "quantization_config" not in written and written["model_type"] == "kimi_k2"


def test_export_is_the_source_config_json_with_only_the_dtype_changed(released, tmp_path):
    """Every field of the release's config.json survives, laid out as given (transformers' own
    re-save turned rope_theta / rope_scaling into rope_parameters and torch_dtype into dtype)."""
    tmp, source = released
    convert(tmp / "hf", tmp_path / "mcore")
    export(tmp_path / "mcore", tmp_path / "out", dtype="bf16")
    assert json.loads((tmp_path / "out" / "config.json").read_text()) == dict(source, torch_dtype="bfloat16")


_PLAIN_TRANSFORMERS = """
import sys, torch
from transformers import AutoModelForCausalLM
model = AutoModelForCausalLM.from_pretrained(sys.argv[1], dtype=torch.float32, trust_remote_code=True).eval()
assert type(model).__module__.endswith("modeling_deepseek"), type(model)
with torch.no_grad():
    torch.save(model(torch.arange(48)[None] * 7 % int(sys.argv[3])).logits[0], sys.argv[2])
"""


def test_quickstart_export_loads_in_plain_transformers_with_trust_remote_code(tmp_path):
    """The tiny Kimi-K2 is written as the release is (auto_map + configuration_deepseek.py /
    modeling_deepseek.py) and its export carries both, so transformers without moe-sft (which
    knows no `kimi_k2`) loads it through them: the logits are the source's."""
    import subprocess
    import sys

    from moe_sft.quickstart_model import create_tiny_hf

    create_tiny_hf(tmp_path / "hf", Path("recipes/demo/tokenizer"), family="kimi_k2")
    assert json.loads((tmp_path / "hf" / "config.json").read_text())["auto_map"] == REMOTE_CODE["auto_map"]
    convert(tmp_path / "hf", tmp_path / "mcore")
    export(tmp_path / "mcore", tmp_path / "out", dtype="fp32")
    for module in ("configuration_deepseek.py", "modeling_deepseek.py"):
        assert (tmp_path / "out" / module).read_text() == (tmp_path / "hf" / module).read_text()
    vocab = json.loads((tmp_path / "hf" / "config.json").read_text())["vocab_size"]
    env = {"HF_MODULES_CACHE": str(tmp_path / "modules"), "PATH": "/usr/bin:/bin", "HF_HUB_OFFLINE": "1"}
    run = subprocess.run(
        [sys.executable, "-c", _PLAIN_TRANSFORMERS, str(tmp_path / "out"), str(tmp_path / "logits.pt"), str(vocab)],
        capture_output=True,
        text=True,
        env=env,
        cwd=tmp_path,
    )
    assert run.returncode == 0, run.stderr[-2000:]
    with cpu_compat.suspended(), torch.no_grad():
        source = kimi_k2.FAMILY.hf_model_class.from_pretrained(str(tmp_path / "hf"), dtype=torch.float32).eval()
        expected = source(torch.arange(48)[None] * 7 % vocab).logits[0]
    assert (torch.load(tmp_path / "logits.pt") - expected).abs().max() < 1e-5  # another process: fp32 noise
