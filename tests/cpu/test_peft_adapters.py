"""The adapters' math on one rank (in-process, fp32): LoRA and DoRA beside a megatron linear equal
peft's on the same nn.Linear (outputs and gradients); the grouped expert adapter equals a loop over
experts; a whole adapted model equals the model whose weights are the merged ones; and the bad
inputs fail with errors naming the field and the fix."""

from __future__ import annotations

import contextlib
import copy

import pytest
import torch

from moe_sft.config import ConfigError
from moe_sft.config.schema import PeftConfig
from moe_sft.models import registry
from moe_sft.models.forward import packed_logits
from moe_sft.peft import install, state, targets


@pytest.fixture(scope="module")
def family():
    return registry.family_by_name("qwen3_moe")


def _model(family, **overrides):
    from moe_sft.conversion.single_rank import single_rank_model

    torch.manual_seed(0)
    return single_rank_model(family, family.tiny_hf_config(num_hidden_layers=2, **overrides))


def _adapted(family, cfg: PeftConfig, **overrides):
    model = _model(family, **overrides)
    tconfig = model.config
    install.add_adapters([model], cfg, tconfig, "cpu")
    install.init_dora_magnitudes([model])
    torch.manual_seed(1)
    with torch.no_grad():  # B starts at 0: move it so the adapters change the output
        for name, param in model.named_parameters():
            if ".adapter.lora_B" in name:
                param.normal_(0, 0.05)
    return model


def _docs(vocab):
    g = torch.Generator().manual_seed(3)
    return [torch.randint(0, vocab, (n,), generator=g).tolist() for n in (7, 12, 5)]


def test_linear_lora_and_dora_equal_peft_on_the_same_linear(family):
    """One unfused row of the attention (linear_proj) against peft's Linear wrapper."""
    from peft import LoraConfig, get_peft_model

    for method in ("lora", "dora"):
        model = _adapted(family, PeftConfig(method=method, rank=4, alpha=8, target_modules=["attention"]))
        proj = model.decoder.layers[0].self_attention.linear_proj
        ref = torch.nn.Sequential()
        ref.add_module("proj", torch.nn.Linear(proj.weight.shape[1], proj.weight.shape[0], bias=False))
        ref.proj.weight.data.copy_(proj.weight.data)
        ref = get_peft_model(ref, LoraConfig(r=4, lora_alpha=8, target_modules=["proj"], use_dora=method == "dora"))
        layer = ref.base_model.model.proj
        layer.lora_A["default"].weight.data.copy_(proj.adapter.lora_A.data)
        layer.lora_B["default"].weight.data.copy_(proj.adapter.lora_B.data)
        if method == "dora":
            mag = layer.lora_magnitude_vector["default"].weight
            assert torch.allclose(mag, proj.adapter.lora_magnitude, atol=1e-6)  # both start at |W| per row
            mag.data.copy_(proj.adapter.lora_magnitude.data * 1.1)
            proj.adapter.lora_magnitude.data.mul_(1.1)
        x = torch.randn(5, 1, proj.weight.shape[1], requires_grad=True)
        ours, _ = proj(x)
        theirs = ref(x)
        torch.testing.assert_close(ours, theirs, rtol=1e-5, atol=1e-5)
        (ours.square().sum()).backward()
        g_ours = [proj.adapter.lora_A.grad, proj.adapter.lora_B.grad]
        x_grad = x.grad.clone()
        x.grad = None
        theirs.square().sum().backward()
        g_ref = [layer.lora_A["default"].weight.grad, layer.lora_B["default"].weight.grad]
        if method == "dora":
            g_ours.append(proj.adapter.lora_magnitude.grad)
            g_ref.append(layer.lora_magnitude_vector["default"].weight.grad)
        for a, b in zip(g_ours, g_ref):
            torch.testing.assert_close(a, b, rtol=1e-4, atol=1e-6)
        torch.testing.assert_close(x_grad, x.grad, rtol=1e-4, atol=1e-6)


def test_grouped_expert_adapter_equals_a_loop_over_experts(family):
    model = _adapted(family, PeftConfig(method="lora", rank=4, alpha=4, target_modules=["experts"]))
    experts = model.decoder.layers[0].mlp.experts
    ad = experts.adapter
    counts = torch.tensor([3, 0, 5, 1, 2, 4, 0, 1])
    x = torch.randn(int(counts.sum()), experts.config.hidden_size)
    got = ad.fc1(x, counts)
    b1 = torch.cat([ad.lora_B1_gate, ad.lora_B1_up], dim=-1)
    want = torch.cat([c @ ad.lora_A1[e] @ b1[e] for e, c in enumerate(torch.split(x, counts.tolist()))]) * ad.scale
    torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-6)
    h = torch.randn(int(counts.sum()), ad.lora_A2.shape[1])
    want2 = torch.cat([c @ ad.lora_A2[e] @ ad.lora_B2[e] for e, c in enumerate(torch.split(h, counts.tolist()))])
    torch.testing.assert_close(ad.fc2(h, counts), want2 * ad.scale, rtol=1e-5, atol=1e-6)


