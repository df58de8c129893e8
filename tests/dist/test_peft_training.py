"""LoRA through the trainer's memory options (torchrun, one rank, CPU): megatron's full recompute
behind a frozen embedding computes the same adapter gradients as no recompute (it passes gradients
only through inputs that require them: without the embedding hook every adapter's gradient was 0)."""

from __future__ import annotations

import pytest

from tests.dist.launch import make_tiny_model, step_metrics, torchrun, torchrun_cases

LORA = ["peft.method=lora", "peft.rank=8", "peft.target_modules=[attention,experts]"]


@pytest.fixture(scope="module")
def model_dirs(tmp_path_factory):
    return make_tiny_model(tmp_path_factory.mktemp("peft_training"), num_hidden_layers=2)


def _overrides(tmp, name, extra) -> list[str]:
    return [
        "trainer.max_steps=3",
        "trainer.log_interval=1",
        "trainer.export_hf_at_end=false",
        "checkpoint.save_at_end=false",
        f"trainer.output_dir={tmp / name}",
        f"model.hf_path={tmp / 'hf'}",
        f"model.mcore_path={tmp / 'mcore'}",
        "model.create_tiny_if_missing=false",
        *LORA,
        *extra,
    ]


def _train(tmp, name, extra):
    return step_metrics(torchrun(1, _overrides(tmp, name, extra)).stdout)


def test_full_recompute_gives_the_same_adapter_gradients(model_dirs):
    recompute = ["model.recompute_granularity=full", "model.recompute_method=uniform", "model.recompute_num_layers=1"]
    # one launch, both runs (tests/dist/multi_run.py)
    logs = torchrun_cases(1, [_overrides(model_dirs, "plain", []), _overrides(model_dirs, "recompute", recompute)])
    plain, recomputed = (step_metrics(log) for log in logs)
    assert plain[1]["grad_norm"] > 0.1, plain
    for step in (1, 2, 3):
        for key in ("loss", "grad_norm"):
            assert recomputed[step][key] == pytest.approx(plain[step][key], rel=2e-3), (step, key, plain, recomputed)


def test_bf16_run_exports_the_merged_model_and_a_peft_adapter_that_agree(model_dirs):
    """A bf16 LoRA run (its trained embedding stored in bf16, the base in fp32) exports output_dir/hf
    (merged) and output_dir/hf_adapter; the adapter on the base equals the merged model."""
    import peft
    import torch
    from transformers import AutoModelForCausalLM

    run = model_dirs / "bf16"
    _train(
        model_dirs,
        "bf16",
        [
            "trainer.precision=bf16",
            "trainer.export_hf_at_end=true",
            "checkpoint.save_at_end=true",
            "peft.train_embeddings=true",
        ],
    )
    merged = AutoModelForCausalLM.from_pretrained(run / "hf", dtype=torch.float32)
    base = AutoModelForCausalLM.from_pretrained(model_dirs / "hf", dtype=torch.float32)
    adapted = peft.PeftModel.from_pretrained(base, run / "hf_adapter")
    ids = torch.randint(0, merged.config.vocab_size, (1, 48), generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        a, m = adapted(ids).logits, merged(ids).logits
        b = AutoModelForCausalLM.from_pretrained(model_dirs / "hf", dtype=torch.float32)(ids).logits
    assert (m - b).abs().max() > 1e-2  # the adapters changed the model
    # both are the bf16 export read in fp32: equal up to bf16 rounding of the merged weights
    assert (a - m).abs().max() < 5e-2 * m.abs().max(), ((a - m).abs().max(), m.abs().max())
