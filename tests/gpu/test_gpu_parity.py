"""bf16 logit parity on one GPU: our GPTModel (torch-native spec, varlen attention, grouped_mm
experts) vs transformers' Qwen3MoeForCausalLM, both judged against HF in fp32.

bf16-aware tolerance: our bf16 error w.r.t. the fp32 reference must stay within 2x HF's own bf16
error (plus a small floor), measured on the same packed documents."""

from __future__ import annotations

import json
import os
from pathlib import Path

import pytest
import torch

pytestmark = pytest.mark.gpu


@pytest.fixture(scope="module")
def converted(tmp_path_factory):
    from moe_sft.conversion.convert import convert
    from moe_sft.models import qwen3_moe

    tmp = tmp_path_factory.mktemp("gpu_parity")
    torch.manual_seed(0)
    hf = qwen3_moe.FAMILY.hf_model_class(qwen3_moe.tiny_hf_config(vocab_size=1000))
    hf.save_pretrained(tmp / "hf")
    convert(tmp / "hf", tmp / "mcore")
    return tmp


def _our_bf16_logits(mcore: Path, docs):
    from moe_sft.conversion.convert import load_hf_config
    from moe_sft.models.builder import ModelOptions, build_model_chunks, build_transformer_config
    from moe_sft.models.forward import packed_logits
    from moe_sft.runtime import device as rdevice, distributed
    from moe_sft.trainer import checkpoint

    rdevice.prepare_runtime(rdevice.RuntimeChoice("cuda", "bf16", "torch", ()))
    distributed.init_process_group("cuda")
    distributed.init_model_parallel()
    family, hf_cfg = load_hf_config(mcore / "hf")
    opts = ModelOptions(precision="bf16", backend="torch", device="cuda")
    model = build_model_chunks(family, hf_cfg, build_transformer_config(family, hf_cfg, opts), opts)[0]
    checkpoint.load_model_weights(mcore, [model])
    return packed_logits(model.eval(), docs, hf_cfg.vocab_size, device="cuda")


def test_bf16_packed_parity_with_hf(converted):
    from transformers import Qwen3MoeForCausalLM

    g = torch.Generator().manual_seed(0)
    docs = [torch.randint(0, 1000, (n,), generator=g).tolist() for n in (128, 300, 77)]
    ref32 = Qwen3MoeForCausalLM.from_pretrained(converted / "hf", dtype=torch.float32).cuda().eval()
    ref16 = Qwen3MoeForCausalLM.from_pretrained(converted / "hf", dtype=torch.bfloat16).cuda().eval()
    with torch.no_grad():
        fp32 = [ref32(torch.tensor([d], device="cuda")).logits[0].float() for d in docs]
        hf16 = [ref16(torch.tensor([d], device="cuda")).logits[0].float() for d in docs]
    ours = _our_bf16_logits(converted / "mcore", docs)
    ours_err = max((o - r).abs().max().item() for o, r in zip(ours, fp32))
    hf_err = max((h - r).abs().max().item() for h, r in zip(hf16, fp32))
    ours_vs_hf16 = max((o - h).abs().max().item() for o, h in zip(ours, hf16))
    report = {"ours_bf16_vs_hf_fp32": ours_err, "hf_bf16_vs_hf_fp32": hf_err,
              "ours_bf16_vs_hf_bf16": ours_vs_hf16}
    print("GPU_PARITY", json.dumps(report))
    out = os.environ.get("MOE_SFT_GPU_REPORT")
    if out:
        Path(out).write_text(json.dumps(report, indent=2))
    assert ours_err <= 2 * hf_err + 1e-2, report