@pytest.mark.parametrize(
    "method,entries,share",
    [("lora", ["all_linear"], "none"), ("lora", ["attention", "experts"], "a"), ("dora", ["attention"], "none")],
)
def test_adapted_model_equals_the_merged_weights(family, method, entries, share):
    """Forward with adapters == forward of the base whose weights are the merged ones (q/k/v and
    gate/up parts laid out as the fused rows, experts' [gate | up] halves, DoRA's rescaled rows)."""
    model = _adapted(
        family,
        PeftConfig(method=method, rank=4, alpha=8, target_modules=entries, share_expert_factor=share),
        mlp_only_layers=[1],
    )
    vocab = model.vocab_size
    with torch.no_grad():
        ours = packed_logits(model, _docs(vocab), vocab)
        merged = dict(state.merged_weights(model))
        plain = _model(family, mlp_only_layers=[1])
        sd = plain.state_dict()
        for name, value in merged.items():
            assert not torch.allclose(sd[name], value), name  # the adapters really change it
            sd[name] = value
        plain.load_state_dict(sd)
        theirs = packed_logits(plain, _docs(vocab), vocab)
    for a, b in zip(ours, theirs):
        torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-5)
    assert len(merged) >= (2 if entries == ["attention"] else 4)


def test_dora_norms_once_per_step_give_the_same_outputs_and_gradients(family, monkeypatch):
    """Inside `dora_norms_once` (the trainer's step and evaluation) each DoRA adapter computes its
    weight norm in the first forward only and the step's other micro-batches reuse it: the same
    outputs and gradients bit for bit as a norm per forward; after the step the norms are
    forgotten, so the optimizer's change is seen."""
    from moe_sft.peft.linear import LinearAdapter

    model = _adapted(family, PeftConfig(method="dora", rank=4, alpha=8, target_modules=["attention"]))
    dora = [a for _, _, a in state.adapters(model)]
    qkv = model.decoder.layers[0].self_attention.linear_qkv  # q/k/v parts, one magnitude per query group
    calls = []
    row_norm = LinearAdapter._row_norm
    monkeypatch.setattr(LinearAdapter, "_row_norm", lambda self, w: calls.append(self) or row_norm(self, w))
    g = torch.Generator().manual_seed(0)
    micro_batches = [torch.randn(n, 1, qkv.weight.shape[1], generator=g) for n in (5, 9, 3)]

    def step(once: bool):
        qkv.zero_grad(set_to_none=True)
        outs = []
        with install.dora_norms_once([model]) if once else contextlib.nullcontext():
            for x in micro_batches:
                out, _ = qkv(x)
                out.square().sum().backward()
                outs.append(out.detach())
        return outs, {n: p.grad.clone() for n, p in qkv.adapter.named_parameters()}

    calls.clear()
    each, each_grads = step(once=False)
    assert len(calls) == len(micro_batches)
    calls.clear()
    once, once_grads = step(once=True)
    assert len(calls) == 1
    assert all(torch.equal(a, b) for a, b in zip(each, once))
    assert any(n.startswith("lora_magnitude") for n in once_grads) and each_grads.keys() == once_grads.keys()
    assert all(torch.equal(each_grads[n], once_grads[n]) for n in each_grads)
    assert all(a._kept_norm is None and not a.keep_norm for a in dora)  # forgotten after the step
    with torch.no_grad():
        qkv.adapter.lora_B_q.add_(0.1)  # the optimizer's step
    changed, _ = step(once=True)
    assert not torch.equal(changed[0], once[0])


@pytest.mark.parametrize("name", [f.name for f in registry.FAMILIES if f.name != "qwen3_moe"])
def test_every_family_adapted_on_all_linears_equals_its_merged_weights(name):
    """MLA's five projections, shared experts, dense first layers, qkv biases, full-width q/k norms."""
    family = registry.family_by_name(name)
    model = _adapted(family, PeftConfig(method="lora", rank=4, alpha=8, target_modules=["all_linear"]))
    vocab = model.vocab_size
    with torch.no_grad():
        ours = packed_logits(model, _docs(vocab), vocab)
        plain = _model(family)
        sd = plain.state_dict()
        sd.update(dict(state.merged_weights(model)))
        plain.load_state_dict(sd)
        theirs = packed_logits(plain, _docs(vocab), vocab)
    for a, b in zip(ours, theirs):
        torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-5)
    assert max((a - b).abs().max() for a, b in zip(ours, packed_logits(_model(family), _docs(vocab), vocab))) > 1e-3


