"""Layer-wise verification (`--verify-layers`) on tiny random models of every family: each chosen
layer matches transformers' own decoder-layer module in fp32, as the whole-model logit check does;
a converted checkpoint whose tensors differ from the HF source in one layer fails that layer and
no other; only the layer being compared is ever materialised on either side; the CLI's lines and
exit codes.

Each family has a dense and an MoE layer where it has dense layers (Qwen3-MoE `mlp_only_layers`,
DeepSeek-V3 `first_k_dense_replace`); DeepSeek-V3 and Qwen3-Next have one MTP layer
(tests/deepseek_mtp.py, tests/qwen3_next_mtp.py: Qwen3-Next's stored as `mtp.layers.0.*`).
"""

from __future__ import annotations

import json
import shutil
import sys
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file, save_file

REPO = Path(__file__).resolve().parents[2]
if str(REPO) not in sys.path:  # as tests/cpu/test_conversion.py: run from outside the repo too
    sys.path.insert(0, str(REPO))

from moe_sft.conversion import verify as verify_module  # noqa: E402
from moe_sft.conversion.convert import convert  # noqa: E402
from moe_sft.conversion.verify import choose_layers, verify, verify_layers  # noqa: E402
from moe_sft.models import registry  # noqa: E402
from moe_sft.runtime import cpu_compat  # noqa: E402
from tests.deepseek_mtp import write_tiny_deepseek_with_mtp  # noqa: E402
from tests.qwen3_next_mtp import write_tiny_with_mtp  # noqa: E402
from tests.scripts import load_tool  # noqa: E402

FAMILIES = [f.name for f in registry.FAMILIES]
VOCAB = 300
# fp32 on CPU, measured: max abs diff 2.1e-6..3.6e-6 per layer (output scales 4.9..8.4), at most
# 7.3e-7 of the layer's output scale; whole-model logits 2.9e-6..4.6e-6.
LAYER_TOL = 1e-5
LOGIT_TOL = 1e-4
CLI_TOL = 1e-3  # the tool's default --tolerance; a corrupted layer is far beyond it
# Weights 5x the configs' 0.02: attention then depends on positions enough that a rope the
# conversion got wrong shows (DeepSeek's MLA at 0.02: theta x2 gave only 1.1e-3 of the scale).
INIT_STD = 0.1
# (layer index, kind) of every layer of the tiny models below
LAYERS = {
    "qwen3_moe": [(0, "dense"), (1, "moe")],
    "mixtral": [(0, "moe"), (1, "moe")],
    "deepseek_v3": [(0, "dense"), (1, "moe"), (2, "mtp 0 (moe)")],
    "kimi_k2": [(0, "dense"), (1, "moe")],
    "glm4_moe": [(0, "dense"), (1, "moe")],
    "gpt_oss": [(0, "moe"), (1, "moe")],
    # Gated DeltaNet x 3, then gated attention; `auto` compares layers 0 and 3 (and Qwen3-Next's
    # MTP layer, gated attention too)
    "qwen3_next": [
        (0, "linear attention, moe"),
        (1, "linear attention, moe"),
        (2, "linear attention, moe"),
        (3, "moe"),
        (4, "mtp 0 (moe)"),
    ],
    "qwen3_5_moe": [
        (0, "linear attention, moe"),
        (1, "linear attention, moe"),
        (2, "linear attention, moe"),
        (3, "moe"),
    ],
    "minimax_m2": [(0, "moe"), (1, "moe")],
    "gemma4": [(0, "moe"), (1, "moe")],  # sliding, then full (k-eq-v, wider heads)
}


def _write_hf(name: str, path: Path) -> None:
    if name == "deepseek_v3":  # layer 0 dense, layer 1 MoE, layer 2 the MTP layer
        write_tiny_deepseek_with_mtp(path, VOCAB, initializer_range=INIT_STD)
        return
    if name == "qwen3_next":  # the release's MTP module, `mtp.*`
        write_tiny_with_mtp(name, path, VOCAB, initializer_range=INIT_STD)
        return
    family = registry.family_by_name(name)
    overrides = {"mlp_only_layers": [0]} if name == "qwen3_moe" else {}  # Mixtral: all MoE
    overrides["initializer_range"] = INIT_STD
    with cpu_compat.suspended():
        torch.manual_seed(0)
        family.hf_model_class(family.tiny_hf_config(vocab_size=VOCAB, **overrides)).save_pretrained(str(path))


@pytest.fixture(scope="module", params=FAMILIES)
def converted(request, tmp_path_factory):
    tmp = tmp_path_factory.mktemp(request.param)
    _write_hf(request.param, tmp / "hf")
    convert(tmp / "hf", tmp / "mcore")
    return request.param, tmp


