"""peft.fp8_base: the frozen base held in FP8 (e4m3 + block scales) and dequantised per GEMM.

On CPU in fp32: the FP8 model equals, bit for bit, the model whose weights are the dequantised
values (logits and adapter gradients); no dequantised weight is saved for the backward; adapters
train; loading one layer at a time never holds two layers' bf16 weights; a base converted from an
FP8 source re-quantises to the source's FP8 values exactly; the build can skip the bf16 base; the
trainer trains LoRA on it end to end (torchrun, one rank)."""

from __future__ import annotations

import copy
import json

import pytest
import torch

from moe_sft.config.schema import PeftConfig
from moe_sft.conversion import fp8 as conversion_fp8
from moe_sft.models import registry
from moe_sft.models.forward import packed_batch
from moe_sft.peft import fp8_base, fp8_loading, install

BLOCK = (32, 32)  # tiny widths (48, 64, 128) then span several blocks, some partial
LORA = PeftConfig(method="lora", rank=4, alpha=8, target_modules=["all_linear"])


@pytest.fixture(scope="module")
def family():
    return registry.family_by_name("deepseek_v3")


def _hf(family, **overrides):
    return family.tiny_hf_config(num_hidden_layers=3, **overrides)  # 1 dense + 2 MoE layers


def _model(family, hf=None, placeholders=False):
    from moe_sft.conversion.single_rank import build_single_rank_model, init_single_rank

    init_single_rank()
    torch.manual_seed(0)
    with fp8_loading.placeholder_base() if placeholders else _nothing():
        return build_single_rank_model(family, hf or _hf(family))


class _nothing:
    def __enter__(self):
        return None

    def __exit__(self, *exc):
        return False


def _adapted(family, cfg=LORA, hf=None):
    model = _model(family, hf)
    install.add_adapters([model], cfg, model.config, "cpu")
    torch.manual_seed(1)
    with torch.no_grad():  # B starts at 0: move it so the adapters change the output
        for name, param in model.named_parameters():
            if ".adapter.lora_B" in name:
                param.normal_(0, 0.05)
    return model


def _docs(vocab):
    g = torch.Generator().manual_seed(3)
    return [torch.randint(0, vocab, (n,), generator=g).tolist() for n in (7, 12, 5)]


def _loss(model):
    tokens, positions, params = packed_batch(_docs(model.vocab_size))
    logits = model(input_ids=tokens, position_ids=positions, attention_mask=None, packed_seq_params=params)
    return logits.float().square().mean()


# ----------------------------------------------------------------------------- block math


@pytest.mark.parametrize("shape", [(300, 200), (3, 128, 256), (2, 48, 100)])
def test_quantize_and_dequantize_equal_the_conversion_reference(shape):
    torch.manual_seed(0)
    w = torch.randn(shape) * torch.logspace(-3, 1, shape[-1])
    q, s = fp8_base.quantize(w, BLOCK)
    flat_w, flat_q, flat_s = w.reshape(-1, *shape[-2:]), q.reshape(-1, *shape[-2:]), s.reshape(-1, *s.shape[-2:])
    for i in range(flat_w.shape[0]):
        ref_q, ref_s = conversion_fp8.quantize_blocks(flat_w[i], BLOCK)
        assert torch.equal(flat_q[i].view(torch.uint8), ref_q.view(torch.uint8)) and torch.equal(flat_s[i], ref_s)
    for dtype in (torch.float32, torch.bfloat16):
        got = fp8_base.dequantize(q, s, BLOCK, dtype).reshape(flat_w.shape)
        for i in range(flat_w.shape[0]):
            assert torch.equal(got[i], conversion_fp8.dequantize_blocks(flat_q[i], flat_s[i], BLOCK, dtype))