HYBRIDS = [f.name for f in registry.FAMILIES if f.shape(f.tiny_hf_config()).linear_attention is not None]


# rank 16: above the tiny Gated DeltaNet's gate widths (in_proj_b / in_proj_a: 4 rows each,
# in_proj_ba: 8), as a common rank is above Qwen3.5's per-TP-rank b / a rows (32, 16 at TP2)
@pytest.mark.parametrize("rank", [4, 16])
@pytest.mark.parametrize("method", ["lora", "dora"])
@pytest.mark.parametrize("name", HYBRIDS)
def test_hybrid_mixers_get_one_adapter_per_transformers_projection(name, method, rank):
    """A Gated DeltaNet layer and a gated attention layer with adapters on their mixers
    (`attention`): in_proj gets one A per transformers projection (Qwen3-Next: in_proj_qkvz,
    in_proj_ba; Qwen3.5: in_proj_qkv, _z, _b, _a) and a B (and DoRA magnitude) per part q, k, v,
    z, b, a; the gated linear_qkv's q part holds each head's query and gate rows (q_proj's). The
    merged weights give the adapted model's packed logits, and a backward reaches every adapter
    factor and nothing else."""
    from moe_sft.models.forward import packed_batch

    family = registry.family_by_name(name)
    # one query group: what each TP rank of a two-group model holds (the factor names must not change)
    layers = {"layer_types": ["linear_attention", "full_attention"], "num_key_value_heads": 1}
    model = _adapted(family, PeftConfig(method=method, rank=rank, alpha=8, target_modules=["attention"]), **layers)
    if method == "dora":  # off |W| per row, differently per part: a part mixed up changes the output
        with torch.no_grad():
            for pname, param in model.named_parameters():
                if "lora_magnitude" in pname:
                    param.mul_(1 + 0.2 * torch.rand(param.shape, generator=torch.Generator().manual_seed(len(pname))))
    cfg = model.config
    gdn, attention = model.decoder.layers[0].self_attention, model.decoder.layers[1].self_attention
    names = {n for n, _ in gdn.in_proj.adapter.named_parameters()}
    want = {f"lora_A_{p}" for p in cfg.linear_attention_projections} | {f"lora_B_{p}" for p in "qkvzba"}
    want |= {f"lora_magnitude_{p}" for p in "qkvzba"} if method == "dora" else set()
    assert names == want, (names, want)
    assert "".join(cfg.linear_attention_projections) == "qkvzba"
    assert gdn.out_proj.adapter.lora_A.shape == (rank, cfg.linear_num_value_heads * cfg.linear_value_head_dim)
    assert gdn.in_proj.adapter.lora_B_b.shape == (cfg.linear_num_value_heads, rank)
    assert attention.linear_qkv.adapter.lora_B_q.shape[0] == 2 * cfg.num_attention_heads * cfg.kv_channels
    magnitudes = {n for n, _ in attention.linear_qkv.adapter.named_parameters() if "magnitude" in n}
    assert magnitudes == ({"lora_magnitude"} if method == "dora" else set())  # whole query groups per TP rank

    vocab = model.vocab_size
    with torch.no_grad():
        ours = packed_logits(model, _docs(vocab), vocab)
        merged = dict(state.merged_weights(model))
        plain = _model(family, **layers)
        sd = plain.state_dict()
        for key, value in merged.items():
            assert not torch.allclose(sd[key], value), key  # the adapters really change it
            sd[key] = value
        plain.load_state_dict(sd)
        theirs = packed_logits(plain, _docs(vocab), vocab)
    assert len(merged) == 4  # in_proj, out_proj, linear_qkv, linear_proj
    for a, b in zip(ours, theirs):
        torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-5)

    tokens, positions, params = packed_batch(_docs(vocab), "cpu")
    model(
        input_ids=tokens, position_ids=positions, attention_mask=None, packed_seq_params=params
    ).square().mean().backward()
    trained = {n: p for n, p in model.named_parameters() if p.requires_grad}
    assert trained and all(".adapter." in n for n in trained), sorted(trained)
    assert all(p.grad is not None and p.grad.abs().sum() > 0 for p in trained.values()), [
        n for n, p in trained.items() if p.grad is None or not p.grad.abs().sum()
    ]
    assert all(p.grad is None for n, p in model.named_parameters() if not p.requires_grad)