def test_every_layer_matches_transformers_as_the_whole_model_does(converted):
    name, tmp = converted
    results = verify_layers(tmp / "hf", tmp / "mcore", "all")
    for r in results:
        print(f"{name}: {r.line(LAYER_TOL)}")
    assert [(r.layer, r.kind) for r in results] == LAYERS[name]
    # the delta rule's chunked recurrence sums fp32 roundings over a document (measured 1.2e-5 at scale 4)
    abs_tol = 5e-5 if name in ("qwen3_next", "qwen3_5_moe") else LAYER_TOL
    assert all(r.max_abs_diff <= abs_tol and r.rel_diff <= LAYER_TOL for r in results)
    assert all(r.scale > 1e-2 for r in results)  # the layers do add something to the residual
    assert all(r.experts_routed[0] >= 1 for r in results if "moe" in r.kind)
    logits = verify(tmp / "hf", tmp / "mcore")
    print(f"{name}: whole-model max abs logit diff {logits:.3e}")
    assert logits <= (5 * LOGIT_TOL if abs_tol != LAYER_TOL else LOGIT_TOL)  # hybrid: measured 1.1e-4


# ------------------------------------------------------------------------------------------------
# A converted checkpoint that differs from its HF source in one layer
# ------------------------------------------------------------------------------------------------


def _edit_hf(path: Path, edit) -> None:
    """Apply `edit(tensors)` (in place, name → tensor) to the safetensors files of an HF dir."""
    for file in sorted(path.glob("*.safetensors")):
        tensors = load_file(str(file))
        edit(tensors)
        save_file(tensors, str(file), metadata={"format": "pt"})


def _swap_experts(layer: int, names: tuple[str, ...], experts: int = 8):
    """Experts swapped pairwise (0↔1, 2↔3, ...): whichever experts the tokens reach, they get another
    expert's weights (DeepSeek's bias-steered router reaches 2-3 of the 8 on random inputs)."""
    return _swap_experts_named(f"model.layers.{layer}.", names, experts)


def _swap_experts_named(prefix: str, names: tuple[str, ...], experts: int = 8):
    def edit(tensors):
        for name in names:
            for e in range(0, experts, 2):
                a, b = (f"{prefix}{name}".format(e=i) for i in (e, e + 1))
                if a in tensors:  # the shard that holds the layer
                    tensors[a], tensors[b] = tensors[b], tensors[a]

    return edit


def _scale(name: str, factor: float):
    def edit(tensors):
        if name in tensors:
            tensors[name] = tensors[name] * factor

    return edit


def _flip_experts(name: str):
    def edit(tensors):
        if name in tensors:
            tensors[name] = tensors[name].flip(0)

    return edit


_GATE_UP_DOWN = (
    "mlp.experts.{e}.gate_proj.weight",
    "mlp.experts.{e}.up_proj.weight",
    "mlp.experts.{e}.down_proj.weight",
)
CORRUPTIONS = {  # family → [(description, edit, the layer it must fail)]
    "qwen3_moe": [
        ("experts swapped in the MoE layer", _swap_experts(1, _GATE_UP_DOWN), 1),
        ("o_proj scaled by 1.05 in the dense layer", _scale("model.layers.0.self_attn.o_proj.weight", 1.05), 0),
    ],
    "mixtral": [
        (
            "experts swapped in layer 1",
            _swap_experts(1, tuple(f"block_sparse_moe.experts.{{e}}.{w}.weight" for w in ("w1", "w2", "w3"))),
            1,
        )
    ],
    "deepseek_v3": [
        ("experts swapped in the MTP layer", _swap_experts(2, _GATE_UP_DOWN), 2),
        ("kv_b_proj scaled by 1.05 in the MoE layer", _scale("model.layers.1.self_attn.kv_b_proj.weight", 1.05), 1),
        ("dense down_proj scaled by 1.05", _scale("model.layers.0.mlp.down_proj.weight", 1.05), 0),
    ],
    "kimi_k2": [
        ("experts swapped in the MoE layer", _swap_experts(1, _GATE_UP_DOWN), 1),
        ("kv_b_proj scaled by 1.05 in the dense layer", _scale("model.layers.0.self_attn.kv_b_proj.weight", 1.05), 0),
    ],
    "glm4_moe": [
        ("experts swapped in the MoE layer", _swap_experts(1, _GATE_UP_DOWN), 1),
        ("o_proj scaled by 1.05 in the dense layer", _scale("model.layers.0.self_attn.o_proj.weight", 1.05), 0),
    ],
    "gpt_oss": [  # experts stacked in one tensor per layer: the sinks and a stack's expert order instead
        ("sinks scaled by 1.5 in the full-attention layer", _scale("model.layers.1.self_attn.sinks", 1.5), 1),
        ("experts reversed in the sliding-window layer", _flip_experts("model.layers.0.mlp.experts.down_proj"), 0),
    ],
    "qwen3_5_moe": [  # layers 0-2 Gated DeltaNet (separate projections), layer 3 gated attention
        ("in_proj_z scaled by 1.05 in layer 2", _scale("model.layers.2.linear_attn.in_proj_z.weight", 1.05), 2),
        ("v_proj scaled by 1.05 in the attention layer 3", _scale("model.layers.3.self_attn.v_proj.weight", 1.05), 3),
    ],
    "qwen3_next": [  # layers 0-2 Gated DeltaNet, layer 3 gated attention, 4 the MTP layer (`mtp.layers.0`)
        ("the GDN's A_log shifted in layer 1", _scale("model.layers.1.linear_attn.A_log", 1.5), 1),
        ("o_proj scaled by 1.05 in the attention layer 3", _scale("model.layers.3.self_attn.o_proj.weight", 1.05), 3),
        ("experts swapped in the MTP layer", _swap_experts_named("mtp.layers.0.", _GATE_UP_DOWN), 4),
    ],
    "minimax_m2": [
        (
            "experts swapped in layer 1",
            _swap_experts(1, tuple(f"block_sparse_moe.experts.{{e}}.{w}.weight" for w in ("w1", "w2", "w3"))),
            1,
        ),
        ("o_proj scaled by 1.05 in layer 0", _scale("model.layers.0.self_attn.o_proj.weight", 1.05), 0),
    ],
    "gemma4": [  # experts stacked in one tensor per layer, as gpt-oss's
        ("experts reversed in the sliding layer", _flip_experts("model.layers.0.experts.down_proj"), 0),
        # (a common factor on the routed weights, e.g. every per_expert_scale x1.5, the experts' post-norm undoes)
        ("router logits x2 in the full layer", _scale("model.layers.1.router.proj.weight", 2.0), 1),
        # (q, k, v and the attention output are each RMS-normed: a factor on a projection vanishes)
        ("q_norm x1.5 in the full layer", _scale("model.layers.1.self_attn.q_norm.weight", 1.5), 1),
    ],
}


