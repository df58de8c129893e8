"""The model-FLOP formula (moe_sft/trainer/flops.py) against torch's FlopCounterMode.

1. transformers' own models (eager attention, eager experts: only the routed tokens go through
   each expert, so the count is of the active experts), one document at a time, summed: equal
   to the formula for the same documents packed, with `causal=False` (eager attention computes
   the full L x L score matrix and masks it). Backward is exactly 2x forward.
2. Our megatron model on one packed row (DeepSeek-V3 with an MTP layer run): equal to the formula
   with megatron's padded vocabulary (384 for 300: the LM head really computes 384 columns;
   the logged model FLOPs use the true vocabulary).
Measured: all differences are exactly 0 FLOPs.
"""

from __future__ import annotations

from types import SimpleNamespace

import pytest
import torch
from torch.utils.flop_counter import FlopCounterMode, sdpa_backward_flop_count, sdpa_flop_count

from moe_sft.data.packing import build_micro_batch
from moe_sft.models import registry
from moe_sft.models.builder import ModelOptions, build_transformer_config, padded_vocab_size
from moe_sft.models.forward import packed_batch
from moe_sft.runtime import cpu_compat
from moe_sft.trainer import flops
from tests.train_steps import PromptedDoc

VOCAB = 300
LENGTHS = (19, 40, 7)
HF_CASES = [
    ("qwen3_moe", {}),
    ("mixtral", {}),
    ("deepseek_v3", {}),
    ("deepseek_v3", {"q_lora_rank": None}),
    ("gemma4", {}),  # per-layer head dims, k-eq-v full layer, dense MLP beside the experts
]


def _counted(fn) -> int:
    with FlopCounterMode(display=False, custom_mapping=_CPU_KERNELS) as counter:
        fn()
    return counter.get_total_flops()


# Kernels FlopCounterMode has no formula for: torch's grouped_mm (our experts) and the CPU
# flash SDPA (our per-document attention reference, when torch picks it over the math path).
def _grouped_mm(x_shape, w_shape, *args, out_shape=None, **kwargs):
    return 2 * x_shape[0] * x_shape[1] * w_shape[-1]


def _sdpa_cpu(q, k, v, *args, out_shape=None, **kwargs):
    return sdpa_flop_count(q, k, v)


def _sdpa_cpu_backward(grad_out, q, k, v, *args, out_shape=None, **kwargs):
    return sdpa_backward_flop_count(grad_out, q, k, v)


_CPU_KERNELS = {
    torch.ops.aten._grouped_mm: _grouped_mm,
    torch.ops.aten._scaled_dot_product_flash_attention_for_cpu: _sdpa_cpu,
    torch.ops.aten._scaled_dot_product_flash_attention_for_cpu_backward: _sdpa_cpu_backward,
}


def _shape(family, hf_cfg, vocab=VOCAB, run_mtp=False):
    config = build_transformer_config(family, hf_cfg, ModelOptions())
    return flops.ModelShape.from_config(config, vocab, run_mtp=run_mtp)


@pytest.mark.parametrize("name,overrides", HF_CASES, ids=[f"{n}{'-no_q_lora' if o else ''}" for n, o in HF_CASES])
def test_formula_equals_flop_counter_on_transformers_models(name, overrides):
    family = registry.family_by_name(name)
    hf_cfg = family.tiny_hf_config(vocab_size=VOCAB, **overrides)
    hf_cfg._attn_implementation = "eager"
    hf_cfg._experts_implementation = "eager"  # grouped_mm would hide the experts from the counter
    with cpu_compat.suspended():
        torch.manual_seed(0)
        model = family.hf_model_class(hf_cfg)
    forward = backward = 0
    for n in LENGTHS:
        ids = torch.randint(0, VOCAB, (1, n))
        out = {}
        forward += _counted(lambda: out.setdefault("loss", model(ids).logits.float().square().mean()))
        backward += _counted(lambda: out["loss"].backward())
    formula = flops.forward_flops(_shape(family, hf_cfg), LENGTHS, causal=False)
    print(
        f"{name}{overrides}: FlopCounter {forward} vs formula {formula} forward FLOPs; backward/forward {backward / forward}"
    )
    assert forward == formula
    assert backward == 2 * forward  # so a training step is 3x forward


def test_formula_equals_flop_counter_on_our_packed_model_with_mtp():
    from moe_sft.conversion.single_rank import single_rank_model

    family = registry.family_by_name("deepseek_v3")
    hf_cfg = family.tiny_hf_config(vocab_size=VOCAB, num_nextn_predict_layers=1)
    torch.manual_seed(0)
    model = single_rank_model(family, hf_cfg)
    model.run_mtp = True
    g = torch.Generator().manual_seed(1)
    tokens, positions, params = packed_batch([torch.randint(0, VOCAB, (n,), generator=g).tolist() for n in LENGTHS])
    forward = _counted(
        lambda: model(input_ids=tokens, position_ids=positions, attention_mask=None, packed_seq_params=params)
    )
    padded = _shape(family, hf_cfg, vocab=padded_vocab_size(VOCAB), run_mtp=True)
    assert forward == flops.forward_flops(padded, LENGTHS, causal=False)
    without_mtp = flops.forward_flops(_shape(family, hf_cfg, run_mtp=False), LENGTHS, causal=False)
    assert flops.forward_flops(_shape(family, hf_cfg, run_mtp=True), LENGTHS, causal=False) > 1.5 * without_mtp