@pytest.mark.parametrize("name", HYBRIDS)
def test_the_gated_deltanet_gates_do_not_cap_the_rank_but_other_widths_do(name):
    """The gate projections (in_proj_b / in_proj_a, in_proj_ba: a few rows) are left out of the rank
    check, before the build and at it, with one log line; the key/value width (2 heads of 32 here,
    below the hidden size) still caps."""
    family = registry.family_by_name(name)
    layers = {"layer_types": ["linear_attention", "full_attention"], "head_dim": 32}
    shape = family.shape(family.tiny_hf_config(num_hidden_layers=2, **layers))
    gates = {p: w for p, w in shape.linear_attention.projection_widths().items() if targets.is_gdn_gate(p)}
    assert gates and max(gates.values()) < 16, gates
    assert targets.rank_errors(16, ["attention"], shape) == []
    assert targets.rank_errors(64, ["attention"], shape) == []
    assert targets.rank_errors(65, ["attention"], shape) == [
        "peft.rank=65 exceeds the smallest projection width of 'attention' in this model (64); "
        "lower peft.rank to <= 64 (typical: 8-64)"
    ]

    def install_at(rank: int) -> list[str]:
        model = _model(family, **layers)
        cfg = PeftConfig(method="lora", rank=rank, target_modules=["attention"])
        return install.add_adapters([model], cfg, model.config, "cpu")

    capped = ", ".join(f"in_proj_{p} ({w} rows)" for p, w in gates.items())
    lines = install_at(16)
    assert len(lines) == 3 and f"gate projections {capped} are narrower than rank 16" in lines[2], lines
    assert len(install_at(4)) == 2  # no note where the gates are wide enough
    with pytest.raises(
        ConfigError, match=r"peft.rank=65 exceeds decoder.layers.1.self_attention.linear_qkv's out\[k\]=64, out\[v\]=64"
    ):
        install_at(65)


def test_a_transformers_projection_name_says_which_module_holds_it():
    family = registry.family_by_name("qwen3_5_moe")
    model = _model(family, layer_types=["linear_attention", "full_attention"])
    cfg = PeftConfig(method="lora", rank=4, target_modules=["in_proj_z", "o_proj"])
    with pytest.raises(ConfigError) as err:
        install.add_adapters([model], cfg, model.config, "cpu")
    text = str(err.value)
    assert "['in_proj_z', 'o_proj'] match no module" in text, text
    assert "in_proj_z is (part of) decoder.layers.*.self_attention.in_proj" in text, text
    assert "o_proj is (part of) decoder.layers.*.self_attention.linear_proj" in text, text


def test_only_adapters_train_and_the_router_on_request(family):
    model = _adapted(family, PeftConfig(method="lora", target_modules=["attention"], rank=4, train_router=True))
    trained = {n for n, p in model.named_parameters() if p.requires_grad}
    assert trained and all(".adapter." in n or ".router." in n for n in trained)
    assert any(".router." in n for n in trained)
    assert not any("experts" in n for n in trained)


def test_a_target_matching_nothing_lists_the_modules(family):
    model = _model(family)
    with pytest.raises(ConfigError) as err:
        install.add_adapters([model], PeftConfig(method="lora", target_modules=["shared_experts"]), model.config, "cpu")
    text = str(err.value)
    assert "peft.target_modules: ['shared_experts'] match no module" in text, text
    for name in ("self_attention.linear_qkv", "self_attention.linear_proj", "mlp.experts"):  # what there is
        assert f"'decoder.layers.*.{name}'" in text, text


COVERAGE_CASES = [
    (
        "qwen3_moe",
        {},
        "lora",
        ["attention", "experts"],
        "attention q/k/v/o 2/2 layers, routed experts fc1/fc2 2/2 layers x 8 experts",
    ),
    (
        "qwen3_moe",
        {},
        "lora",
        ["decoder.layers.1.self_attention.linear_qkv"],
        "attention q/k/v 1/2 layers, o 0/2 layers; not targeted: routed experts fc1/fc2 (2 layers)",
    ),
    (
        "deepseek_v3",
        {"first_k_dense_replace": 1},
        "dora",
        ["attention"],
        "attention q_a/q_b/kv_a/kv_b/o 2/2 layers; not targeted: dense MLP fc1/fc2 (1 layer), "
        "shared expert fc1/fc2 (1 layer), routed experts fc1/fc2 (1 layer)",
    ),
    (
        "qwen3_5_moe",
        {"layer_types": ["linear_attention", "full_attention"]},
        "lora",
        ["all_linear"],
        "attention q/k/v/o 1/1 layer, linear attention (Gated DeltaNet) in_proj/out_proj 1/1 layer, "
        "shared expert fc1/fc2 2/2 layers, routed experts fc1/fc2 2/2 layers x 8 experts",
    ),
]


