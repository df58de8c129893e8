"""MiniMax-M2's own checks (the registry-driven tests in test_families.py / test_config_space.py
cover conversion, parity and training of its tiny and random configs):
- q_norm / k_norm over all heads (moe_sft/layers/full_width_qk_norm.py) equal transformers'
  MiniMaxM2RMSNorm, on one rank and split over two TP ranks (gloo), forward and backward;
- partial rotary: logit parity at several rotary dims, and the released `rotary_dim` field;
- top-1 routing (transformers renormalises the one weight to 1, megatron's sigmoid router not);
- an FP8 block-quantised source with the release's quantization_config and MTP tensors converts
  (dequantised while streaming, MTP logged as dropped, not exported);
- each config field the family cannot honour is refused, naming the field.
"""

from __future__ import annotations

import json
import os
import tempfile

import pytest
import torch
import torch.distributed as dist
import torch.multiprocessing as mp
from safetensors.torch import load_file, save_file
from transformers.models.minimax_m2.modeling_minimax_m2 import MiniMaxM2RMSNorm

from moe_sft.conversion import fp8, parity
from moe_sft.conversion.convert import convert
from moe_sft.conversion.export import export
from moe_sft.layers.full_width_qk_norm import full_width_rms_norm
from moe_sft.models import minimax_m2, registry
from moe_sft.models.family import UnsupportedConfigError
from moe_sft.runtime import cpu_compat

FAMILY = registry.family_by_name("minimax_m2")
HEADS, HEAD_DIM, TOKENS, EPS = 4, 8, 5, 1e-5
TOL = dict(rtol=1e-6, atol=1e-6)  # fp32, the sums of squares added in another order


def _reference(x, weight):
    """transformers' norm over the flattened heads, with its gradients."""
    norm = MiniMaxM2RMSNorm(HEADS * HEAD_DIM, EPS)
    norm.weight.data.copy_(weight)
    x = x.clone().requires_grad_(True)
    y = norm(x.reshape(TOKENS, -1)).reshape(TOKENS, HEADS, HEAD_DIM)
    (y * _grad_out()).sum().backward()
    return y.detach(), x.grad, norm.weight.grad


def _inputs():
    g = torch.Generator().manual_seed(0)
    return torch.randn(TOKENS, HEADS, HEAD_DIM, generator=g, dtype=torch.float32), 1 + 0.3 * torch.randn(
        HEADS * HEAD_DIM, generator=g, dtype=torch.float32
    )


def _grad_out():
    return torch.randn(TOKENS, HEADS, HEAD_DIM, generator=torch.Generator().manual_seed(1), dtype=torch.float32)


def _ours(x, weight, group=None):
    x, weight = x.clone().requires_grad_(True), weight.clone().requires_grad_(True)
    y = full_width_rms_norm(x, weight, EPS, group)
    (y * _grad_out()[:, : x.shape[1]] if group is None else y * _grad_slice(x.shape[1])).sum().backward()
    return y.detach(), x.grad, weight.grad


def _grad_slice(local_heads):
    rank = dist.get_rank()
    return _grad_out()[:, rank * local_heads : (rank + 1) * local_heads]


def test_full_width_qk_norm_equals_transformers_on_one_rank():
    x, w = _inputs()
    for ours, ref in zip(_ours(x, w), _reference(x, w)):
        torch.testing.assert_close(ours, ref, **TOL)


def _tp2_worker(rank, init_file, out_dir):
    dist.init_process_group("gloo", init_method=f"file://{init_file}", rank=rank, world_size=2)
    try:
        x, w = _inputs()
        local = HEADS // 2
        heads = slice(rank * local, (rank + 1) * local)
        y, dx, dw = _ours(x[:, heads], w[rank * local * HEAD_DIM : (rank + 1) * local * HEAD_DIM], dist.group.WORLD)
        torch.save((y, dx, dw), os.path.join(out_dir, f"rank{rank}.pt"))
    finally:
        dist.destroy_process_group()


def test_full_width_qk_norm_split_over_two_tp_ranks(tmp_path):
    """Each rank holds half the heads and half the weight: the all-reduced sum of squares gives
    the full-width norm, and its all-reduced gradient the full-width input gradient."""
    init = tempfile.mktemp(dir=tmp_path)
    mp.start_processes(_tp2_worker, args=(init, str(tmp_path)), nprocs=2, start_method="spawn")
    parts = [torch.load(tmp_path / f"rank{r}.pt") for r in range(2)]
    y, dx, dw = _reference(*_inputs())
    torch.testing.assert_close(torch.cat([p[0] for p in parts], dim=1), y, **TOL)
    torch.testing.assert_close(torch.cat([p[1] for p in parts], dim=1), dx, **TOL)
    torch.testing.assert_close(torch.cat([p[2] for p in parts]), dw, **TOL)


