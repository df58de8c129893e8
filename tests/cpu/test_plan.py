"""The pre-flight planner: recipes plan at their world size, impossible layouts fail with the
values and the fix, the memory model matches real models built by our builder, the dry run prints
every rank's role without torch.distributed, checkpoints are checked, and the slurm scripts hold
together (with fake srun / scontrol / torchrun)."""

from __future__ import annotations

import functools
import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path
from types import SimpleNamespace

import pytest
import torch

from moe_sft.config import ConfigError, load_config
from moe_sft.config import layout as config_layout
from moe_sft.plan import make_plan
from moe_sft.plan.layout import Layout, chunk_layers, rank_coords
from moe_sft.plan.shapes import known_models, load_shape, shape_from_hf_dict

REPO = Path(__file__).resolve().parents[2]
RECIPES = sorted(p.stem for p in (REPO / "recipes").glob("*.yaml"))
PRODUCTION = ("deepseek_v3", "qwen3_235b_a22b", "qwen3_30b_a3b", "mixtral_8x7b", "mixtral_8x22b")
# Production recipes with no GPU calibration layout yet (benchmarks/gpu/plan_calibration.py).
UNCALIBRATED = ("deepseek_v3_1", "kimi_k2", "glm4_5", "glm4_5_air", "minimax_m2", "gemma4_26b_a4b")
# Hybrid Gated DeltaNet recipes: (recipe, model config under recipes/models/); Qwen3.5's configs are
# the releases' text_config, hence a name of their own.
HYBRID = (
    ("qwen3_next_80b_a3b", "qwen3_next_80b_a3b"),
    ("qwen3_5_35b_a3b", "qwen3_5_35b_a3b_text"),
    ("qwen3_5_122b_a10b", "qwen3_5_122b_a10b_text"),
    ("qwen3_5_397b_a17b", "qwen3_5_397b_a17b_text"),
)


@functools.cache
def _recipe(name: str, *overrides: str):
    """A composed recipe (cached: Hydra's compose takes ~0.5 s; plans do not mutate configs)."""
    return load_config(["--config-path", str(REPO / "recipes"), "--config-name", name, *overrides])


# ----------------------------------------------------------------------------- recipes


@pytest.mark.parametrize("name", RECIPES)
def test_every_recipe_plans_and_fits_at_its_declared_world_size(name, monkeypatch):
    monkeypatch.chdir(REPO)
    monkeypatch.delenv("WORLD_SIZE", raising=False)
    cfg = _recipe(name)
    plan = make_plan(cfg)
    assert plan.layout.world == cfg.hardware.nodes * cfg.hardware.gpus_per_node
    assert not plan.errors, plan.errors
    assert plan.fits and plan.largest.total < plan.gpu_mem_gib * 2**30


def test_a_lora_run_plans_its_mtp_layer_frozen_and_not_run(monkeypatch):
    """As trainer/assemble.multi_token_prediction: LoRA adapts the decoder, the MTP layer stays frozen."""
    from moe_sft.plan import training_of

    monkeypatch.chdir(REPO)
    monkeypatch.delenv("WORLD_SIZE", raising=False)
    full, lora = _recipe("qwen3_5_35b_a3b_h200"), _recipe("qwen3_5_35b_a3b_lora_h200")
    assert load_shape("qwen3_5_35b_a3b_text")[0].mtp_layers == 1
    assert full.model.mtp_loss_weight > 0 and lora.model.mtp_loss_weight > 0 and not lora.model.freeze_mtp
    lay = make_plan(full).layout
    assert training_of(full, lay, "torch").mtp_trained and not training_of(lora, lay, "torch").mtp_trained


@pytest.mark.parametrize(("model", "fix"), [("qwen3_30b_a3b", "peft.fp8_base=true (52.0 GiB)"), ("gpt_oss_20b", None)])
def test_one_gpu_lora_recipes_take_what_the_planner_says_fits(model, fix, monkeypatch):
    """Issue 46: the whole model's LoRA on one H200 with the base in bf16; on one H100 the bf16 base
    does not fit, the planner names the single changes that do (each planned), and the H100 recipe
    keeps its base in FP8, one of them."""
    from moe_sft.plan import what_fits

    monkeypatch.chdir(REPO)
    monkeypatch.delenv("WORLD_SIZE", raising=False)
    h200, h100 = make_plan(_recipe(f"{model}_lora_1gpu_h200")), make_plan(_recipe(f"{model}_lora_1gpu"))
    for plan in (h200, h100):
        assert plan.layout.world == 1 and plan.fits and plan.cfg.peft.method == "lora"
        assert plan.shape.num_layers == load_shape(model)[0].num_layers  # every layer, not a reduced stack
    assert not h200.cfg.peft.fp8_base and h100.cfg.peft.fp8_base
    bf16 = make_plan(_recipe(f"{model}_lora_1gpu", "peft.fp8_base=false"))
    assert not bf16.fits
    fits, short = what_fits(bf16)
    assert any(f.startswith("peft.fp8_base=true (") for f in fits), fits
    assert fix is None or fix in fits
    assert any(s.startswith("optimizer.optimizer_cpu_offload=true") for s in short), short  # the base dominates
    (error,) = [e for e in bf16.errors if e.startswith("[memory]")]
    assert "fits with " + " | ".join(fits) in error


def test_optimizer_offload_plans_with_its_measured_fragmentation(monkeypatch):
    """Offload churns the allocator more (measured reserved/allocated 1.12 vs 1.01-1.03 on H200 with
    expandable segments): its total counts 15% over allocated, not 10%, and the report says which."""
    from moe_sft.plan import memory
    from moe_sft.plan.plan_text import format_plan

    monkeypatch.chdir(REPO)
    monkeypatch.delenv("WORLD_SIZE", raising=False)
    offloaded = make_plan(_recipe("mixtral_8x7b_h200"))
    on_gpu = make_plan(_recipe("mixtral_8x7b_h200", "optimizer.optimizer_cpu_offload=false"))
    overhead = memory.RUNTIME_OVERHEAD_GIB * memory.GIB
    assert offloaded.largest.optimizer_offloaded > 0 and on_gpu.largest.optimizer_offloaded == 0
    assert offloaded.largest.total == pytest.approx(offloaded.largest.allocated * 1.15 + overhead)
    assert on_gpu.largest.total == pytest.approx(on_gpu.largest.allocated * 1.10 + overhead)
    assert "allocated x 1.15 + 1.5 GiB" in format_plan(offloaded)


def test_production_models_have_h100_and_h200_recipes_with_hf_config():
    for model in PRODUCTION + UNCALIBRATED:
        base, h200 = _recipe(model), _recipe(f"{model}_h200")
        assert base.hardware.gpu == "h100_80gb" and h200.hardware.gpu == "h200_141gb"
        assert base.model.hf_config == model and model in known_models()
        assert (REPO / "recipes" / "slurm" / f"{model}.sbatch").is_file()


def test_hybrid_models_have_h100_and_h200_recipes_and_their_own_sbatch():
    for recipe, config in HYBRID:
        base, h200 = _recipe(recipe), _recipe(f"{recipe}_h200")
        assert base.hardware.gpu == "h100_80gb" and h200.hardware.gpu == "h200_141gb"
        assert base.model.hf_config == h200.model.hf_config == config and config in known_models()
        text = (REPO / "recipes" / "slurm" / f"{recipe}.sbatch").read_text()
        for piece in (
            f"#SBATCH --nodes={base.hardware.nodes}",
            f"--nodes={h200.hardware.nodes} --export=ALL,RECIPE={recipe}_h200",
            f"RECIPE:-{recipe}",
            "#SBATCH --requeue",
            "#SBATCH --signal=B:USR1@",
            "convert.sbatch",
            "train_common.sh",
        ):
            assert piece in text, (recipe, piece)
        assert f"recipes/slurm/{recipe}.sbatch" in (REPO / "recipes" / f"{recipe}.yaml").read_text()


