"""Exports of a LoRA/DoRA run's checkpoint (adapters only, on a converted base), fp32 on CPU:

- merged (conversion/adapter_merge.py through conversion/export.py): transformers' own model class
  loading the exported directory gives our adapted model's logits;
- as a PEFT adapter (moe_sft/peft/hf_adapter.py): `PeftModel.from_pretrained(base, dir)` gives the
  merged model's logits (fused routed experts through peft's target_parameters, q/k/v and
  gate/up split from megatron's fused linears, MLA's projections, shared experts, dense layers,
  a shared expert factor, trained routers through modules_to_save, DoRA on the attention; the
  hybrid families' Gated DeltaNet in_proj as Qwen3-Next's in_proj_qkvz / in_proj_ba or Qwen3.5's
  in_proj_qkv / _z / _b / _a, its out_proj, and the gated attention's q_proj with its gate rows,
  also at a rank above the Gated DeltaNet gate projections' widths);
- an adapter peft cannot express (an MTP layer's) is an error naming the field and the fix, and
  the trainer's end-of-run export then writes the merged model and logs why there is no adapter.

The adapters get random nonzero B (and DoRA magnitudes off the row norms), so the delta is large.
"""

from __future__ import annotations

import json
import types
from pathlib import Path

import pytest
import torch

from moe_sft.config.schema import PeftConfig
from moe_sft.conversion import mcore_io
from moe_sft.conversion.convert import convert
from moe_sft.conversion.export import export, load_model_from_checkpoint
from moe_sft.models import registry
from moe_sft.models.forward import packed_logits
from moe_sft.peft import run_meta
from moe_sft.peft.hf_adapter import AdapterExportError, export_adapter
from moe_sft.peft.install import add_adapters, init_dora_magnitudes
from moe_sft.runtime import cpu_compat

VOCAB = 300
TOL = 1e-5  # fp32; measured below ~2e-6 (printed by each test)
DOCS = [[int(t) for t in torch.randint(0, VOCAB, (n,), generator=torch.Generator().manual_seed(n))] for n in (23, 9)]


def _write_base(family_name: str, tmp: Path) -> Path:
    family = registry.family_by_name(family_name)
    with cpu_compat.suspended():
        torch.manual_seed(0)
        model = family.hf_model_class(family.tiny_hf_config(vocab_size=VOCAB)).eval()
        for name, buf in model.named_buffers():
            if name.endswith("e_score_correction_bias"):
                buf.copy_(torch.randn_like(buf) * 0.5)
        model.save_pretrained(str(tmp / "hf"))
    convert(tmp / "hf", tmp / "mcore")
    return tmp


def _lora_run(base: Path, out: Path, cfg: PeftConfig, seed: int = 1):
    """Our model with adapters (random B; DoRA magnitudes and trained routers perturbed), saved as a
    LoRA run's checkpoint is (trainable entries, meta with peft/peft_base, hf/); its logits."""
    from megatron.core import dist_checkpointing

    from moe_sft.trainer.checkpoint import model_sharded_state

    model = load_model_from_checkpoint(base / "mcore").eval()
    add_adapters([model], cfg, model.config, "cpu")
    init_dora_magnitudes([model])
    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, param in model.named_parameters():
            if not param.requires_grad:
                continue
            noise = torch.randn(param.shape, generator=g)
            if ".lora_B" in name:
                param.copy_(noise * 0.1)
            elif "lora_magnitude" in name or "router" in name:
                param.mul_(1 + 0.2 * noise)
    ckpt = out / "checkpoints" / "step_0000001"
    ckpt.mkdir(parents=True)
    dist_checkpointing.save(model_sharded_state([model]), str(ckpt))
    meta = mcore_io.read_meta(base / "mcore") | run_meta.record(cfg, base / "mcore") | {"step": 1}
    mcore_io.write_meta(ckpt, meta)
    mcore_io.copy_hf_side_files(base / "mcore" / mcore_io.HF_SUBDIR, ckpt / mcore_io.HF_SUBDIR)
    with torch.no_grad():
        return ckpt, packed_logits(model, DOCS, VOCAB)


def _hf_logits(model) -> list[torch.Tensor]:
    with cpu_compat.suspended(), torch.no_grad():
        return [model(torch.tensor([d])).logits[0].float() for d in DOCS]


def _load_hf(path: Path):
    import transformers

    with cpu_compat.suspended():
        return transformers.AutoModelForCausalLM.from_pretrained(str(path), dtype=torch.float32).eval()


def _diff(a, b) -> float:
    return max((x - y).abs().max().item() for x, y in zip(a, b))