def test_a_corrupted_layer_fails_and_only_it(converted):
    """As if the conversion had produced the wrong tensors: the HF source is edited after converting."""
    name, tmp = converted
    for what, edit, bad_layer in CORRUPTIONS[name]:
        source = tmp / "corrupt"
        shutil.rmtree(source, ignore_errors=True)
        shutil.copytree(tmp / "hf", source)
        _edit_hf(source, edit)
        results = verify_layers(source, tmp / "mcore", "all")
        lines = "\n".join(r.line(CLI_TOL) for r in results)
        print(f"{name}, {what}:\n{lines}")
        assert [r.layer for r in results if not r.passed(CLI_TOL)] == [bad_layer], f"{what}:\n{lines}"
        assert all(r.rel_diff <= LAYER_TOL for r in results if r.layer != bad_layer), lines


def test_a_bf16_checkpoint_is_compared_in_fp32(tmp_path):
    """Real checkpoints are bf16: both sides read bf16 tensors into fp32 layers (here Mixtral's
    layer-stacked checkpoint keys: all its layers are alike)."""
    family = registry.family_by_name("mixtral")
    with cpu_compat.suspended():
        torch.manual_seed(0)
        model = family.hf_model_class(family.tiny_hf_config(vocab_size=VOCAB, initializer_range=INIT_STD))
        model.to(torch.bfloat16).save_pretrained(str(tmp_path / "hf"))
    assert convert(tmp_path / "hf", tmp_path / "mcore")["params_dtype"] == "bf16"
    results = verify_layers(tmp_path / "hf", tmp_path / "mcore", "all")
    assert [r.layer for r in results] == [0, 1]
    assert all(r.rel_diff <= LAYER_TOL for r in results), [r.line(LAYER_TOL) for r in results]


def test_a_rope_the_conversion_got_wrong_fails_every_layer(converted):  # every attention layer
    """The converted checkpoint's config says rope_theta=10000; the HF source now says 20000."""
    name, tmp = converted
    source = tmp / "rope"
    shutil.rmtree(source, ignore_errors=True)
    shutil.copytree(tmp / "hf", source)
    config = json.loads((source / "config.json").read_text())
    rope = config.get("rope_parameters") or config
    per_layer_type = [v for v in rope.values() if isinstance(v, dict) and "rope_theta" in v]  # Gemma 4
    for params in per_layer_type or [rope]:
        params["rope_theta"] = 2 * params.get("rope_theta", 10000.0)
    (source / "config.json").write_text(json.dumps(config))
    results = verify_layers(source, tmp / "mcore", "all")
    lines = "\n".join(r.line(CLI_TOL) for r in results)
    print(f"{name}, rope_theta x2 in the HF source:\n{lines}")
    roped = [r for r in results if "linear attention" not in r.kind]  # Gated DeltaNet has no rope
    assert roped and not any(r.passed(CLI_TOL) for r in roped), lines
    assert all(r.passed(CLI_TOL) for r in results if r not in roped), lines