def test_packed_micro_batches_count_documents_not_pack_length():
    family = registry.family_by_name("qwen3_moe")
    shape = _shape(family, family.tiny_hf_config(vocab_size=VOCAB))
    docs = [PromptedDoc(list(range(n))) for n in LENGTHS]
    padded = build_micro_batch(docs, pad_to=128)  # 66 real tokens + a 62-token padding segment
    assert flops.document_lengths(padded) == list(LENGTHS)
    # per-document padding (context parallelism): real lengths come from cu_seqlens_unpadded
    per_doc = SimpleNamespace(
        cu_seqlens=torch.tensor([0, 24, 64, 72, 128]),
        num_padding=62,
        cu_seqlens_unpadded=torch.tensor([0, 19, 59, 66, 66]),
    )
    assert flops.document_lengths(per_doc) == list(LENGTHS)
    assert flops.attention_pairs([3]) == 6 and flops.attention_pairs([3], causal=False) == 9
    step = flops.train_step_flops(shape, [padded])
    assert step == 3 * flops.forward_flops(shape, LENGTHS)
    assert step < 3 * flops.forward_flops(shape, [128])  # not one 128-token document


def test_per_token_parts_of_a_full_size_config():
    """Qwen3-30B-A3B (48 layers, 128 experts, top-8, hidden 2048, moe ffn 768, 32 q / 4 kv heads of
    128, vocab 151936), by hand; its active weights match the model card's count."""
    family = registry.family_by_name("qwen3_moe")
    hf_cfg = family.tiny_hf_config(
        vocab_size=151936,
        hidden_size=2048,
        num_hidden_layers=48,
        num_attention_heads=32,
        num_key_value_heads=4,
        head_dim=128,
        num_experts=128,
        num_experts_per_tok=8,
        moe_intermediate_size=768,
    )
    parts = flops.forward_flops_per_token(_shape(family, hf_cfg, vocab=151936))
    attn = 2048 * (32 + 2 * 4) * 128 + 32 * 128 * 2048  # q, k, v, o weights per layer
    moe = 2048 * 128 + 8 * 3 * 2048 * 768  # router + 8 active SwiGLU experts
    assert parts == {
        "attention_projections": 2 * 48 * attn,
        "dense_mlp": 0,
        "moe_mlp": 2 * 48 * moe,
        "lm_head": 2 * 2048 * 151936,
    }
    active = 48 * (attn + moe) + 2 * 2048 * 151936  # + the input embedding, which costs no FLOPs
    assert 3.3e9 < active < 3.4e9  # the model card: 3.3B activated (measured here: 3.35B)


@pytest.mark.parametrize("mtp", [0, 1])
def test_executed_flops_count_each_head_over_the_rows_with_loss_only(mtp):
    """The hardware FLOPs of the benchmarks: per head, the model FLOPs' every-token count less the
    positions without loss, counted here one position at a time (depth k: the label k places
    further, inside the document); the padding segment is neither."""
    family = registry.family_by_name("deepseek_v3")
    shape = _shape(family, family.tiny_hf_config(vocab_size=VOCAB, num_nextn_predict_layers=1), run_mtp=bool(mtp))
    docs = [PromptedDoc(list(range(n)), prompt=p) for n, p in zip(LENGTHS, (5, 0, 6))]
    mb = build_micro_batch(docs, pad_to=128)
    has_loss, rows, start = (mb.loss_mask > 0).tolist(), 0, 0
    for n in LENGTHS:
        for depth in range(1 + mtp):
            rows += sum(has_loss[start + t + depth] for t in range(n - depth))
        start += n
    head = 2 * shape.hidden * shape.vocab
    skipped = (1 + mtp) * sum(LENGTHS) - rows
    assert 0 < skipped < (1 + mtp) * sum(LENGTHS)
    assert flops.executed_step_flops(shape, [mb]) == flops.train_step_flops(shape, [mb]) - 3 * head * skipped