# gpt-oss: experts stacked in one tensor per layer, fc1 with gate and up columns interleaved;
# Qwen3-Next / Qwen3.5: Gated DeltaNet layers (in_proj_qkvz + in_proj_ba, or in_proj_qkv, _z, _b,
# _a, from one fused in_proj) and a gated attention layer (q_proj rows interleave query and gate)
@pytest.fixture(scope="module", params=["qwen3_moe", "deepseek_v3", "gpt_oss", "qwen3_next", "qwen3_5_moe"])
def base(request, tmp_path_factory):
    return _write_base(request.param, tmp_path_factory.mktemp(request.param))


# transformers' modules the adapters on the hybrid families' mixers (every case targets them) become
MIXER_TARGETS = {
    "qwen3_next": {"in_proj_qkvz", "in_proj_ba", "out_proj", "q_proj", "k_proj", "v_proj", "o_proj"},
    "qwen3_5_moe": {"in_proj_qkv", "in_proj_z", "in_proj_b", "in_proj_a", "out_proj", "q_proj", "k_proj", "v_proj"},
}

CASES = {
    # every linear and the routed experts, routers trained too (peft: modules_to_save)
    "lora_all_linear_router": PeftConfig(
        method="lora", rank=4, alpha=8.0, target_modules=["all_linear"], train_router=True
    ),
    # one A shared by a layer's experts (written per expert for peft)
    "lora_shared_a": PeftConfig(
        method="lora", rank=4, alpha=16.0, target_modules=["experts", "attention"], share_expert_factor="a"
    ),
    "dora_attention": PeftConfig(method="dora", rank=4, alpha=8.0, target_modules=["attention"]),
}


@pytest.mark.parametrize("case", CASES)
def test_merged_and_peft_exports_give_the_adapted_models_logits(base, case, tmp_path):
    _check_exports(base, CASES[case], case, tmp_path)


# Gemma 4: the full layer's linear_qkv has its own query groups and no v rows (k-eq-v); the trained
# router is one module holding scale, per_expert_scale and proj. Its logits reach 30 (the soft
# cap): measured 1.05e-5 merged vs ours.
@pytest.mark.parametrize("base", ["gemma4"], indirect=True)
@pytest.mark.parametrize("case", sorted(CASES))
def test_gemma4_exports_give_the_adapted_models_logits(base, case, tmp_path):
    _check_exports(base, CASES[case], case, tmp_path, tol=3e-5)


@pytest.mark.parametrize("base", sorted(MIXER_TARGETS), indirect=True)
@pytest.mark.parametrize("method", ["lora", "dora"])
def test_a_rank_above_the_gated_deltanet_gates_exports_exactly(base, method, tmp_path):
    """Rank 16 on the hybrid mixers: above the tiny Gated DeltaNet's gate widths (Qwen3.5's
    in_proj_b / in_proj_a: 4 rows, Qwen3-Next's in_proj_ba: 8), which do not cap the rank; the
    exports still give our adapted model's logits, peft's adapter at the one rank."""
    config = _check_exports(
        base, PeftConfig(method=method, rank=16, alpha=32.0, target_modules=["attention"]), method, tmp_path
    )
    assert config["r"] == 16 and not config.get("rank_pattern"), config


def _check_exports(base: Path, cfg: PeftConfig, case: str, tmp_path: Path, tol: float = TOL) -> dict:
    """Merged export == our adapted model, peft's adapter on transformers' model == merged; the
    adapter's config."""
    from peft import PeftModel

    ckpt, ours = _lora_run(base, tmp_path / "run", cfg)
    reference = _hf_logits(_load_hf(base / "hf"))
    assert _diff(ours, reference) > 1e-2  # the adapters change the model

    export(ckpt, tmp_path / "merged", dtype="fp32")
    merged = _hf_logits(_load_hf(tmp_path / "merged"))
    merged_diff = _diff(merged, ours)

    export_adapter(ckpt, tmp_path / "adapter", dtype="fp32")
    config = json.loads((tmp_path / "adapter" / "adapter_config.json").read_text())
    print(config["target_modules"], config.get("target_parameters"))
    written = {t.removesuffix(".weight").rpartition(".")[2] for t in config["target_modules"]}
    written |= {t.removesuffix(".weight").rpartition(".")[2] for t in config.get("target_parameters") or ()}
    assert MIXER_TARGETS.get(base.name.rstrip("0123456789"), set()) <= written, config
    with cpu_compat.suspended():
        peft_model = PeftModel.from_pretrained(_load_hf(base / "hf"), str(tmp_path / "adapter")).eval()
    peft_diff = _diff(_hf_logits(peft_model), merged)
    print(f"{base.name} {case}: merged vs ours {merged_diff:.2e}, peft vs merged {peft_diff:.2e}")
    assert merged_diff <= tol
    assert peft_diff <= tol
    return config


