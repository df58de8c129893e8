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


@pytest.mark.parametrize("k,n", [(2048, 16), (16, 768), (768, 16), (16, 2048)])  # A1, B1, A2, B2 at rank 16
def test_skinny_factor_gradients_by_the_wgrad_kernel_equal_torchs(k, n):
    """The expert adapters' grouped GEMM (kernels/wgrad.GroupedMatmulKernelWgrad) against torch's
    grouped_mm autograd: the same output, input and factor gradients (fp32 accumulation)."""
    import torch.nn.functional as F

    from moe_sft.kernels.wgrad import GroupedMatmulKernelWgrad

    g = torch.Generator().manual_seed(0)
    counts = torch.randint(0, 64, (128,), generator=g)
    counts[[3, 50]] = 0
    ends = torch.cumsum(counts, 0, dtype=torch.int32).cuda()
    x = torch.randn(int(counts.sum()), k, generator=g).cuda().bfloat16().requires_grad_()
    w = (torch.randn(128, k, n, generator=g) / k**0.5).cuda().bfloat16().requires_grad_()
    dy = torch.randn(x.shape[0], n, generator=g).cuda().bfloat16()
    out = GroupedMatmulKernelWgrad.apply(x, w, ends)
    out.backward(dy)
    ours = (out.detach(), x.grad.clone(), w.grad.clone())
    x.grad = w.grad = None
    ref = F.grouped_mm(x, w, offs=ends)
    ref.backward(dy)
    torch.testing.assert_close(ours[0], ref.detach(), rtol=0, atol=0)
    torch.testing.assert_close(ours[1], x.grad, rtol=0, atol=0)
    exact = torch.stack(
        [c.double().T @ d.double() for c, d in zip(x.detach().split(counts.tolist()), dy.split(counts.tolist()))]
    )
    err = (ours[2].double() - exact).abs().max().item()
    assert err <= 1e-2 * exact.abs().max().item(), err  # bf16 rounding of an fp32 sum
    assert torch.equal(ours[2][3], torch.zeros_like(ours[2][3]))  # no rows: zero gradient