def test_shipped_configs_match_the_families_translation():
    """Shapes read as plain JSON agree with transformers + our family's TransformerConfig kwargs."""
    from moe_sft.conversion.hf_source import load_hf_config
    from moe_sft.models import registry
    from moe_sft.plan.params import total_params
    from moe_sft.plan.shapes import SUPPORTED_MODEL_TYPES

    assert sorted(SUPPORTED_MODEL_TYPES) == registry.supported_model_types()
    billions = {
        "deepseek_v3": 682.6,
        "qwen3_235b_a22b": 235.1,
        "qwen3_30b_a3b": 30.5,
        "mixtral_8x7b": 46.7,
        "mixtral_8x22b": 140.6,
        "deepseek_v3_1": 682.6,
        "kimi_k2": 1026.4,
        "glm4_5": 356.8,
        "glm4_5_air": 109.2,
        "minimax_m2": 228.7,
        "gpt_oss_20b": 20.9,
        "gpt_oss_120b": 116.8,
        "qwen3_next_80b_a3b": 81.3,
        "qwen3_5_35b_a3b_text": 35.5,
        "qwen3_5_122b_a10b_text": 124.6,
        "qwen3_5_397b_a17b_text": 402.9,
        "gemma4_26b_a4b": 25.2,  # the language model of the VL release (its text_config), as transformers counts it
    }  # DeepSeek-V3(.1): 671B + the MTP layer (its embedding/head shared); GLM-4.5(-Air): + 1 MTP layer;
    # Qwen3-Next / Qwen3.5: + 1 MTP layer (embedding / head shared), without Qwen3.5's vision tower
    for name in known_models():
        family, hf = load_hf_config(REPO / "recipes" / "models" / name)
        kw = family.transformer_config_kwargs(hf)
        shape, _ = load_shape(name)
        assert shape.num_layers == kw["num_layers"] and shape.hidden == kw["hidden_size"]
        assert shape.num_experts == kw["num_moe_experts"] and shape.topk == kw["moe_router_topk"]
        assert shape.moe_ffn == kw["moe_ffn_hidden_size"] and shape.num_kv_heads == kw["num_query_groups"]
        assert list(shape.moe_layers) == [bool(x) for x in kw.get("moe_layer_freq", [1] * shape.num_layers)]
        assert shape.mtp_layers == (kw.get("mtp_num_layers") or 0)
        assert abs(total_params(shape) / 1e9 - billions[name]) < 0.1


# ----------------------------------------------------------------------------- impossible layouts


def _errors(name: str, gpus: int, *overrides: str) -> str:
    plan = make_plan(_recipe(name, *overrides), gpus=gpus)
    assert plan.errors, "expected the planner to refuse this layout"
    return "\n".join(plan.errors)


def test_ep_must_fit_the_ranks_of_one_pipeline_stage():
    msg = _errors(
        "qwen3_235b_a22b",
        64,
        "parallel.pipeline_model_parallel_size=16",
        "parallel.virtual_pipeline_model_parallel_size=null",
        "parallel.expert_model_parallel_size=32",
        "parallel.num_layers_in_first_pipeline_stage=null",
        "parallel.num_layers_in_last_pipeline_stage=null",
    )
    assert "expert_model_parallel_size=32" in msg and "pipeline_model_parallel_size=16" in msg
    assert "world_size=64" in msg and "world_size/pp=4" in msg


def test_tp_must_divide_the_key_value_heads_of_every_layer():
    """Gemma 4: TP4 divides the sliding layers' 8 key/value heads, not the full layers' 2."""
    msg = _errors(
        "gemma4_26b_a4b_h200",
        8,
        "parallel.tensor_model_parallel_size=4",
        "parallel.sequence_parallel=true",
        "parallel.expert_model_parallel_size=2",
    )
    assert "tensor_model_parallel_size=4 does not divide the key/value heads of some layers" in msg
    assert "(num_global_key_value_heads)=2; use one of 1, 2" in msg


def test_heads_layers_and_memory_errors_name_values_and_fix():
    msg = _errors(
        "qwen3_235b_a22b_h200",
        64,
        "parallel.tensor_model_parallel_size=8",
        "parallel.sequence_parallel=true",
        "parallel.expert_model_parallel_size=8",
    )
    assert "tensor_model_parallel_size=8 does not divide num_query_groups=4" in msg and "use one of 1, 2, 4" in msg
    msg = _errors(
        "qwen3_235b_a22b_h200",
        64,
        "parallel.num_layers_in_first_pipeline_stage=null",
        "parallel.num_layers_in_last_pipeline_stage=null",
        "parallel.pipeline_model_parallel_size=8",
        "parallel.expert_model_parallel_size=8",
    )
    assert "pipeline_model_parallel_size=8 does not divide num_layers=94" in msg
    assert "num_layers_in_last_pipeline_stage=" in msg  # the uneven split that would work
    msg = _errors(
        "deepseek_v3",
        8,
        "parallel.pipeline_model_parallel_size=1",
        "parallel.expert_model_parallel_size=8",
        "parallel.num_layers_in_first_pipeline_stage=null",
        "parallel.num_layers_in_last_pipeline_stage=null",
    )
    assert "[memory] stage 0 needs" in msg and "GiB per GPU, more than the 79.1 GiB" in msg


def test_expert_width_must_split_over_etp(tmp_path):
    cfg = json.loads((REPO / "recipes/models/mixtral_8x7b/config.json").read_text())
    cfg["intermediate_size"] = 14340  # not a multiple of 8
    (tmp_path / "config.json").write_text(json.dumps(cfg))
    msg = _errors("mixtral_8x7b", 16, f"model.hf_config={tmp_path}", "parallel.expert_tensor_parallel_size=8")
    assert "expert_tensor_parallel_size (null = TP)=8 does not divide the moe_intermediate_size=14340" in msg


# ----------------------------------------------------------------------------- layout replicas vs megatron


def test_layers_and_rank_coordinates_match_megatron():
    from megatron.core.parallel_state import RankGenerator
    from megatron.core.transformer.transformer_block import get_num_layers_to_build
    from megatron.core.transformer.transformer_layer import get_transformer_layer_offset

    for layers, pp, vpp, first, last in [
        (8, 2, None, None, None),
        (8, 2, 2, None, None),
        (94, 4, None, 23, 23),
        (94, 4, 2, 24, 22),
        (61, 8, None, 8, 5),
        (12, 4, 3, None, None),
        (10, 3, None, 4, None),
        (10, 3, None, None, 2),
    ]:
        cfg = SimpleNamespace(
            pipeline_model_parallel_size=pp,
            virtual_pipeline_model_parallel_size=vpp,
            num_layers_in_first_pipeline_stage=first,
            num_layers_in_last_pipeline_stage=last,
            num_layers=layers,
            pipeline_model_parallel_layout=None,
            account_for_embedding_in_pipeline_split=False,
            account_for_loss_in_pipeline_split=False,
        )
        lay = Layout(world=pp, tp=1, pp=pp, vpp=vpp, cp=1, ep=1, etp=1, first=first, last=last)
        for r in range(pp):
            for v in range(vpp or 1):
                vs = v if vpp else None
                start = get_transformer_layer_offset(cfg, vp_stage=vs, pp_rank=r)
                want = range(start, start + get_num_layers_to_build(cfg, vp_stage=vs, pp_rank=r))
                assert chunk_layers(layers, lay, r, v) == want, (layers, pp, vpp, first, last, r, v)
    for world, tp, pp, cp, ep, etp in [
        (16, 2, 2, 1, 4, 1),
        (64, 1, 4, 1, 16, 1),
        (32, 2, 2, 2, 2, 2),
        (8, 1, 2, 1, 2, 2),
    ]:
        lay = Layout(world=world, tp=tp, pp=pp, vpp=None, cp=cp, ep=ep, etp=etp)
        dense = RankGenerator(tp=tp, ep=1, dp=lay.dp, pp=pp, cp=cp, order="tp-cp-ep-dp-pp")
        expert = RankGenerator(tp=etp, ep=ep, dp=lay.edp, pp=pp, cp=1, order="tp-cp-ep-dp-pp")
        for gen, token, key in [
            (dense, "tp", "tp"),
            (dense, "pp", "pp"),
            (dense, "dp", "dp"),
            (dense, "cp", "cp"),
            (expert, "ep", "ep"),
            (expert, "tp", "etp"),
            (expert, "dp", "edp"),
        ]:
            for group in gen.get_ranks(token):
                assert [rank_coords(r, lay)[key] for r in group] == list(range(len(group))), (token, group)