def _check(tmp_path, cfg, seed=0):
    FAMILY.check_supported(cfg)
    result = parity.check_config(FAMILY, cfg, seed, tmp_path)
    print(f"minimax_m2: max abs logit diff {result.max_logit_diff:.3e} {result.details}")
    assert result.passed, (result.error, result.max_logit_diff, result.details)


@pytest.mark.parametrize("factor", [0.25, 0.5, 1.0])
def test_partial_rotary_parity(tmp_path, factor):
    rope = {"rope_type": "default", "rope_theta": 10000.0, "partial_rotary_factor": factor}
    _check(tmp_path, minimax_m2.tiny_hf_config(vocab_size=301, num_hidden_layers=1, rope_parameters=rope))


def test_released_rotary_dim_field(tmp_path):
    """The release's config.json says `rotary_dim: 64` (head_dim 128) and no partial_rotary_factor."""
    cfg = minimax_m2.tiny_hf_config(vocab_size=301, num_hidden_layers=1, rope_parameters=None, rotary_dim=8)
    assert minimax_m2.rotary_dim(cfg) == 8
    assert FAMILY.gpt_model_kwargs(cfg)["rotary_percent"] == 0.25
    _check(tmp_path, cfg)


def test_top1_routing_is_renormalised(tmp_path):
    _check(tmp_path, minimax_m2.tiny_hf_config(vocab_size=301, num_experts_per_tok=1, num_hidden_layers=1))


RELEASED_CONFIG = {
    "architectures": ["MiniMaxM2ForCausalLM"],
    "model_type": "minimax_m2",
    "attn_type_list": [1] * 62,
    "head_dim": 128,
    "hidden_act": "silu",
    "hidden_size": 3072,
    "intermediate_size": 1536,
    "max_position_embeddings": 196608,
    "mtp_transformer_layers": 1,
    "num_attention_heads": 48,
    "num_experts_per_tok": 8,
    "num_hidden_layers": 62,
    "num_key_value_heads": 8,
    "num_local_experts": 256,
    "num_mtp_modules": 3,
    "qk_norm_type": "per_layer",
    "rms_norm_eps": 1e-06,
    "rope_theta": 5000000,
    "rotary_dim": 64,
    "scoring_func": "sigmoid",
    "shared_intermediate_size": 0,
    "tie_word_embeddings": False,
    "use_mtp": True,
    "use_qk_norm": True,
    "use_routing_bias": True,
    "vocab_size": 200064,
}


def test_released_config_shape_and_support():
    s = FAMILY.shape(RELEASED_CONFIG)
    assert (s.num_layers, s.num_experts, s.topk, s.moe_ffn, s.num_heads, s.num_kv_heads, s.head_dim) == (
        62,
        256,
        8,
        1536,
        48,
        8,
        128,
    )
    assert all(s.moe_layers) and s.mtp_layers == 0 and s.shared_ffn == 0
    assert minimax_m2.rotary_dim(RELEASED_CONFIG) == 64
    cfg = FAMILY.hf_config_class(**{k: v for k, v in RELEASED_CONFIG.items() if k != "model_type"})
    FAMILY.check_supported(cfg)
    tc = FAMILY.transformer_config_kwargs(cfg)
    assert tc["qk_norm_full_width"] and tc["moe_router_enable_expert_bias"] and tc["moe_router_topk"] == 8
    assert FAMILY.gpt_model_kwargs(cfg)["rotary_percent"] == 0.5
    assert list(minimax_m2.dropped_for_config(cfg)) == [r"model\.layers\.(62|63|64)\..*"]


@pytest.mark.parametrize(
    "field,value",
    [
        ("scoring_func", "softmax"),
        ("qk_norm_type", "per_head"),
        ("use_qk_norm", False),
        ("use_routing_bias", False),
        ("shared_intermediate_size", 256),
        ("attn_type_list", [0, 1]),
        ("routed_scaling_factor", 2.5),
        ("router_jitter_noise", 0.1),
        ("hidden_act", "gelu"),
        ("rotary_dim", 7),
        ("quantization_config", {"quant_method": "mxfp4"}),
    ],
)
def test_unsupported_field_is_refused_naming_it(tmp_path, field, value):
    """Refused before any conversion work: convert() reads config.json only (no shard exists)."""
    config = dict(minimax_m2.tiny_hf_config(vocab_size=301).to_dict(), **{field: value})
    if field == "rotary_dim":
        config.pop("rope_parameters")
    (tmp_path / "config.json").write_text(json.dumps(config))
    with pytest.raises(UnsupportedConfigError) as err:
        convert(tmp_path, tmp_path / "mcore")
    assert field.split("_")[0] in str(err.value) and field in str(err.value).replace("partial_rotary_factor", "")


