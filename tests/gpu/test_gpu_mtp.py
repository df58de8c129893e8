"""One GPU, bf16: DeepSeek-V3 multi-token prediction. MTP logits vs the fp32 reference (built from
HF's own modules, tests/deepseek_mtp.py) within 2x the reference's own bf16 error, and 20 training
steps with the MTP loss where both losses fall."""

from __future__ import annotations

import json

import pytest
import torch

from tests.deepseek_mtp import converted_tiny_deepseek_with_mtp, reference_logits
from tests.gpu.test_gpu_parity import REPORT, VOCAB, _our_bf16_model, _write_report

pytestmark = pytest.mark.gpu


@pytest.fixture(scope="module")
def mtp_ckpt(tmp_path_factory):
    return converted_tiny_deepseek_with_mtp(tmp_path_factory.mktemp("mtp"), VOCAB)


def _docs():
    g = torch.Generator().manual_seed(0)
    return [torch.randint(0, VOCAB, (n,), generator=g).tolist() for n in (128, 300, 77)]


def test_bf16_mtp_parity(mtp_ckpt):
    from moe_sft.models.forward import packed_batch

    hf, ref, tmp = mtp_ckpt
    docs = _docs()
    refs = {}
    for dtype in (torch.float32, torch.bfloat16):
        hf.to("cuda", dtype), ref.to("cuda", dtype)
        refs[dtype] = [reference_logits(hf, ref, d)[1] for d in docs]
    model = _our_bf16_model(tmp / "mcore").eval()
    model.run_mtp = True
    tokens, positions, params = packed_batch(docs, device="cuda")
    with torch.no_grad():
        out = model(input_ids=tokens, position_ids=positions, attention_mask=None, packed_seq_params=params)
    mtp = torch.split(out[0, tokens.shape[1] :, :VOCAB].float(), [len(d) for d in docs])
    ours = [m[:-1] for m in mtp]
    report = {
        "ours_bf16_vs_ref_fp32": max((o - r).abs().max().item() for o, r in zip(ours, refs[torch.float32])),
        "ref_bf16_vs_ref_fp32": max(
            (b - r).abs().max().item() for b, r in zip(refs[torch.bfloat16], refs[torch.float32])
        ),
        "ours_bf16_vs_ref_bf16": max((o - b).abs().max().item() for o, b in zip(ours, refs[torch.bfloat16])),
    }
    REPORT["deepseek_v3/mtp_parity"] = report
    _write_report()
    print("GPU_MTP_PARITY", json.dumps(report))
    assert report["ours_bf16_vs_ref_fp32"] <= 2 * report["ref_bf16_vs_ref_fp32"] + 1e-2, report


def test_bf16_training_with_mtp_lowers_both_losses(mtp_ckpt):
    from tests.train_steps import adam_steps, random_batches

    _, _, tmp = mtp_ckpt
    model = _our_bf16_model(tmp / "mcore").train()
    model.run_mtp = True
    batches = random_batches(VOCAB, (200, 311, 90), micro_batches=2, prompt=8)
    main, mtp = adam_steps(model, batches, VOCAB, "cuda", steps=20, lr=2e-3, mtp_weight=0.3)
    REPORT["deepseek_v3/mtp_train"] = {
        "loss": [round(main[0], 4), round(main[-1], 4)],
        "mtp_loss": [round(mtp[0], 4), round(mtp[-1], 4)],
    }
    _write_report()
    print("GPU_MTP_TRAIN", main[0], main[-1], mtp[0], mtp[-1])
    assert main[-1] < main[0] - 1.0 and mtp[-1] < mtp[0] - 1.0, (main, mtp)