def test_a_weight_dequantised_from_fp8_requantises_to_the_same_bits_and_values():
    """bf16 = dequant(source FP8): quantize gives the source's FP8 bits and a scale per block that
    dequantises to that bf16 weight exactly (blocks with exact powers of two of either sign included);
    a plain bf16 weight gets DeepSeek-V3's amax scale."""
    torch.manual_seed(1)
    w = torch.randn(384, 320) * torch.logspace(-4, 0, 320)
    w[0, :8] = torch.tensor([2.0**-5, -(2.0**-5), 2.0**-7, -(2.0**-9), 0.0, 1e-8, -1e-8, 3.0])
    src_q, src_s = conversion_fp8.quantize_blocks(w)
    bf16 = conversion_fp8.dequantize_blocks(src_q, src_s)
    for weight in (bf16, bf16.float()):  # a bf16 checkpoint loaded into a bf16 or fp32 model
        q, s = fp8_base.quantize(weight)
        assert torch.equal(q.view(torch.uint8), src_q.view(torch.uint8))
        assert torch.equal(fp8_base.dequantize(q, s), bf16)
    plain = torch.randn(256, 256).bfloat16()
    q, s = fp8_base.quantize(plain)
    ref_q, ref_s = conversion_fp8.quantize_blocks(plain)
    assert torch.equal(q.view(torch.uint8), ref_q.view(torch.uint8)) and torch.equal(s, ref_s)


# ----------------------------------------------------------------------------- the FP8 model


def _fp8_and_dequantised(family):
    ours = _adapted(family)
    lines = fp8_base.install([ours], BLOCK)
    theirs = _adapted(family)
    sd = theirs.state_dict()
    values = dict(fp8_base.dequantized_weights(ours))
    for key, value in values.items():
        sd[key] = value
    theirs.load_state_dict(sd)
    return ours, theirs, values, lines


