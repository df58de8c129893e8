"""One GPU, bf16, every family: LoRA on all linears and the routed experts (grouped_mm path with
bf16 alignment), and DoRA on the attention. The adapted bf16 model against the fp32 model whose
weights are the merged ones (bf16-aware tolerance: within 2x the merged model's own bf16 error
plus a small floor), and 20 bf16 training steps of the adapters alone lower the loss."""

from __future__ import annotations

import json

import pytest
import torch

from moe_sft.config import PeftConfig
from moe_sft.models import registry

pytestmark = pytest.mark.gpu
FAMILIES = [f.name for f in registry.FAMILIES]
VOCAB = 1000


def _model(family, dtype: str, device: str):
    from moe_sft.kernels import install as kernels_install
    from moe_sft.models.builder import ModelOptions, build_model_chunks, build_transformer_config
    from moe_sft.runtime import device as rdevice
    from moe_sft.runtime import distributed

    rdevice.prepare_runtime(rdevice.RuntimeChoice(device, dtype, "torch", ()))
    kernels_install.install()
    distributed.init_process_group(device)
    distributed.init_model_parallel()
    hf_cfg = family.tiny_hf_config(vocab_size=VOCAB)
    opts = ModelOptions(precision=dtype, backend="torch", device=device)
    torch.manual_seed(0)
    return build_model_chunks(family, hf_cfg, build_transformer_config(family, hf_cfg, opts), opts)[0]


def _adapt(model, cfg: PeftConfig):
    from moe_sft.peft import install

    install.add_adapters([model], cfg, model.config, "cuda")
    install.init_dora_magnitudes([model])
    torch.manual_seed(1)
    with torch.no_grad():
        for name, param in model.named_parameters():
            if ".adapter.lora_B" in name:
                param.normal_(0, 0.02)
    return model


@pytest.mark.parametrize("method,targets", [("lora", ["all_linear"]), ("dora", ["attention"])])
@pytest.mark.parametrize("name", FAMILIES)
def test_bf16_adapted_model_matches_the_fp32_merged_model(name, method, targets):
    from moe_sft.models.forward import packed_logits
    from moe_sft.peft import state

    family = registry.family_by_name(name)
    cfg = PeftConfig(method=method, rank=16, alpha=32, target_modules=targets)
    adapted = _adapt(_model(family, "bf16", "cuda").eval(), cfg)
    merged = dict(state.merged_weights(adapted))
    g = torch.Generator().manual_seed(0)
    docs = [torch.randint(0, VOCAB, (n,), generator=g).tolist() for n in (128, 300, 77)]
    with torch.no_grad():
        ours = packed_logits(adapted, docs, VOCAB, device="cuda")
        plain = {k: v for k, v in adapted.state_dict().items() if ".adapter." not in k and torch.is_tensor(v)}
        plain.update(merged)
        ref = []
        for dtype in ("fp32", "bf16"):
            model = _model(family, dtype, "cuda").eval()
            model.load_state_dict({k: v.to(next(model.parameters()).dtype) for k, v in plain.items()}, strict=False)
            ref.append(packed_logits(model, docs, VOCAB, device="cuda"))
    err_ours = max((o.float() - r.float()).abs().max().item() for o, r in zip(ours, ref[0]))
    err_merged = max((m.float() - r.float()).abs().max().item() for m, r in zip(ref[1], ref[0]))
    print(
        "GPU_PEFT",
        name,
        method,
        json.dumps({"adapted_bf16_vs_merged_fp32": err_ours, "merged_bf16_vs_fp32": err_merged}),
    )
    assert err_ours <= 2 * err_merged + 1e-2, (err_ours, err_merged)


@pytest.mark.parametrize("name", FAMILIES)
def test_bf16_lora_steps_lower_the_loss(name):
    from tests.train_steps import adam_steps, random_batches

    family = registry.family_by_name(name)
    cfg = PeftConfig(method="lora", rank=16, alpha=32, target_modules=["attention", "experts"])
    model = _adapt(_model(family, "bf16", "cuda").train(), cfg)
    trained = [n for n, p in model.named_parameters() if p.requires_grad]
    assert trained and all(".adapter." in n for n in trained)
    before = {n: p.detach().clone() for n, p in model.named_parameters() if not p.requires_grad}
    batches = random_batches(VOCAB, (200, 311, 90), micro_batches=2, prompt=8)
    losses, _ = adam_steps(model, batches, VOCAB, "cuda", steps=20, lr=5e-3)
    print("GPU_PEFT_TRAIN", name, losses[0], losses[-1])
    assert losses[-1] < losses[0] - 0.5, losses
    assert all(torch.equal(p, before[n]) for n, p in model.named_parameters() if n in before)  # base frozen