# ----------------------------------------------------------------------------- memory model vs real models


def _reset_world() -> None:
    import torch.distributed as dist
    from megatron.core import parallel_state

    if parallel_state.model_parallel_is_initialized():
        parallel_state.destroy_model_parallel()
    if dist.is_initialized():
        dist.destroy_process_group()


def build_rank(
    family,
    hf,
    rank,
    world,
    tp=1,
    pp=1,
    vpp=None,
    ep=1,
    etp=None,
    first=None,
    last=None,
    dispatcher="auto",
    recompute=None,
):
    """The model chunks of `rank` of a `world`-rank layout, built in this process: torch's 'fake'
    process group (collectives are no-ops) under megatron's parallel state."""
    import torch.distributed as dist
    from megatron.core import parallel_state, tensor_parallel
    from torch.testing._internal.distributed.fake_pg import FakeStore

    from moe_sft.models.builder import ModelOptions, build_model_chunks, build_transformer_config

    _reset_world()
    dist.init_process_group("fake", store=FakeStore(), rank=rank, world_size=world)
    parallel_state.initialize_model_parallel(
        tensor_model_parallel_size=tp,
        pipeline_model_parallel_size=pp,
        virtual_pipeline_model_parallel_size=vpp,
        expert_model_parallel_size=ep,
        expert_tensor_parallel_size=etp,
        create_gloo_process_groups=False,
    )
    tensor_parallel.model_parallel_cuda_manual_seed(1)
    extra = {
        k: v
        for k, v in (("num_layers_in_first_pipeline_stage", first), ("num_layers_in_last_pipeline_stage", last))
        if v is not None
    }
    opts = ModelOptions(
        precision="bf16",
        backend="torch",
        device="cpu",
        transformer=dict(
            tensor_model_parallel_size=tp,
            pipeline_model_parallel_size=pp,
            virtual_pipeline_model_parallel_size=vpp,
            expert_model_parallel_size=ep,
            expert_tensor_parallel_size=tp if etp is None else etp,
            sequence_parallel=tp > 1,
            moe_token_dispatcher_type=dispatcher,
            recompute_granularity=recompute,
            **extra,
        ),
    )
    config = build_transformer_config(family, hf, opts)
    return build_model_chunks(family, hf, config, opts)


@pytest.fixture(scope="module")
def fake_world():
    from moe_sft.kernels import install as kernels_install
    from moe_sft.runtime import device as rdevice

    rdevice.prepare_runtime(rdevice.RuntimeChoice("cpu", "fp32", "torch", ()))
    kernels_install.install()
    _reset_world()  # a group left by another test module
    yield build_rank
    _reset_world()