def test_fp8_base_covers_the_frozen_linears_and_experts_only(family):
    ours, _, values, lines = _fp8_and_dequantised(family)
    kinds = {k.split(".", 3)[-1] for k in values}
    assert {
        "self_attention.linear_q_down_proj.weight",
        "self_attention.linear_kv_up_proj.weight",
        "self_attention.linear_proj.weight",
        "mlp.linear_fc1.weight",  # the dense layer
        "mlp.shared_experts.linear_fc2.weight",
        "mlp.experts.weight1",
        "mlp.experts.weight2",
    } <= kinds
    fp8_params = {n for n, b in ours.named_buffers() if b.dtype == fp8_base.FP8}
    assert fp8_params == set(values)
    assert not any(p.dtype == fp8_base.FP8 for p in ours.parameters())  # buffers: DDP, norms, integrity skip them
    assert not any(n.startswith(("embedding", "output_layer")) or ".router." in n for n in fp8_params)
    assert all(p.dtype == torch.float32 for n, p in ours.named_parameters() if n not in fp8_params)
    assert "held in FP8" in lines[0]
    experts = ours.decoder.layers[1].mlp.experts
    assert experts.weight1_scale_inv.shape == (8, 128 // 32, 2 * 64 // 32)  # per expert, (in x out) blocks
    assert not {"weight1", "weight1_scale_inv"} & set(experts.state_dict())  # not checkpoint entries


def test_fp8_model_equals_the_dequantised_model_in_forward_and_backward(family):
    ours, theirs, _, _ = _fp8_and_dequantised(family)
    l_ours, l_theirs = _loss(ours), _loss(theirs)
    assert torch.equal(l_ours, l_theirs)
    l_ours.backward()
    l_theirs.backward()
    grads = {n: p.grad for n, p in theirs.named_parameters() if p.requires_grad}
    assert grads and all(".adapter." in n for n in grads)
    for name, param in ours.named_parameters():
        if param.requires_grad:
            torch.testing.assert_close(param.grad, grads[name], rtol=1e-6, atol=1e-9, msg=name)
        else:
            assert param.grad is None


def test_no_dequantised_weight_is_saved_for_backward(family):
    """The autograd graph keeps the FP8 bytes only: nothing saved has a dequantised base weight's
    shape in a float dtype (megatron's frozen linear saves its weight, grouped_mm its operands)."""
    ours, theirs, values, _ = _fp8_and_dequantised(family)
    shapes = set()
    for key in values:
        module, pname = ours.get_submodule(key.rsplit(".", 1)[0]), key.rsplit(".", 1)[1]
        view = dict(fp8_base._weights(module))[pname]
        shapes |= {tuple(values[key].shape), tuple(values[key].view(view).shape)}

    def float_weights_saved(model) -> list:
        saved = []
        kept = {p.data_ptr() for n, p in model.named_parameters() if n not in values}  # embedding, LM head, adapters

        def pack(t):
            weight_like = t.grad_fn is None and not t.requires_grad and t.data_ptr() not in kept
            if weight_like and t.dtype != fp8_base.FP8 and tuple(t.shape) in shapes:
                saved.append(tuple(t.shape))
            return t

        with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
            _loss(model)
        return saved

    assert float_weights_saved(ours) == []
    assert float_weights_saved(theirs)  # the same check sees the bf16/fp32 base's weights


def test_adapters_train_on_the_fp8_base_and_the_base_stays(family):
    ours, _, _, _ = _fp8_and_dequantised(family)
    fp8 = [(n, b) for n, b in ours.named_buffers() if b.dtype == fp8_base.FP8 or n.endswith(fp8_base.SCALE)]
    before = {n: p.detach().clone() for n, p in [*ours.named_parameters(), *fp8] if not p.requires_grad}
    trained = [p for p in ours.parameters() if p.requires_grad]
    opt = torch.optim.Adam(trained, lr=1e-2)
    losses = []
    for _ in range(4):
        opt.zero_grad()
        loss = _loss(ours)
        loss.backward()
        opt.step()
        losses.append(loss.item())
    assert losses[-1] < losses[0]
    for name, param in [*ours.named_parameters(), *ours.named_buffers()]:
        if name in before:  # the frozen parameters, the FP8 values and their scales
            assert torch.equal(_bits(param), _bits(before[name])), name


def _bits(t):
    return t.view(torch.uint8) if t.dtype == fp8_base.FP8 else t


def test_dora_with_fp8_base_is_refused():
    from moe_sft.config.load import load_recipe
    from moe_sft.config.validate import check_peft_fp8_base

    cfg = load_recipe("recipes/quickstart_lora.yaml")
    cfg.peft.fp8_base = True
    assert check_peft_fp8_base(cfg, 1) == []
    bad = copy.deepcopy(cfg)
    bad.peft.method = "dora"
    assert "peft.fp8_base=true with peft.method=dora" in "\n".join(check_peft_fp8_base(bad, 1))
    bad.peft.method = "none"
    assert "peft.fp8_base=true needs peft.method=lora" in "\n".join(check_peft_fp8_base(bad, 1))


# ----------------------------------------------------------------------------- building and loading


def test_placeholder_build_then_layerwise_load_equals_quantising_the_loaded_model(family):
    """The build allocates one element per base weight; the layer-by-layer load fills the FP8
    storage and never holds more than one layer's modules in bf16/fp32 at once."""
    reference = _adapted(family)
    fp8_base.install([reference], BLOCK)
    source = _model(family).state_dict()  # the "checkpoint": plain weights

    model = _model(family, placeholders=True)
    placeholders = [n for n, p in model.named_parameters() if fp8_base.is_placeholder(p)]
    assert any("experts.weight1" in n for n in placeholders) and "output_layer.weight" in placeholders
    assert not any("embedding" in n or "norm" in n or "router" in n for n in placeholders)
    install.add_adapters([model], LORA, model.config, "cpu")
    assert not any(fp8_base.is_placeholder(p) for n, p in model.named_parameters() if ".adapter." in n)
    fp8_base.install([model], BLOCK)
    assert fp8_loading.materialise_placeholders([model]) == 1  # the LM head
    held = []

    def load(keep):
        held.append({n for n, p in model.named_parameters() if _unquantised_base(n, p)})
        model.load_state_dict({k: v for k, v in source.items() if keep(0, k)}, strict=False)

    calls = fp8_loading.load_quantised([model], load)
    assert calls == 4  # 3 decoder layers + the rest
    layers = [{n.split(".")[2] for n in h} for h in held[:-1]]
    assert layers == [{"0"}, {"1"}, {"2"}] and held[-1] == set()
    with torch.no_grad():
        for name, param in reference.named_parameters():
            if ".adapter." not in name:
                assert torch.equal(model.get_parameter(name), param), name
        for name, buf in reference.named_buffers():
            if buf.dtype == fp8_base.FP8 or name.endswith(fp8_base.SCALE):
                assert torch.equal(_bits(model.get_buffer(name)), _bits(buf)), name


def _unquantised_base(name, param) -> bool:
    """A base GEMM weight held in fp32 (not FP8) outside the embedding, LM head and routers."""
    skipped = name.startswith(("embedding", "output_layer")) or ".router." in name or ".adapter." in name
    return not skipped and param.dim() >= 2 and param.dtype == torch.float32


def test_fp8_source_requantises_to_its_own_bits(family, tmp_path):
    """A DeepSeek-V3 released in FP8 (128x128 blocks), converted (dequantised into bf16) and loaded
    into the FP8 base: every FP8 value equals the source's, and dequantises to exactly what the
    converter wrote (the scales agree with the source's within 2^-8; the source's own is one of the
    scales that reproduce the bf16 weight)."""
    from safetensors.torch import load_file, save_file

    from moe_sft.conversion.convert import convert
    from moe_sft.runtime import cpu_compat
    from moe_sft.trainer import checkpoint

    hf = _hf(family, hidden_size=256, moe_intermediate_size=128, intermediate_size=256, q_lora_rank=128)
    with cpu_compat.suspended():
        torch.manual_seed(0)
        family.hf_model_class(hf).save_pretrained(str(tmp_path / "bf16"))
    tensors = load_file(str(tmp_path / "bf16" / "model.safetensors"))
    source = {}
    for name, t in tensors.items():
        if t.dim() == 2 and "proj" in name and "embed" not in name:
            q, s = conversion_fp8.quantize_blocks(t)
            source[name], source[conversion_fp8.scale_name(name)] = q, s
        else:
            source[name] = t
    (tmp_path / "fp8").mkdir()
    save_file(source, str(tmp_path / "fp8" / "model.safetensors"))
    config = json.loads((tmp_path / "bf16" / "config.json").read_text())
    config["quantization_config"] = {"quant_method": "fp8", "fmt": "e4m3", "weight_block_size": [128, 128]}
    (tmp_path / "fp8" / "config.json").write_text(json.dumps(config))
    convert(tmp_path / "fp8", tmp_path / "mcore")

    hf_fp8 = type(hf).from_pretrained(str(tmp_path / "fp8"))
    model = _model(family, hf_fp8, placeholders=True)
    install.add_adapters([model], LORA, model.config, "cpu")
    fp8_base.install([model])
    fp8_loading.materialise_placeholders([model])
    checkpoint.load_model_weights(tmp_path / "mcore", [model])

    def same(ours_q, ours_s, name):
        """FP8 bits = the source's; dequantised (bf16) = what the converter wrote, bit for bit."""
        src_q, src_s = source[name], source[conversion_fp8.scale_name(name)]
        assert torch.equal(ours_q.view(torch.uint8), src_q.view(torch.uint8)), name
        torch.testing.assert_close(ours_s, src_s, rtol=2**-8, atol=0, msg=name)
        converted = conversion_fp8.dequantize_blocks(src_q, src_s)
        assert torch.equal(conversion_fp8.dequantize_blocks(ours_q.contiguous(), ours_s.contiguous()), converted), name

    layer = model.decoder.layers[1]
    proj = layer.self_attention.linear_proj
    same(proj.weight, proj.weight_scale_inv, "model.layers.1.self_attn.o_proj.weight")
    kv = layer.self_attention.linear_kv_down_proj  # 576-like partial last block: (kv_lora + rope) rows
    same(kv.weight, kv.weight_scale_inv, "model.layers.1.self_attn.kv_a_proj_with_mqa.weight")
    experts = layer.mlp.experts
    n, hidden = experts.num_local_experts, hf.hidden_size
    w1 = experts.weight1.view(n, hidden, -1)
    ffn = w1.shape[-1] // 2
    for e in (0, n - 1):  # megatron: (in x out) per expert, [gate | up]; HF: (out x in) each
        s1 = experts.weight1_scale_inv[e]
        blocks = ffn // 128
        same(w1[e, :, :ffn].t(), s1[:, :blocks].t(), f"model.layers.1.mlp.experts.{e}.gate_proj.weight")
        same(w1[e, :, ffn:].t(), s1[:, blocks:].t(), f"model.layers.1.mlp.experts.{e}.up_proj.weight")
        w2 = experts.weight2.view(n, -1, hidden)
        same(w2[e].t(), experts.weight2_scale_inv[e].t(), f"model.layers.1.mlp.experts.{e}.down_proj.weight")


def test_the_trainer_trains_lora_on_an_fp8_base(tmp_path):
    """torchrun, one rank: the trainer installs the FP8 base after the adapters, loads the converted
    checkpoint one layer at a time (checkpoint.load_model_weights), trains the adapters and saves
    them alone."""
    from transformers import AutoTokenizer

    from moe_sft.conversion.convert import convert
    from tests.cpu.test_families import _hf_model
    from tests.dist.launch import REPO, step_metrics, torchrun

    family = registry.family_by_name("deepseek_v3")
    vocab = len(AutoTokenizer.from_pretrained(str(REPO / "recipes/demo/tokenizer")))
    _hf_model(family, family.tiny_hf_config(vocab_size=vocab, num_hidden_layers=3), tmp_path / "hf")
    convert(tmp_path / "hf", tmp_path / "mcore")
    run = tmp_path / "run"
    proc = torchrun(
        1,
        [
            "trainer.max_steps=3",
            "trainer.log_interval=1",
            "trainer.global_batch_size=4",
            "trainer.export_hf_at_end=false",
            f"trainer.output_dir={run}",
            f"model.hf_path={tmp_path / 'hf'}",
            f"model.mcore_path={tmp_path / 'mcore'}",
            "model.create_tiny_if_missing=false",
            "optimizer.lr=3.0e-3",
            "optimizer.lr_warmup_steps=0",
            "optimizer.lr_decay_style=constant",
            "peft.method=lora",
            "peft.rank=8",
            "peft.target_modules=[all_linear]",
            "peft.fp8_base=true",
        ],
    )
    steps = step_metrics(proc.stdout)
    assert sorted(steps) == [1, 2, 3] and "held in FP8" in proc.stdout
    assert all(s["grad_norm"] > 0 for s in steps.values()) and steps[3]["loss"] < steps[1]["loss"], steps
    from torch.distributed.checkpoint import FileSystemReader

    meta = FileSystemReader(str(run / "checkpoints" / "step_0000003")).read_metadata().state_dict_metadata
    model = [k for k in meta if not k.startswith(("optimizer", "rng_state")) and hasattr(meta[k], "size")]
    assert model and all(".adapter." in k for k in model), model[:8]


def test_fp8_base_keeps_gpt_oss_expert_biases_and_clamped_glu():
    """gpt-oss's experts add a bias after each grouped GEMM and run its clamped SwiGLU
    (layers/expert_bias.py): the FP8 experts' forward takes the same steps, so the FP8 model
    equals its dequantised twin there too (a forward without them would differ)."""
    family = registry.family_by_name("gpt_oss")
    ours, theirs, values, _ = _fp8_and_dequantised(family)
    assert any(k.endswith("mlp.experts.weight1") for k in values)
    l_ours, l_theirs = _loss(ours), _loss(theirs)
    assert torch.equal(l_ours, l_theirs)
    l_ours.backward()
    l_theirs.backward()
    grads = {n: p.grad for n, p in theirs.named_parameters() if p.requires_grad}
    for name, param in ours.named_parameters():
        if param.requires_grad:
            torch.testing.assert_close(param.grad, grads[name], rtol=1e-6, atol=1e-9, msg=name)