def test_lora_step_flops_by_hand_on_a_small_shape():
    """Hidden 8, 2 q heads / 1 kv head of 4, a dense layer (ffn 12) then an MoE layer (4 experts,
    top-2, ffn 6), vocab 10; LoRA rank 2 on the attention and the experts; documents of 3 and 5."""
    from moe_sft.plan.peft_memory import PeftPlan

    shape = flops.ModelShape(
        name="hand",
        model_type="qwen3_moe",
        num_layers=2,
        hidden=8,
        vocab=10,
        num_heads=2,
        num_kv_heads=1,
        head_dim=4,
        qk_norm=True,
        ffn=12,
        num_experts=4,
        topk=2,
        moe_ffn=6,
        shared_ffn=0,
        moe_layers=(False, True),
        mtp_layers=0,
        tie_embeddings=False,
    )
    mb = build_micro_batch([PromptedDoc(list(range(n)), prompt=2) for n in (3, 5)], pad_to=1)
    tokens = 8
    # forward per token: q 2*8*8 + k 2*8*4 + v 2*8*4 + o 2*8*8 = 384 per layer; dense MLP 3 * 2*8*12 = 576;
    # MoE router 2*8*4 + 2 experts x 3 * 2*8*6 = 640; LM head 2*8*10 = 160
    per_token = 2 * 384 + 576 + 640 + 160
    scores = 2 * 2 * (4 + 4) * 2 * (6 + 15)  # QK^T and AV, 2 layers, causal pairs 3*4/2 + 5*6/2
    forward = tokens * per_token + scores
    assert flops.train_step_flops(shape, [mb]) == 3 * forward
    # adapters per token: qkv A 3 x (2 x 8) + B 16 x 2 -> 2*80; o A 2 x 8 + B 8 x 2 -> 2*32; per layer,
    # both layers; experts (MoE layer) 2 visited x 2*2*(A1 8 + B1 gate/up 2*6 + A2 6 + B2 8)
    adapters = 2 * (2 * 80 + 2 * 32) + 2 * 2 * 2 * (8 + 12 + 6 + 8)
    plan = PeftPlan(rank=2, target_modules=("attention", "experts"))
    assert flops.adapter_forward_flops_per_token(shape, plan) == adapters == 720
    input_grads = tokens * per_token + 2 * scores  # every matmul's dgrad; the scores' backward is 2x
    lora = flops.lora_step_flops(shape, [mb], plan)
    assert lora == forward + input_grads + 3 * tokens * adapters == 55616
    # the trainer runs the head over the rows with loss only: forward and input gradient there
    skipped = flops.skipped_head_rows(shape, [mb])
    assert skipped == 2 + 2  # per document: the first row (its label is a prompt token) and the last (no label)
    assert flops.lora_step_flops(shape, [mb], plan, heads_over_loss_rows=True) == lora - 2 * 160 * skipped
    # a trained router adds its weight gradient back
    router = PeftPlan(rank=2, target_modules=("attention", "experts"), train_router=True)
    assert flops.lora_step_flops(shape, [mb], router) == lora + tokens * 2 * 8 * 4


@pytest.mark.parametrize("name,entries", [("qwen3_moe", ("attention", "experts")), ("deepseek_v3", ("all_linear",))])
def test_lora_step_flops_equal_flop_counter_on_an_adapted_model(name, entries):
    """What an adapted model's forward and backward run (torch's FlopCounterMode, the fused
    kernels installed as the trainer has them: the frozen router computes no weight gradient)
    equals the LoRA count, with the padded vocabulary and every query-key pair (per-document
    attention computes the full L x L scores on CPU)."""
    from moe_sft.config import KernelsConfig
    from moe_sft.config.schema import PeftConfig
    from moe_sft.conversion.single_rank import single_rank_model
    from moe_sft.kernels import install as kernels
    from moe_sft.peft import install
    from moe_sft.plan.peft_memory import PeftPlan
    from moe_sft.runtime import patches

    family = registry.family_by_name(name)
    hf_cfg = family.tiny_hf_config(vocab_size=VOCAB, num_hidden_layers=2)
    torch.manual_seed(0)
    model = single_rank_model(family, hf_cfg)
    install.add_adapters([model], PeftConfig(method="lora", rank=4, target_modules=list(entries)), model.config, "cpu")
    g = torch.Generator().manual_seed(1)
    tokens, positions, params = packed_batch([torch.randint(0, VOCAB, (n,), generator=g).tolist() for n in LENGTHS])
    kernels.install(KernelsConfig())
    try:
        out = {}
        forward = _counted(
            lambda: out.setdefault(
                "y", model(input_ids=tokens, position_ids=positions, attention_mask=None, packed_seq_params=params)
            )
        )
        backward = _counted(lambda: out["y"].float().square().mean().backward())
    finally:
        patches.restore(patches.KERNELS)
    padded = _shape(family, hf_cfg, vocab=padded_vocab_size(VOCAB))
    mb = build_micro_batch([PromptedDoc(list(range(n))) for n in LENGTHS], pad_to=1)
    plan = PeftPlan(rank=4, target_modules=entries)
    assert forward + backward == flops.lora_step_flops(padded, [mb], plan, causal=False)
    assert forward == flops.forward_flops(padded, LENGTHS, causal=False) + sum(
        LENGTHS
    ) * flops.adapter_forward_flops_per_token(padded, plan)