def test_an_adapter_peft_cannot_express_is_an_error_and_the_trainer_exports_merged(tmp_path, capfd):
    from moe_sft.trainer.trainer import Trainer
    from tests.deepseek_mtp import write_tiny_deepseek_with_mtp

    write_tiny_deepseek_with_mtp(tmp_path / "hf", VOCAB)
    convert(tmp_path / "hf", tmp_path / "mcore")
    target = "mtp.layers.0.transformer_layer.self_attention.linear_proj"
    cfg = PeftConfig(method="lora", rank=4, alpha=8.0, target_modules=[target])
    ckpt, _ = _lora_run(tmp_path, tmp_path / "run", cfg)
    with pytest.raises(AdapterExportError, match=r"peft\.target_modules=.*leave such modules out") as err:
        export_adapter(ckpt, tmp_path / "adapter")
    assert target in str(err.value) and not (tmp_path / "adapter").exists()

    # the trainer's end-of-run export: merged written, the adapter skipped with the reason logged
    trainer = types.SimpleNamespace(
        out=tmp_path / "run", rt=types.SimpleNamespace(precision="fp32"), cfg=types.SimpleNamespace(peft=cfg)
    )
    capfd.readouterr()
    Trainer.export(trainer, ckpt)
    logged = "".join(capfd.readouterr())
    assert (tmp_path / "run" / "hf" / "config.json").is_file()
    assert not (tmp_path / "run" / "hf_adapter").exists()
    assert "PEFT adapter export skipped" in logged and target in logged


def _snapshot(path: Path) -> dict:
    return {str(p.relative_to(path)): p.read_bytes() if p.is_file() else None for p in sorted(path.rglob("*"))}


def test_the_tool_refuses_an_adapter_export_before_writing_anything(tmp_path, capfd):
    """tools/export_mcore_to_hf.py --adapter-output: whatever the adapter export refuses is refused
    before the merged export is written; neither output may overlap the other or a checkpoint read;
    a user's file in the run's own hf_adapter/ is never deleted."""
    from moe_sft.conversion.hf_reader import CheckpointError
    from moe_sft.trainer.trainer import Trainer
    from tests.deepseek_mtp import write_tiny_deepseek_with_mtp
    from tests.scripts import load_tool

    tool = load_tool("export_mcore_to_hf.py")
    write_tiny_deepseek_with_mtp(tmp_path / "hf", VOCAB)
    convert(tmp_path / "hf", tmp_path / "mcore")
    target = "mtp.layers.0.transformer_layer.self_attention.linear_proj"
    unexpressible, _ = _lora_run(
        tmp_path, tmp_path / "mtp_run", PeftConfig(method="lora", rank=4, target_modules=[target])
    )
    ckpt, _ = _lora_run(tmp_path, tmp_path / "run", PeftConfig(method="lora", rank=4, target_modules=["attention"]))
    merged, adapter = tmp_path / "merged", tmp_path / "adapter"

    def refused(*args: str) -> str:
        capfd.readouterr()
        assert tool.main(list(args)) == 2
        assert not merged.exists() and not adapter.exists()
        return capfd.readouterr().err

    assert target in refused(
        "--mcore-path", str(unexpressible), "--output", str(merged), "--adapter-output", str(adapter)
    )
    err = refused("--mcore-path", str(tmp_path / "mcore"), "--output", str(merged), "--adapter-output", str(adapter))
    assert "is a full-model checkpoint (no peft adapters)" in err
    err = refused("--mcore-path", str(ckpt), "--output", str(merged), "--adapter-output", str(merged / "a"))
    assert "overlap" in err
    base_before = _snapshot(tmp_path / "mcore")
    err = refused("--mcore-path", str(ckpt), "--output", str(tmp_path / "mcore"), "--overwrite")
    assert f"--output {tmp_path / 'mcore'} is the base checkpoint (moe_sft_meta.json peft_base)" in err
    assert _snapshot(tmp_path / "mcore") == base_before
    adapter.mkdir()
    (adapter / "mine.txt").write_text("x")
    capfd.readouterr()
    assert tool.main(["--mcore-path", str(ckpt), "--output", str(merged), "--adapter-output", str(adapter)]) == 2
    assert f"--output {adapter} is not empty" in capfd.readouterr().err and not merged.exists()

    # the trainer's end-of-run export: a user's file in the run's own hf_adapter/ is kept
    (tmp_path / "run" / "hf_adapter").mkdir()
    (tmp_path / "run" / "hf_adapter" / "notes.txt").write_text("mine")
    trainer = types.SimpleNamespace(
        out=tmp_path / "run", rt=types.SimpleNamespace(precision="fp32"), cfg=types.SimpleNamespace(peft=PeftConfig())
    )
    trainer.cfg.peft.method = "lora"
    capfd.readouterr()
    with pytest.raises(CheckpointError, match=r"hf_adapter .*notes\.txt.*Move them out of"):
        Trainer.export(trainer, ckpt)
    assert "Traceback" not in "".join(capfd.readouterr())
    assert (tmp_path / "run" / "hf_adapter" / "notes.txt").read_text() == "mine"