def test_parameter_counts_per_rank_are_exact(fake_world):
    from moe_sft.models import deepseek_v3, gemma4, glm4_moe, gpt_oss, kimi_k2, minimax_m2, mixtral, qwen3_moe
    from moe_sft.plan.params import stage_params

    # Gemma 4: sliding and full layers of their own dims (k-eq-v on the full ones, one with its own v)
    gemma4_types = ["sliding_attention", "full_attention", "sliding_attention", "full_attention"]

    cases = [
        (
            deepseek_v3.FAMILY,
            deepseek_v3.tiny_hf_config(num_nextn_predict_layers=1, num_hidden_layers=4),
            8,
            dict(tp=2, pp=2, ep=2, etp=1),
        ),
        (
            deepseek_v3.FAMILY,
            deepseek_v3.tiny_hf_config(num_hidden_layers=4, q_lora_rank=None),
            8,
            dict(tp=2, pp=2, vpp=2, ep=2, etp=2),
        ),
        (
            qwen3_moe.FAMILY,
            qwen3_moe.tiny_hf_config(num_hidden_layers=8, tie_word_embeddings=True, mlp_only_layers=[1]),
            8,
            dict(pp=4, vpp=2, ep=2, first=2, last=2),
        ),
        (mixtral.FAMILY, mixtral.tiny_hf_config(num_hidden_layers=2), 4, dict(tp=2, ep=2, etp=2)),
        (glm4_moe.FAMILY, glm4_moe.tiny_hf_config(num_hidden_layers=4), 8, dict(tp=2, pp=2, ep=2, etp=1)),
        (minimax_m2.FAMILY, minimax_m2.tiny_hf_config(num_hidden_layers=2), 4, dict(tp=2, ep=2, etp=2)),
        (kimi_k2.FAMILY, kimi_k2.tiny_hf_config(num_hidden_layers=4), 8, dict(tp=2, pp=2, ep=2, etp=1)),
        (gpt_oss.FAMILY, gpt_oss.tiny_hf_config(num_hidden_layers=4), 8, dict(tp=2, pp=2, ep=2, etp=1)),
        (
            gemma4.FAMILY,
            gemma4.tiny_hf_config(num_hidden_layers=4, layer_types=gemma4_types, num_global_key_value_heads=2),
            8,
            dict(tp=2, pp=2, ep=2, etp=1),
        ),
        (
            gemma4.FAMILY,
            gemma4.tiny_hf_config(num_hidden_layers=2, attention_k_eq_v=False, tie_word_embeddings=False),
            4,
            dict(ep=2, etp=1),
        ),
    ]
    for family, hf, world, par in cases:
        shape = shape_from_hf_dict(hf.to_dict())
        lay = Layout(
            world=world,
            tp=par.get("tp", 1),
            pp=par.get("pp", 1),
            vpp=par.get("vpp"),
            cp=1,
            ep=par.get("ep", 1),
            etp=par.get("etp") or par.get("tp", 1),
            first=par.get("first"),
            last=par.get("last"),
        )
        for stage in range(lay.pp):
            rank = stage * (world // lay.pp)
            chunks = fake_world(family, hf, rank, world, **par)
            dense = sum(p.numel() for c in chunks for p in c.parameters() if getattr(p, "allreduce", True))
            expert = sum(p.numel() for c in chunks for p in c.parameters() if not getattr(p, "allreduce", True))
            count = stage_params(shape, lay, stage)
            assert (count.dense, count.expert) == (dense, expert), (family.name, par, stage)


class _FlashLike:
    """Stands in for flash_attn_varlen_func on CPU: saves what the flash kernel saves (q, k, v, out, lse)."""

    @staticmethod
    def apply(q, k, v, *args, **kwargs):
        import torch

        class Fn(torch.autograd.Function):
            @staticmethod
            def forward(ctx, q, k, v):
                out = torch.empty_like(q)
                ctx.save_for_backward(q, k, v, out, torch.empty(q.shape[0], q.shape[1]))
                return out

        return Fn.apply(q, k, v)


def _saved_bytes_by_scope(model, tokens: int) -> dict:
    """Bytes of the storages autograd saves, by the decoder layer (int) that first saved them, or
    'decoder' for the block itself (full recompute saves each layer's input there)."""
    import torch

    from moe_sft.models.forward import packed_batch

    stack, seen = ["top"], {}
    hooks = [m.register_forward_pre_hook(lambda m, a, n=n: stack.append(n) and None) for n, m in model.named_modules()]
    hooks += [m.register_forward_hook(lambda m, a, o: stack.pop() and None) for _, m in model.named_modules()]
    params = {p.untyped_storage().data_ptr() for p in model.parameters()}

    def pack(t):
        seen.setdefault(t.untyped_storage().data_ptr(), (stack[-1], t.untyped_storage().nbytes()))
        return t

    ids, pos, psp = packed_batch([list(range(1, tokens // 2 + 1))] * 2)
    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        model(input_ids=ids, position_ids=pos, attention_mask=None, packed_seq_params=psp)
    for h in hooks:
        h.remove()
    out: dict = {}
    for ptr, (name, nbytes) in seen.items():
        key = int(name.split(".")[2]) if name.startswith("decoder.layers.") else name
        if ptr not in params:
            out[key] = out.get(key, 0) + nbytes
    return out


# megatron's fused SwiGLU is torch.compile'd on GPU, where the planner's numbers apply; eager saves
# one more tensor. The CPU compat turns compile off (torch's config.patch restores that on exit;
# pytest's monkeypatch would delete the flag: tests/cpu/test_test_hygiene.py), and a compile that
# failed earlier in this process (e.g. under test_flops' FlopCounterMode) leaves it eager
# (torch._dynamo.reset() below): undo both.
@torch._dynamo.config.patch(disable=False)
def test_activation_formula_matches_saved_tensors(fake_world, monkeypatch):
    """Per layer, the planner's activation bytes = what autograd keeps in our layer spec (bf16),
    with the flash kernel's saves (q, k, v, out, lse) standing in for the CUDA kernel (our RMSNorm
    saves the same on CPU as on CUDA: input and 1/rms)."""
    from moe_sft.layers import attention
    from moe_sft.models import deepseek_v3, mixtral, qwen3_moe
    from moe_sft.plan import memory

    torch._dynamo.reset()
    monkeypatch.setattr(attention, "flash_attn_varlen_func", _FlashLike.apply)
    monkeypatch.setattr(
        attention.VarlenCoreAttention,
        "_thd",
        lambda self, q, k, v, cu, n: attention._varlen_cuda(
            q, k, v, cu.to(torch.int32), cu.to(torch.int32), n, n, self.softmax_scale
        ),
    )
    cases = [  # (family, HF config, TP): GQA with qk-norm + a dense layer; GQA under TP2 + SP; MLA
        (qwen3_moe.FAMILY, qwen3_moe.tiny_hf_config(head_dim=48, mlp_only_layers=[1]), 1),
        (mixtral.FAMILY, mixtral.tiny_hf_config(head_dim=48, num_hidden_layers=1), 2),
        (deepseek_v3.FAMILY, deepseek_v3.tiny_hf_config(), 2),  # v padded to the q/k head dim; dense + MoE
    ]
    tokens = 256
    for family, hf, tp in cases:
        shape = shape_from_hf_dict(hf.to_dict())
        lay = Layout(world=tp, tp=tp, pp=1, vpp=None, cp=1, ep=1, etp=1)
        model = fake_world(family, hf, 0, tp, tp=tp, etp=1, dispatcher="alltoall")[0]
        for layer, measured in _saved_bytes_by_scope(model, tokens).items():
            if isinstance(layer, int):
                predicted = memory.layer_activation(shape, lay, tokens, shape.moe_layers[layer])
                # dense layers are exact; MoE layers keep router bytes per token the planner does not
                # itemize (DeepSeek's group-limited routing: ~60 B per token, 1.05% at this tiny width,
                # far less at real widths)
                assert abs(predicted / measured - 1) < 0.015, (family.name, tp, layer, predicted, measured)
        # full recompute: each layer keeps only its input, the hidden states of its SP slice (and
        # the block keeps the shared RoPE table)
        model = fake_world(family, hf, 0, tp, tp=tp, etp=1, dispatcher="alltoall", recompute="full")[0]
        saved = _saved_bytes_by_scope(model, tokens)
        inputs = shape.num_layers * (tokens // tp) * shape.hidden * 2
        assert not any(isinstance(k, int) for k in saved)
        assert inputs <= saved["decoder"] <= inputs + tokens * 64 * 4, (family.name, saved["decoder"], inputs)


# ----------------------------------------------------------------------------- dry run


def test_dry_run_prints_every_rank_without_torch_distributed(tmp_path):
    code = (
        "import sys; from moe_sft.train import main; rc = main(sys.argv[1:]); "
        "td = sys.modules.get('torch.distributed'); "
        "print('DIST_INITIALISED', bool(td and td.is_initialized())); sys.exit(rc)"
    )
    env = {k: v for k, v in os.environ.items() if k not in ("WORLD_SIZE", "RANK")}
    env["CUDA_VISIBLE_DEVICES"] = ""
    proc = subprocess.run(
        [
            sys.executable,
            "-c",
            code,
            "--config-path",
            "recipes",
            "--config-name",
            "qwen3_235b_a22b_h200",
            "trainer.dry_run=true",
            "hardware.nodes=16",
        ],
        cwd=REPO,
        env=env,
        capture_output=True,
        text=True,
        timeout=120,
    )
    out = proc.stdout
    assert proc.returncode == 0, out + proc.stderr
    assert "DIST_INITIALISED False" in out and "no GPU touched" in out
    assert "TP1·PP4·EP16·ETP1·DP32 (expert DP 2)" in out  # 16 nodes x 8 = 128 ranks, faked
    rows = [line.split() for line in out.splitlines() if line.strip()[:1].isdigit() and "|" in line]
    assert [int(r[0]) for r in rows] == list(range(128))
    last = next(r for r in rows if r[0] == "127")  # node 15, pp stage 3, dp 31, ep 15: experts 120-127
    assert last[1:7] == ["15", "0", "3", "0", "31", "|"] and "120-127" in last and "[71-93]" in last
    assert rows[0][7:10] == ["0", "0", "0"] and "embedding" in rows[0]
    assert "lm" in " ".join(last)


# ----------------------------------------------------------------------------- checkpoints


def _fake_checkpoint(path: Path, model: str, **meta) -> Path:
    (path / "hf").mkdir(parents=True)
    for name in (".metadata", "metadata.json", "__0_0.distcp"):
        (path / name).write_text("x")
    hf = json.loads((REPO / "recipes/models" / model / "config.json").read_text())
    (path / "hf/config.json").write_text(json.dumps(hf))
    (path / "moe_sft_meta.json").write_text(
        json.dumps(
            dict(
                dict(
                    family=hf["model_type"], model_type=hf["model_type"], vocab_size=hf["vocab_size"], format_version=1
                ),
                **meta,
            )
        )
    )
    return path


def test_partial_corrupt_and_foreign_checkpoints_stop_before_gpu_work(tmp_path, monkeypatch):
    from moe_sft.conversion.mcore_io import checkpoint_problems
    from moe_sft.plan import preflight
    from moe_sft.plan.preflight import trainer_preflight
    from moe_sft.trainer.checkpoint import step_dir

    good = _fake_checkpoint(tmp_path / "good", "qwen3_30b_a3b")
    assert checkpoint_problems(good) == []
    assert checkpoint_problems(tmp_path / "absent") == []  # reported by the config validation
    (tmp_path / "absent.tmp").mkdir()  # what an interrupted conversion leaves
    assert "interrupted" in checkpoint_problems(tmp_path / "absent")[0]
    (good / ".metadata").unlink()
    assert ".metadata missing" in checkpoint_problems(good)[0]
    bare = tmp_path / "bare"
    bare.mkdir()
    assert "not a moe-sft checkpoint" in checkpoint_problems(bare)[0]
    mixed = _fake_checkpoint(tmp_path / "mixed", "qwen3_30b_a3b", vocab_size=32000)
    assert "mixes two models" in checkpoint_problems(mixed)[0]
    # a checkpoint of another model than the recipe's model.hf_config
    other = _fake_checkpoint(tmp_path / "other", "qwen3_30b_a3b")
    cfg = _recipe("qwen3_235b_a22b", f"model.mcore_path={other}", f"trainer.output_dir={tmp_path / 'run'}")
    with pytest.raises(ConfigError) as err:
        trainer_preflight(cfg)
    assert "num_layers=48 (expected 94)" in str(err.value) and "hidden=2048 (expected 4096)" in str(err.value)
    assert any("[checkpoint]" in e for e in make_plan(cfg).errors)
    # a resume pointer naming a missing step
    ckpts = tmp_path / "run2" / "checkpoints"
    ckpts.mkdir(parents=True)
    (ckpts / "latest").write_text("40")
    cfg = _recipe(
        "qwen3_30b_a3b",
        f"model.mcore_path={_fake_checkpoint(tmp_path / 'ok', 'qwen3_30b_a3b')}",
        f"trainer.output_dir={tmp_path / 'run2'}",
    )
    with pytest.raises(ConfigError, match="names step 40 but .*step_0000040 does not exist"):
        trainer_preflight(cfg)
    assert preflight._step_dir(ckpts, 40) == step_dir(ckpts, 40)


# ----------------------------------------------------------------------------- slurm scripts


SLURM = REPO / "recipes" / "slurm"
FAKES = {
    "scontrol": '#!/usr/bin/env bash\nif [ "$1 $2" = "show hostnames" ]; then printf "n1\\nn2\\n"; '
    'else echo "scontrol $*" >> "$FAKE_LOG"; [ "$1" = requeue ] && kill "$(cat "$FAKE_PID")"; fi\n',
    "srun": '#!/usr/bin/env bash\necho "srun $*" >> "$FAKE_LOG"\nwhile [ "${1#--}" != "$1" ]; do shift; done\nexec "$@"\n',
    "torchrun": '#!/usr/bin/env bash\necho $$ > "$FAKE_PID"\nprintf "torchrun" >> "$FAKE_LOG"\n'
    'printf " [%s]" "$@" >> "$FAKE_LOG"\necho >> "$FAKE_LOG"\n'
    # the trainer: at the STOP file it checkpoints, removes the file and exits 0
    "for i in $(seq $((${FAKE_SLEEP:-0} * 10))); do\n"
    '  if [ -e "$RUN_DIR/STOP" ]; then rm "$RUN_DIR/STOP"; echo stopped >> "$FAKE_LOG"; exit 0; fi\n'
    "  sleep 0.1\ndone\n",
}


def test_sbatch_scripts_parse_and_hold_the_required_pieces():
    common = (SLURM / "train_common.sh").read_text()
    for piece in (
        "srun --ntasks-per-node=1",
        "--rdzv_backend=c10d",
        "--rdzv_endpoint=$MASTER_ADDR:$MASTER_PORT",
        "scontrol requeue",
        "trap request_stop USR1",
        'touch "$RUN_DIR/STOP"',
        "python -m moe_sft.plan",
        "--strict",
        "NCCL_IB_TIMEOUT",
        "NCCL_SOCKET_IFNAME",
        "UCX_TLS",
        "TORCH_NCCL_ASYNC_ERROR_HANDLING",
        "trainer.output_dir=$RUN_DIR",
    ):
        assert piece in common, piece
    for script in sorted(SLURM.glob("*.sbatch")) + [SLURM / "train_common.sh"]:
        assert subprocess.run(["bash", "-n", str(script)]).returncode == 0, script
    assert "--workers" in (SLURM / "convert.sbatch").read_text()
    for model in PRODUCTION + UNCALIBRATED:
        text = (SLURM / f"{model}.sbatch").read_text()
        nodes = _recipe(model).hardware.nodes
        for piece in (
            f"#SBATCH --nodes={nodes}",
            "#SBATCH --requeue",
            "#SBATCH --signal=B:USR1@",
            "--open-mode=append",
            "#SBATCH --output=logs/",
            f"RECIPE:-{model}",
            f"RECIPE={model}_h200",
            "convert.sbatch",
            "train_common.sh",
        ):
            assert piece in text, (model, piece)


def _fake_slurm_env(tmp_path: Path, mcore: Path, **extra) -> dict:
    bin_dir = tmp_path / "bin"
    bin_dir.mkdir(exist_ok=True)
    for name, body in FAKES.items():
        (bin_dir / name).write_text(body)
        (bin_dir / name).chmod(0o755)
    data = tmp_path / "train.jsonl"
    data.write_text("{}\n")
    # a rendezvous left in the environment (another test's process group) would override the job's
    env = {
        k: v
        for k, v in os.environ.items()
        if k not in ("WORLD_SIZE", "RANK", "LOCAL_RANK", "MASTER_ADDR", "MASTER_PORT")
    }
    env.update(
        PATH=f"{bin_dir}:{env['PATH']}",
        FAKE_LOG=str(tmp_path / "fake.log"),
        FAKE_PID=str(tmp_path / "pid"),
        SLURM_JOB_ID="77",
        SLURM_NNODES="8",
        SLURM_JOB_NODELIST="n[1-8]",
        SLURM_SUBMIT_DIR=str(REPO),
        SLURM_JOB_NAME="sft-test",
        RUN_DIR=str(tmp_path / "run"),
        MCORE_PATH=str(mcore),
        DATA=str(data),
        RECIPE="qwen3_235b_a22b_h200",
        **extra,
    )
    return env


def test_sbatch_preflight_torchrun_and_requeue_with_fake_slurm(tmp_path):
    mcore = _fake_checkpoint(tmp_path / "mcore", "qwen3_235b_a22b")
    env = _fake_slurm_env(tmp_path, mcore, FAKE_SLEEP="60")
    proc = subprocess.Popen(
        ["bash", str(SLURM / "qwen3_235b_a22b.sbatch")],
        cwd=tmp_path,
        env=env,
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
    )
    log = tmp_path / "fake.log"
    deadline = time.time() + 90
    while time.time() < deadline and not (log.is_file() and "torchrun" in log.read_text()):
        time.sleep(0.3)
    proc.send_signal(signal.SIGUSR1)  # what --signal=B:USR1@600 sends before the time limit
    out = proc.communicate(timeout=60)[0]
    calls = log.read_text()
    assert "stopped" in calls and "scontrol requeue 77" in calls and "requeueing job 77" in out, out
    assert calls.index("stopped") < calls.index("scontrol requeue")  # requeue after the checkpoint
    argv = next(line for line in calls.splitlines() if line.startswith("torchrun"))
    for piece in (
        "[--nnodes=8]",
        "[--nproc_per_node=8]",
        "[--rdzv_endpoint=n1:20077]",
        "[--config-name]",
        "[qwen3_235b_a22b_h200]",
        f"[model.mcore_path={mcore}]",
        f"[trainer.output_dir={tmp_path / 'run'}]",
    ):
        assert piece in argv, (piece, argv)
    assert "-> fits" in (tmp_path / "run" / "plan-77.txt").read_text()


def test_sbatch_preflight_stops_a_job_whose_checkpoint_is_missing(tmp_path):
    env = _fake_slurm_env(tmp_path, tmp_path / "missing-mcore")
    proc = subprocess.run(
        ["bash", str(SLURM / "qwen3_235b_a22b.sbatch")],
        cwd=tmp_path,
        env=env,
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert proc.returncode != 0 and "model.mcore_path=" in proc.stdout + proc.stderr
    assert not (tmp_path / "fake.log").is_file() or "srun" not in (tmp_path / "fake.log").read_text()


# ----------------------------------------------------------------------------- GPU calibration script (CPU part)


def test_calibration_script_parses_logs_and_plans_its_layouts(tmp_path, capsys, monkeypatch):
    monkeypatch.delenv("WORLD_SIZE", raising=False)
    sys.path.insert(0, str(REPO / "benchmarks" / "gpu"))
    try:
        import plan_calibration as cal
    finally:
        sys.path.pop(0)
    log = (
        "step 1/4 loss=12 tokens_per_s=1000\nstep 2/4 loss=11 tokens_per_s=3000\nstep 3/4 loss=10 tokens_per_s=5000\n"
        "[moe-sft] peak memory per rank (GiB allocated/reserved): 0:10.00/12.00 1:11.50/13.00 2:20.25/22.00 3:19.00/21.00\n"
    )
    peaks = cal.parse_peaks(log)
    assert peaks == [(10.0, 12.0), (11.5, 13.0), (20.25, 22.0), (19.0, 21.0)]
    assert cal.stage_peaks(peaks, [0, 0, 1, 1]) == {0: (11.5, 13.0), 1: (20.25, 22.0)}
    assert cal.parse_steps(log)[3]["tokens_per_s"] == 5000
    breakdown = dict(weights=1, grads=2, optimizer=3, activations=4, working=1, logits=0.5)
    table = cal.markdown(
        [
            dict(
                name="x",
                gpus=2,
                status="ok",
                tokens_per_s=4000,
                stages=[
                    dict(
                        stage=0,
                        measured_gib=11.5,
                        reserved_gib=13.0,
                        predicted_gib=12.0,
                        fragmentation=0.15,
                        breakdown=breakdown,
                    )
                ],
            ),
            dict(name="y", gpus=4, status="timeout"),
        ],
        "H200",
    )
    assert "| x | 2 | 0 | 12.00 | 11.50 | +4.3% | 13.00 | 13.80 |" in table and "| y | 4 | | | timeout |" in table
    assert "Stages within 10%: 1/1" in table
    assert (
        cal.main(
            [
                "--dry-run",
                "--work",
                str(tmp_path),
                "--out",
                str(tmp_path),
                "--only",
                "qwen_pp2,mixtral_tp2_ep2,dsv3_pp2_ep2,recipe_qwen3_235b,recipe_mixtral_8x22b,"
                "recipe_deepseek_v3,recipe_qwen3_30b,recipe_mixtral_8x7b",
            ]
        )
        == 0
    )
    lines = [line for line in capsys.readouterr().out.splitlines() if line.startswith("[calibration]")]
    assert len(lines) == 8 and not any("ERRORS" in line for line in lines), lines
    assert "predicted GiB per stage 0:" in lines[0] and " 1:" in lines[0]  # two pipeline stages


def test_recipe_shard_layouts_give_each_gpu_the_recipe_s_local_experts_and_shapes():
    """The recipe_* calibration layouts stand in for the recipes on 2 GPUs: same local experts per
    GPU, same hidden / expert shapes and pack length, full recompute like the recipe."""
    from types import SimpleNamespace

    from moe_sft.models.hf_config import num_experts

    sys.path.insert(0, str(REPO / "benchmarks" / "gpu"))
    try:
        import plan_calibration as cal
    finally:
        sys.path.pop(0)
    assert sorted(cal.RECIPE_OF_LAYOUT.values()) == sorted(PRODUCTION)
    for layout, recipe_name in cal.RECIPE_OF_LAYOUT.items():
        model, gpus, overrides = cal.LAYOUTS[layout]
        shard = cal.MODELS[model][1]
        recipe = _recipe(recipe_name)
        full = json.loads((REPO / "recipes/models" / recipe_name / "config.json").read_text())
        opts = dict(o.split("=", 1) for o in overrides)
        ep = int(opts["parallel.expert_model_parallel_size"])
        assert num_experts(SimpleNamespace(**shard)) // ep == (
            num_experts(SimpleNamespace(**full)) // recipe.parallel.expert_model_parallel_size
        ), layout
        assert int(opts["data.pack_length"]) == recipe.data.pack_length, layout
        assert opts["model.recompute_granularity"] == recipe.model.recompute_granularity == "full", layout
        for key in (
            "hidden_size",
            "moe_intermediate_size",
            "intermediate_size",
            "num_attention_heads",
            "num_key_value_heads",
            "kv_lora_rank",
            "q_lora_rank",
        ):
            assert shard.get(key) == full.get(key), (layout, key)
        assert gpus == ep


# ----------------------------------------------------------------------------- LoRA / FP8 base


def test_lora_and_fp8_base_counts_per_rank_are_exact(fake_world):
    """Adapters (dense / per-expert), FP8 values and their block scales, and the frozen rest of
    real adapted models at a TP2·PP2·EP2 layout (MTP on the last stage, routers trained) equal
    the planner's per-stage terms."""
    from moe_sft.config.schema import PeftConfig
    from moe_sft.models import deepseek_v3
    from moe_sft.peft import fp8_base, install
    from moe_sft.plan.params import stage_params
    from moe_sft.plan.peft_memory import PeftPlan, stage

    hf = deepseek_v3.tiny_hf_config(num_nextn_predict_layers=1, num_hidden_layers=4, hidden_size=256)
    shape = shape_from_hf_dict(hf.to_dict())
    par = dict(tp=2, pp=2, ep=2, etp=1)
    lay = Layout(world=8, tp=2, pp=2, vpp=None, cp=1, ep=2, etp=1)
    for targets_, share in ((("all_linear",), "none"), (("attention", "experts"), "a")):
        cfg = PeftConfig(method="lora", rank=4, target_modules=list(targets_), share_expert_factor=share)
        cfg.train_router, cfg.fp8_base = True, True
        plan = PeftPlan(rank=4, target_modules=targets_, share_expert_factor=share, fp8_base=True, train_router=True)
        for pp_rank in range(2):
            chunks = fake_world(deepseek_v3.FAMILY, hf, pp_rank * 4, 8, **par)
            install.add_adapters(chunks, cfg, chunks[0].config, "cpu")
            fp8_base.install(chunks)
            params = [(n, p) for c in chunks for n, p in c.named_parameters()]
            trained = [p for _, p in params if p.requires_grad]
            dense = sum(p.numel() for p in trained if getattr(p, "allreduce", True))
            expert = sum(p.numel() for p in trained if not getattr(p, "allreduce", True))
            fp8_values = sum(b.numel() for c in chunks for _, b in c.named_buffers() if b.dtype == fp8_base.FP8)
            scales = sum(b.numel() for c in chunks for n, b in c.named_buffers() if n.endswith(fp8_base.SCALE))
            adapters = sum(p.numel() for n, p in params if ".adapter." in n)
            count = stage_params(shape, lay, pp_rank)
            embeddings = count.by_module.get("embedding", 0) + count.by_module.get("output_layer", 0)
            st = stage(shape, lay, pp_rank, plan, count.total, embeddings)
            assert (st.dense, st.expert, st.adapters) == (dense, expert, adapters), (targets_, pp_rank)
            assert (st.fp8_values, st.fp8_scales) == (fp8_values, scales), (targets_, pp_rank)
            frozen_rest = sum(p.numel() for n, p in params if p.dtype != fp8_base.FP8 and ".adapter." not in n)
            assert count.total - st.fp8_values == frozen_rest  # routers (trained) included
            assert st.base_bytes == 2 * (frozen_rest - st.trained_base) + fp8_values + 4 * scales


def test_lora_and_dora_counts_on_the_hybrid_mixers_are_exact(fake_world):
    """The planner's adapters on Qwen3-Next's and Qwen3.5's mixers (Gated DeltaNet in_proj with one
    A per transformers projection, out_proj; the gated attention's q with its gate rows) and
    shared experts at TP2·PP2 equal real adapted models'; and on Gemma 4's per-layer attention
    (sliding layers [q, k, v], k-eq-v full layers [q, k] with wider heads) and its dense MLP."""
    from moe_sft.config.schema import PeftConfig
    from moe_sft.models import gemma4, qwen3_5_moe, qwen3_next
    from moe_sft.peft import install
    from moe_sft.plan.params import stage_params
    from moe_sft.plan.peft_memory import PeftPlan, stage

    lay = Layout(world=4, tp=2, pp=2, vpp=None, cp=1, ep=1, etp=1)
    gemma4_types = ["sliding_attention", "full_attention", "sliding_attention", "full_attention"]
    cases = [(f, f.tiny_hf_config()) for f in (qwen3_next.FAMILY, qwen3_5_moe.FAMILY)] + [
        (
            gemma4.FAMILY,
            gemma4.tiny_hf_config(num_hidden_layers=4, layer_types=gemma4_types, num_global_key_value_heads=2),
        )
    ]
    for family, hf in cases:
        shape = shape_from_hf_dict(hf.to_dict())
        for method in ("lora", "dora"):
            entries = ("attention", "shared_experts")
            cfg = PeftConfig(method=method, rank=4, target_modules=list(entries))
            plan = PeftPlan(rank=4, method=method, target_modules=entries)
            for pp_rank in range(2):
                chunks = fake_world(family, hf, pp_rank * 2, 4, tp=2, pp=2, etp=1)
                install.add_adapters(chunks, cfg, chunks[0].config, "cpu")
                adapters = sum(p.numel() for c in chunks for n, p in c.named_parameters() if ".adapter." in n)
                count = stage_params(shape, lay, pp_rank)
                embeddings = count.by_module.get("embedding", 0) + count.by_module.get("output_layer", 0)
                st = stage(shape, lay, pp_rank, plan, count.total, embeddings)
                assert st.adapters == adapters, (family.name, method, pp_rank, st.by_module)


def test_lora_memory_terms_for_a_small_config():
    """weights = frozen base (FP8 values + 4-byte scales + bf16 rest) + bf16 adapters; grads = 4 x
    trainable; optimizer = 12 x (dense / DP + per-expert / expert DP); FP8 dequantisation adds
    one layer's largest weight (bf16, + its fp32 temporaries) to the working set."""
    from moe_sft.models import deepseek_v3
    from moe_sft.plan import memory
    from moe_sft.plan.params import stage_params
    from moe_sft.plan.peft_memory import PeftPlan

    hf = deepseek_v3.tiny_hf_config(num_hidden_layers=3, hidden_size=256)
    shape = shape_from_hf_dict(hf.to_dict())
    lay = Layout(world=4, tp=1, pp=1, vpp=None, cp=1, ep=2, etp=1)  # DP 4, expert DP 2
    full = memory.Training(tokens=64, micro_batches=2)
    lora = memory.Training(tokens=64, micro_batches=2, peft=PeftPlan(rank=4, target_modules=("all_linear",)))
    fp8 = memory.Training(
        tokens=64, micro_batches=2, peft=PeftPlan(rank=4, target_modules=("all_linear",), fp8_base=True)
    )
    a, b, c = (memory.stage_memory(shape, lay, 0, t) for t in (full, lora, fp8))
    total = stage_params(shape, lay, 0).total
    # By hand (rank 4): MLA per layer q_down 1280 + q_up 1024 + kv_down 1216 + kv_up 1152 + proj 1536
    # = 6208 (x3); dense fc1 (gate, up) 4096 + fc2 2048; shared experts 2560 + 1280 (x2); experts
    # 4 per rank (8 / EP2) x (A1 1024 + A2 256 + B1 512 + B2 1024) = 11264 (x2).
    st = c.peft
    assert (st.dense, st.expert) == (3 * 6208 + 6144 + 2 * 3840, 2 * 11264) == (32_448, 22_528)
    assert st.adapters == b.peft.adapters == 54_976
    # FP8: 3 x 81920 attention + 196608 dense + 2 x 49152 shared + 2 x 4 x 3 x 256 x 64 experts;
    # 128x128 blocks: 3 x 10 + 12 + 2 x 4 + 2 x 4 x (2 + 2)
    assert (st.fp8_values, st.fp8_scales) == (933_888, 82)
    assert b.weights == 2 * total + 2 * st.adapters
    assert c.weights == 2 * (total - 933_888) + 933_888 + 4 * 82 + 2 * st.adapters
    assert b.grads == c.grads == 4 * st.adapters < a.grads
    assert c.optimizer == b.optimizer == 12 * (32_448 / 4 + 22_528 / 2)
    assert (b.activations, b.logits) == (c.activations, c.logits)
    # full SFT's experts hold the allgather's static rows (kernels/permute.py), adapted ones do not
    padding = memory.static_rows_padding(shape, lay, full)
    assert padding == 2.0 and memory.static_rows_padding(shape, lay, lora) == 1.0
    # above the gathered-token bound only a graphed MoE half keeps them (it needs the static size)
    long = memory.Training(tokens=2 * config_layout.STATIC_ROWS_MAX_GATHERED * lay.cp, micro_batches=2)
    graphed = memory.Training(tokens=long.tokens, micro_batches=2, cuda_graphs=True)
    assert memory.static_rows_padding(shape, lay, long) == 1.0 < memory.static_rows_padding(shape, lay, graphed) == 2.0
    assert memory.stage_memory(shape, lay, 0, lora, imbalance=padding).activations == a.activations > b.activations
    assert a.logits == b.logits
    largest = 512 * 256  # the dense fc1 (and one rank's experts' w1: 4 x 256 x 128)
    assert c.working - b.working == 2 * largest + 4 * largest


def test_deepseek_v3_lora_fits_one_h200_node_and_says_what_h100_needs(monkeypatch):
    monkeypatch.chdir(REPO)
    monkeypatch.delenv("WORLD_SIZE", raising=False)
    h200 = make_plan(_recipe("deepseek_v3_lora_h200"))
    assert h200.layout.world == 8 and h200.cfg.peft.fp8_base and h200.ok, h200.errors
    assert h200.largest.peft.fp8_values > 80e9  # 671B / EP8 in FP8, no bf16 copy
    bf16 = make_plan(_recipe("deepseek_v3_lora_h200", "peft.fp8_base=false"))
    assert not bf16.fits  # the bf16 base alone is ~170 GiB per GPU
    one_h100_node = make_plan(_recipe("deepseek_v3_lora_h200", "hardware.gpu=h100_80gb"))
    assert not one_h100_node.fits
    h100 = make_plan(_recipe("deepseek_v3_lora"))
    assert h100.layout.world == 16 and h100.cfg.hardware.gpu == "h100_80gb" and h100.ok, h100.errors


def test_deepseek_v3_lora_sbatch_matches_its_recipes():
    text = (SLURM / "deepseek_v3_lora.sbatch").read_text()
    assert subprocess.run(["bash", "-n", str(SLURM / "deepseek_v3_lora.sbatch")]).returncode == 0
    h200, h100 = _recipe("deepseek_v3_lora_h200"), _recipe("deepseek_v3_lora")
    for piece in (
        f"#SBATCH --nodes={h200.hardware.nodes}",
        f"--nodes={h100.hardware.nodes} --export=ALL,RECIPE=deepseek_v3_lora ",
        "RECIPE:-deepseek_v3_lora_h200",
        "#SBATCH --requeue",
        "#SBATCH --signal=B:USR1@",
        "convert.sbatch",
        "train_common.sh",
    ):
        assert piece in text, piece


class _FlaLike:
    """CPU stand-ins for fla-core 0.6.0's three kernels that save for backward what fla's autograd
    Functions save (their inputs made contiguous by fla's input guard), with fla's shapes and dtypes:
    causal_conv1d keeps x; chunk_gated_delta_rule keeps q, k after its L2 norm and their fp32 1/norm,
    v, the fp32 decay cumsum g, raw beta and g inputs, fp32 sigmoid(beta), A [T, H, 64];
    rms_norm_gated keeps x, the gate and an fp32 1/rms per row."""

    @staticmethod
    def conv(x, weight, activation=None, **document_bounds):
        class Fn(torch.autograd.Function):
            @staticmethod
            def forward(ctx, x):
                ctx.save_for_backward(x.contiguous())
                return torch.zeros_like(x)

        return (Fn.apply(x),)

    @staticmethod
    def chunk_indices(cu, chunk):
        """fla's (document, chunk within it) pairs: host-side bookkeeping, nothing kept for backward."""
        counts = ((cu[1:] - cu[:-1] + chunk - 1) // chunk).tolist()
        return torch.tensor([[d, c] for d, n in enumerate(counts) for c in range(n)], dtype=cu.dtype)

    @staticmethod
    def delta_rule(q, k, v, g, beta, **kwargs):
        class Fn(torch.autograd.Function):
            @staticmethod
            def forward(ctx, q, k, v, g, beta):
                t, hv = v.shape[1], v.shape[2]
                f32 = dict(dtype=torch.float32)
                ctx.save_for_backward(
                    q.contiguous().clone(),
                    torch.empty(q.shape[:-1], **f32),
                    k.contiguous().clone(),
                    torch.empty(k.shape[:-1], **f32),
                    v.contiguous(),
                    torch.empty(g.shape, **f32),
                    beta.contiguous(),
                    torch.empty(beta.shape, **f32),
                    torch.empty(1, t, hv, 64, dtype=v.dtype),
                    g.contiguous(),
                )
                return torch.zeros_like(v)

        return Fn.apply(q, k, v, g, beta), None

    @staticmethod
    def norm(x, gate, weight, bias, activation=None, eps=1e-6):
        class Fn(torch.autograd.Function):
            @staticmethod
            def forward(ctx, x, gate):
                ctx.save_for_backward(x.contiguous(), gate.contiguous(), torch.empty(x.shape[:-1]))
                return torch.zeros_like(x)

        return Fn.apply(x, gate)


def test_gdn_activation_formula_matches_what_fla_kernels_keep(fake_world, monkeypatch):
    """A Gated DeltaNet mixer's planned activation bytes (memory.gdn_activation, the fla CUDA path)
    = what autograd keeps in our layer (bf16, TP1 and TP2 + SP) with fla's kernels standing in as
    saving what they save: the layer's own tensors (in_proj's input, the conv input, the copies of
    in_proj's slices, the norm's and out_proj's inputs) are measured, the kernels' saves itemised.
    The input norm is left out: Qwen3.5's zero-centred norm is the family's, not the mixer's."""
    from moe_sft.layers import gated_delta_net as gdn
    from moe_sft.models import qwen3_5_moe
    from moe_sft.models.forward import packed_batch
    from moe_sft.plan import memory

    monkeypatch.setattr(gdn, "_use_fla", lambda t: True)
    monkeypatch.setattr(gdn, "fla_causal_conv1d", _FlaLike.conv)
    monkeypatch.setattr(gdn, "fla_chunk_gated_delta_rule", _FlaLike.delta_rule)
    monkeypatch.setattr(gdn, "fla_rms_norm_gated", _FlaLike.norm)
    monkeypatch.setattr(gdn, "fla_chunk_indices", _FlaLike.chunk_indices)
    hf = qwen3_5_moe.tiny_hf_config(num_hidden_layers=2, layer_types=["linear_attention", "full_attention"])
    shape = shape_from_hf_dict(hf.to_dict())
    assert shape.is_linear_layer(0) and not shape.is_linear_layer(1)
    tokens = 256
    for tp in (1, 2):
        lay = Layout(world=tp, tp=tp, pp=1, vpp=None, cp=1, ep=1, etp=1)
        model = fake_world(qwen3_5_moe.FAMILY, hf, 0, tp, tp=tp, etp=1, dispatcher="alltoall")[0]
        mixer = model.decoder.layers[0].self_attention
        assert isinstance(mixer, gdn.GatedDeltaNet)
        names = {id(m) for m in mixer.modules()}
        params = {p.untyped_storage().data_ptr() for p in model.parameters()}
        stack, seen = [False], {}
        hooks = [m.register_forward_pre_hook(lambda m, a: stack.append(id(m) in names)) for m in model.modules()]
        hooks += [m.register_forward_hook(lambda m, a, o: (stack.pop(), None)[1]) for m in model.modules()]

        def pack(t):
            ptr = t.untyped_storage().data_ptr()
            if stack[-1] and ptr not in params:
                seen.setdefault(ptr, t.untyped_storage().nbytes())
            return t

        ids, pos, psp = packed_batch([list(range(1, tokens // 2 + 1))] * 2)
        with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
            model(input_ids=ids, position_ids=pos, attention_mask=None, packed_seq_params=psp)
        for h in hooks:
            h.remove()
        tsp = tokens // tp if tp > 1 else tokens
        predicted = memory.gdn_activation(shape, lay, tokens) - memory._norm(tsp, shape.hidden)
        assert predicted == sum(seen.values()), (tp, predicted, sum(seen.values()))
        full = memory.layer_activation(shape, lay, tokens, True, linear=True)
        assert full == memory.gdn_activation(shape, lay, tokens) + memory.mlp_activation(shape, lay, tokens, True)


def test_gemma4_attention_activations_take_each_layers_dims():
    """Gemma 4's full layers (wider heads, their own key/value heads, K as V) saved bytes: the
    per-layer path equals the uniform one at that layer's dims, and K-as-V saves exactly the V
    projection's output."""
    import dataclasses

    from moe_sft.models import gemma4
    from moe_sft.plan import memory

    types = ["sliding_attention", "full_attention"]
    lay, t = Layout(world=1, tp=1, pp=1, vpp=None, cp=1, ep=1, etp=1), 256
    for k_eq_v in (False, True):
        hf = gemma4.tiny_hf_config(num_hidden_layers=2, layer_types=types, attention_k_eq_v=k_eq_v)
        shape = shape_from_hf_dict(hf.to_dict())
        sliding, full = shape.attention_of(0), shape.attention_of(1)
        assert full.head_dim > sliding.head_dim and full.k_eq_v == k_eq_v and not sliding.k_eq_v
        for layer, dims in ((0, sliding), (1, full)):
            uniform = dataclasses.replace(
                shape, head_dim=dims.head_dim, num_kv_heads=dims.num_kv_heads, attention_layers=None
            )
            v_output = t * dims.num_kv_heads * dims.head_dim * 2 if dims.k_eq_v else 0
            assert memory.attention_activation(shape, lay, t, None, layer) == (
                memory.attention_activation(uniform, lay, t, None) - v_output
            )