@pytest.fixture(scope="module")
def fp8_source(tmp_path_factory):
    """A tiny MiniMax-M2 saved as the release is: FP8 blocks with `weight_scale_inv` for the
    attention and expert projections (router, bias, norms, embeddings, lm_head in bf16), the
    release's quantization_config, and MTP module tensors after the decoder layers."""
    tmp = tmp_path_factory.mktemp("minimax_fp8")
    cfg = minimax_m2.tiny_hf_config(vocab_size=300, num_hidden_layers=1)
    with cpu_compat.suspended():
        torch.manual_seed(0)
        FAMILY.hf_model_class(cfg).to(torch.bfloat16).save_pretrained(str(tmp / "bf16"))
    tensors = load_file(str(tmp / "bf16" / "model.safetensors"))
    quantised, expected = {}, {}
    for name, t in tensors.items():
        if t.dim() == 2 and ("self_attn" in name or ".experts." in name):
            q, s = fp8.quantize_blocks(t)
            quantised[name], quantised[fp8.scale_name(name)] = q, s
            expected[name] = fp8.dequantize_blocks(q, s)
        else:
            quantised[name] = t
    mtp = {  # layer N = 1: an MTP module (its layout is not documented; any tensors there are dropped)
        "model.layers.1.enorm.weight": torch.ones(128, dtype=torch.bfloat16),
        "model.layers.1.self_attn.q_proj.weight": torch.zeros(128, 128, dtype=torch.bfloat16),
    }
    (tmp / "fp8").mkdir()
    save_file({**quantised, **mtp}, str(tmp / "fp8" / "model.safetensors"))
    config = json.loads((tmp / "bf16" / "config.json").read_text())
    config.update(
        num_mtp_modules=1,
        use_mtp=True,
        mtp_transformer_layers=1,
        quantization_config={
            "activation_scheme": "dynamic",
            "fmt": "float8_e4m3fn",
            "quant_method": "fp8",
            "weight_block_size": [128, 128],
            "modules_to_not_convert": ["gate", "e_score_correction_bias", "lm_head"],
        },
    )
    (tmp / "fp8" / "config.json").write_text(json.dumps(config))
    return tmp, expected, set(mtp)


def test_fp8_source_with_mtp_converts_dequantised(fp8_source, capsys):
    tmp, expected, mtp = fp8_source
    convert(tmp / "fp8", tmp / "mcore")
    log = capsys.readouterr().out
    assert "not converting 2 HF tensor(s) (MiniMax-M2 MTP modules (num_mtp_modules=1" in log, log
    export(tmp / "mcore", tmp / "out", dtype="bf16")
    out = {}
    for f in (tmp / "out").glob("*.safetensors"):
        out.update(load_file(str(f)))
    assert not any(n.endswith("_scale_inv") for n in out) and not (set(out) & mtp)
    assert all(torch.equal(out[n], expected[n]) for n in expected), "dequantised weights changed"
    assert "quantization_config" not in json.loads((tmp / "out" / "config.json").read_text())


def test_quickstart_model_and_export_carry_the_release_fields_engines_read(tmp_path):
    """vLLM reads `rotary_dim` and `scoring_func` (the release's config.json has both; transformers'
    class writes neither): the tiny model writes them, with `auto_map` and its modules, and the
    export keeps them; transformers loads the export through those modules."""
    from pathlib import Path

    from transformers import AutoModelForCausalLM

    from moe_sft.conversion.convert import convert
    from moe_sft.conversion.export import export
    from moe_sft.quickstart_model import create_tiny_hf

    create_tiny_hf(tmp_path / "hf", Path("recipes/demo/tokenizer"), family="minimax_m2")
    convert(tmp_path / "hf", tmp_path / "mcore")
    export(tmp_path / "mcore", tmp_path / "out", dtype="fp32")
    out = json.loads((tmp_path / "out" / "config.json").read_text())
    assert out == json.loads((tmp_path / "hf" / "config.json").read_text())
    assert (out["rotary_dim"], out["scoring_func"], out["attn_type_list"]) == (16, "sigmoid", [1, 1])
    assert out["auto_map"]["AutoModelForCausalLM"] == "modeling_minimax_m2.MiniMaxM2ForCausalLM"
    with cpu_compat.suspended():
        model = AutoModelForCausalLM.from_pretrained(str(tmp_path / "out"), trust_remote_code=True)
    assert type(model).__module__.endswith("modeling_minimax_m2")