# ------------------------------------------------------------------------------------------------
# Memory: one layer at a time
# ------------------------------------------------------------------------------------------------


def test_only_the_compared_layer_is_ever_materialised(converted, monkeypatch):
    name, tmp = converted
    seen = []
    load_ours, load_theirs = verify_module._load_megatron_layer, verify_module._HFLayers._load

    def ours(model, prefix, reader):
        layer = load_ours(model, prefix, reader)
        real = [n for n, p in model.named_parameters() if not p.is_meta]
        seen.append(("ours", prefix, real))
        return layer

    def theirs(self, index, names):
        layer = load_theirs(self, index, names)
        real = [n for n, p in self.model.named_parameters() if not p.is_meta]
        seen.append(("theirs", f"model.layers.{index}.", real))
        return layer

    monkeypatch.setattr(verify_module, "_load_megatron_layer", ours)
    monkeypatch.setattr(verify_module._HFLayers, "_load", theirs)
    verify_layers(tmp / "hf", tmp / "mcore", "auto")
    # auto: every layer of the tiny models, but of the hybrid ones layer 0 (Gated DeltaNet), 3
    # (attention) and Qwen3-Next's MTP layer
    assert len(seen) == 2 * {"qwen3_next": 3, "qwen3_5_moe": 2}.get(name, len(LAYERS[name]))
    for side, prefix, real in seen:
        assert real and all(n.startswith(prefix) for n in real), (side, prefix, real[:5])


# ------------------------------------------------------------------------------------------------
# Layer choice and the command line
# ------------------------------------------------------------------------------------------------


def test_choose_layers():
    qwen, deepseek = registry.family_by_name("qwen3_moe"), registry.family_by_name("deepseek_v3")
    cfg = qwen.tiny_hf_config(num_hidden_layers=5, mlp_only_layers=[0, 1])
    assert choose_layers(qwen, cfg, "auto") == [0, 2, 4]  # first dense, first MoE, last
    assert choose_layers(qwen, qwen.tiny_hf_config(num_hidden_layers=3), "auto") == [0, 2]  # no dense
    assert choose_layers(qwen, cfg, "all") == [0, 1, 2, 3, 4]
    assert choose_layers(qwen, cfg, " 3,1,3 ") == [1, 3]
    ds = deepseek.tiny_hf_config(num_hidden_layers=4, first_k_dense_replace=2, num_nextn_predict_layers=2)
    assert choose_layers(deepseek, ds, "auto") == [0, 2, 3, 4]  # + the first MTP layer (index N)
    assert choose_layers(deepseek, ds, "all") == [0, 1, 2, 3, 4, 5]
    assert choose_layers(deepseek, ds, "5") == [5]
    for bad in ("6", "-1", "x", "", "1,,z"):
        with pytest.raises(
            ValueError,
            match=r"use auto, all or comma-separated layer indices in \[0, 6\) "
            r"\(4..5 are the MTP layers\)",
        ):
            choose_layers(deepseek, ds, bad)


def _load_tool(script: str):
    return load_tool(script)


def test_cli_prints_a_line_per_layer_and_exits_1_beyond_tolerance(tmp_path, capsys):
    tool = _load_tool("convert_hf_to_mcore.py")
    _write_hf("qwen3_moe", tmp_path / "hf")
    capsys.readouterr()  # transformers' save progress bar
    args = ["--hf-path", str(tmp_path / "hf"), "--output", str(tmp_path / "m"), "--overwrite"]
    # an index past the model is refused before anything is converted
    assert tool.main(args + ["--verify-layers", "0,7"]) == 2
    err = capsys.readouterr().err
    assert err.startswith("error: --verify-layers '0,7': use auto, all or comma-separated layer indices in [0, 2)")
    assert not (tmp_path / "m").exists()
    assert tool.main(args + ["--verify-layers"]) == 0
    out = capsys.readouterr().out
    assert "layer 0 (dense): max abs diff" in out and "layer 1 (moe): max abs diff" in out
    assert out.count(" ok\n") == 2 and "experts routed 8/8" in out
    # a tolerance below fp32's rounding: every layer fails, the status is 1 and the error names them
    assert tool.main(args + ["--verify-layers", "1", "--tolerance", "0"]) == 1
    captured = capsys.readouterr()
    assert "layer 1 (moe)" in captured.out and "FAIL (> 0)" in captured.out
    assert "layer 0 " not in captured.out
    assert "error:" in captured.err and "layer(s) 1 differ from transformers' qwen3_moe" in captured.err