@pytest.mark.parametrize(("name", "overrides", "method", "entries", "coverage"), COVERAGE_CASES)
def test_the_startup_log_says_where_the_adapters_went(name, overrides, method, entries, coverage):
    """Per module kind, over the whole model: the layers (and experts) that got adapters, and the
    kinds the model has that no target reached (issue 46 item 4)."""
    family = registry.family_by_name(name)
    model = _model(family, **overrides)
    cfg = PeftConfig(method=method, rank=4, target_modules=entries)
    lines = install.add_adapters([model], cfg, model.config, "cpu")
    assert lines[1] == f"peft coverage: {dict(lora='LoRA', dora='DoRA')[method]} r4 on: {coverage}", lines


def test_rank_above_a_width_is_refused_before_and_at_build(family):
    cfg = family.tiny_hf_config(num_hidden_layers=2)
    shape = family.shape(cfg)
    errors = targets.rank_errors(10_000, ["attention", "experts"], shape)
    assert len(errors) == 2 and "peft.rank=10000 exceeds" in errors[0] and "lower peft.rank" in errors[0]
    assert targets.rank_errors(8, ["attention", "experts"], shape) == []
    model = _model(family)
    with pytest.raises(
        ConfigError, match=r"peft.rank=1000 exceeds decoder.layers.0.self_attention.linear_(qkv|proj)'s in=128"
    ):
        install.add_adapters(
            [model], PeftConfig(method="lora", rank=1000, target_modules=["attention"]), model.config, "cpu"
        )


def test_dora_on_experts_is_refused(family):
    model = _model(family)
    with pytest.raises(ConfigError, match="peft.method=dora on routed experts"):
        install.add_adapters([model], PeftConfig(method="dora", target_modules=["experts"]), model.config, "cpu")


def test_preflight_refuses_bad_peft_options():
    from moe_sft.config.load import load_recipe
    from moe_sft.config.validate import check_peft

    cfg = load_recipe("recipes/quickstart_lora.yaml")
    assert check_peft(cfg, 1) == []
    bad = copy.deepcopy(cfg)
    bad.model.backend = "te"
    bad.peft.rank, bad.peft.alpha, bad.peft.dropout, bad.peft.lr = 0, 0.0, 1.0, -1.0
    bad.peft.share_expert_factor = "a"
    bad.parallel.expert_tensor_parallel_size = 2
    text = "\n".join(check_peft(bad, 2))
    for needle in (
        "peft.rank=0",
        "peft.alpha=0.0",
        "peft.dropout=1.0",
        "peft.lr=-1.0",
        "model.backend=te",
        "expert tensor parallel 1",
    ):
        assert needle in text, (needle, text)
    dora = copy.deepcopy(cfg)
    dora.peft.method, dora.peft.dropout = "dora", 0.1
    assert "peft.dropout=0.1 with peft.method=dora" in "\n".join(check_peft(dora, 1))


def test_resume_checks_adapters_and_base(tmp_path):
    from moe_sft.conversion import mcore_io
    from moe_sft.peft import run_meta

    base = tmp_path / "base"
    base.mkdir()
    mcore_io.write_meta(base, {"source": "hf"})
    lora = PeftConfig(method="lora", rank=8)
    saved = run_meta.record(lora, base)
    run_meta.check_resume(saved, lora, base, tmp_path / "ck")  # the same: fine
    with pytest.raises(ConfigError, match=r"peft.rank=4 \(checkpoint: 8\)"):
        run_meta.check_resume(saved, PeftConfig(method="lora", rank=4), base, tmp_path / "ck")
    with pytest.raises(ConfigError, match="peft.method=none: .* holds lora adapters"):
        run_meta.check_resume(saved, PeftConfig(method="none"), base, tmp_path / "ck")
    with pytest.raises(ConfigError, match="is a full-parameter SFT run"):
        run_meta.check_resume({}, lora, base, tmp_path / "ck")
    other = tmp_path / "other"
    other.mkdir()
    mcore_io.write_meta(other, {"source": "another"})
    with pytest.raises(ConfigError, match="is not the base"):
        run_meta.check_resume(saved, lora, other, tmp_path / "ck")
