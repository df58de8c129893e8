"""Routed-expert biases and gpt-oss's clamped SwiGLU in TorchGroupedMLP (moe_sft/layers/expert_bias.py),
fp32 on CPU: the grouped experts equal transformers' GptOssExperts and a plain loop over experts on
the same weights and routing (outputs and every gradient), experts without tokens included; the
bias-free SwiGLU path is unchanged; the fc2 bias counts once over expert TP; the checkpoint entries
have SequentialMLP's keys and global shapes at EP1 and at a faked EP2 x ETP2 rank."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

H, FFN, E, K, T = 16, 8, 5, 2, 11  # hidden, expert ffn, experts, top-k, tokens
USED = (0, 2, 3, 4)  # expert 1 gets no token
# fp32 sums in another order than HF's (probs before fc2, not after): a few ulps of values of order 1-10
TOL = dict(rtol=1e-5, atol=1e-5)


@pytest.fixture
def single_rank():
    from moe_sft.conversion.single_rank import init_single_rank

    init_single_rank("fp32")


def _experts(gpt_oss: bool = True, num_experts: int = E):
    from megatron.core.fusions.fused_bias_geglu import quick_gelu
    from megatron.core.process_groups_config import ProcessGroupCollection
    from megatron.core.transformer.transformer_config import TransformerConfig

    from moe_sft.layers.experts import TorchGroupedMLP

    act = dict(activation_func=quick_gelu, glu_linear_offset=1.0, activation_func_clamp_value=7.0)
    config = TransformerConfig(
        num_layers=1,
        hidden_size=H,
        num_attention_heads=1,
        num_moe_experts=num_experts,
        moe_ffn_hidden_size=FFN,
        moe_router_topk=K,
        moe_grouped_gemm=True,
        gated_linear_unit=True,
        add_bias_linear=gpt_oss,
        bias_activation_fusion=False,
        use_cpu_initialization=True,
        params_dtype=torch.float32,
        **(act if gpt_oss else dict(activation_func=F.silu)),
    )
    torch.manual_seed(0)
    n_local = num_experts // torch.distributed.get_world_size(ProcessGroupCollection.use_mpu_process_groups().ep)
    return TorchGroupedMLP(n_local, config, pg_collection=ProcessGroupCollection.use_mpu_process_groups())


def _routing():
    g = torch.Generator().manual_seed(1)
    choices = torch.tensor(USED)
    idx = torch.stack([choices[torch.randperm(len(USED), generator=g)[:K]] for _ in range(T)])
    weights = torch.softmax(torch.randn(T, K, generator=g), dim=-1)
    # large enough inputs that the clamp at 7 cuts some gate and up values
    return torch.randn(T, H, generator=g) * 4, idx, weights


def _hf_experts():
    from transformers import GptOssConfig
    from transformers.models.gpt_oss.modeling_gpt_oss import GptOssExperts

    cfg = GptOssConfig(hidden_size=H, intermediate_size=FFN, num_local_experts=E, num_experts_per_tok=K)
    hf = GptOssExperts(cfg)
    g = torch.Generator().manual_seed(2)
    with torch.no_grad():
        for p in hf.parameters():
            p.copy_(torch.randn(p.shape, generator=g) * 0.5)
    return hf


def _copy_hf_into(experts, hf):
    """HF interleaves gate/up columns; megatron's GLU layout has gate | up halves (the converter's job)."""
    w = hf.gate_up_proj.detach()
    b = hf.gate_up_proj_bias.detach()
    with torch.no_grad():
        experts.weight1.copy_(torch.cat((w[..., ::2], w[..., 1::2]), -1).reshape(H, -1))
        experts.weight2.copy_(hf.down_proj.detach().reshape(-1, H))
        experts.bias1.copy_(torch.cat((b[:, ::2], b[:, 1::2]), -1))
        experts.bias2.copy_(hf.down_proj_bias.detach())


def _permute(x, idx, weights):
    """Rows grouped by expert (megatron's dispatcher order within an expert does not matter)."""
    order = torch.argsort(idx.flatten(), stable=True)
    token = order // K
    counts = torch.bincount(idx.flatten(), minlength=E)
    return x[token], counts, weights.flatten()[order], token


def _loop_reference(x, counts, probs, w1, b1, w2, b2):
    """gpt-oss's expert in megatron's layout, one expert at a time."""
    outs = []
    for e, (xe, pe) in enumerate(zip(torch.split(x, counts.tolist()), torch.split(probs, counts.tolist()))):
        gate, up = torch.chunk(xe @ w1[e] + b1[e], 2, -1)
        gate, up = gate.clamp(max=7.0), up.clamp(-7.0, 7.0)
        h = (up + 1) * gate * torch.sigmoid(1.702 * gate)
        outs.append((h @ w2[e] + b2[e]) * pe[:, None])
    return torch.cat(outs)


def _grads(params):
    return [p.grad.clone() for p in params]


def test_biased_clamped_swiglu_equals_gpt_oss_and_a_loop(single_rank):
    experts, hf = _experts(), _hf_experts()
    _copy_hf_into(experts, hf)
    x, idx, weights = _routing()
    g_out = torch.randn(T, H, generator=torch.Generator().manual_seed(3))

    x_hf, w_hf = x.clone().requires_grad_(), weights.clone().requires_grad_()
    (hf(x_hf, idx, w_hf) * g_out).sum().backward()

    x_ours, w_ours = x.clone().requires_grad_(), weights.clone().requires_grad_()
    rows, counts, probs, token = _permute(x_ours, idx, w_ours)
    assert counts[1] == 0
    out, bias = experts(rows, counts, probs)
    assert bias is None
    ours = torch.zeros(T, H).index_add(0, token, out)
    (ours * g_out).sum().backward()

    torch.testing.assert_close(ours, hf(x, idx, weights).detach(), **TOL)
    torch.testing.assert_close(x_ours.grad, x_hf.grad, **TOL)
    torch.testing.assert_close(w_ours.grad, w_hf.grad, **TOL)
    gw1, gb1 = hf.gate_up_proj.grad, hf.gate_up_proj_bias.grad
    torch.testing.assert_close(
        experts.weight1.grad, torch.cat((gw1[..., ::2], gw1[..., 1::2]), -1).reshape(H, -1), **TOL
    )
    torch.testing.assert_close(experts.bias1.grad, torch.cat((gb1[:, ::2], gb1[:, 1::2]), -1), **TOL)
    torch.testing.assert_close(experts.weight2.grad, hf.down_proj.grad.reshape(-1, H), **TOL)
    torch.testing.assert_close(experts.bias2.grad, hf.down_proj_bias.grad, **TOL)
    # the expert without tokens: zero gradients
    assert experts.bias1.grad[1].abs().max() == 0 and experts.bias2.grad[1].abs().max() == 0

    # the loop over experts in megatron's layout, on the same rows
    params = [experts.weight1, experts.bias1, experts.weight2, experts.bias2]
    rows_l, probs_l = rows.detach().requires_grad_(), probs.detach().requires_grad_()
    ref_params = [p.detach().clone().requires_grad_() for p in params]
    w1, b1, w2, b2 = ref_params
    ref = _loop_reference(rows_l, counts, probs_l, w1.view(E, H, -1), b1, w2.view(E, -1, H), b2)
    torch.testing.assert_close(out, ref, **TOL)
    rows_o, probs_o = rows.detach().requires_grad_(), probs.detach().requires_grad_()
    g_rows = torch.randn(ref.shape, generator=torch.Generator().manual_seed(4))
    (ref * g_rows).sum().backward()
    for p in params:
        p.grad = None
    (experts(rows_o, counts, probs_o)[0] * g_rows).sum().backward()
    for mine, theirs in zip([*_grads(params), rows_o.grad, probs_o.grad], [*ref_params, rows_l, probs_l]):
        torch.testing.assert_close(mine, theirs.grad, **TOL)


def test_no_rows_keeps_biases_in_the_graph(single_rank):
    experts = _experts()
    x = torch.zeros(0, H, requires_grad=True)
    probs = torch.zeros(0, requires_grad=True)
    out, _ = experts(x, torch.zeros(E, dtype=torch.long), probs)
    out.sum().backward()
    assert out.shape == (0, H)
    for p in (experts.weight1, experts.weight2, experts.bias1, experts.bias2):
        assert p.grad is not None and p.grad.abs().max() == 0
    assert probs.grad is not None


def test_bias_free_swiglu_path_is_unchanged(single_rank):
    from moe_sft.layers.experts import grouped_matmul

    experts = _experts(gpt_oss=False)
    assert experts.bias1 is None and experts.bias2 is None and not experts._extended_glu
    assert {n for n, _ in experts.named_parameters()} == {"weight1", "weight2"}
    x, idx, weights = _routing()
    rows, counts, probs, _ = _permute(x, idx, weights)
    out, _ = experts(rows, counts, probs)
    w1, w2 = experts.weight1.view(E, H, -1), experts.weight2.view(E, -1, H)
    h = experts.activation_func_with_probs(grouped_matmul(rows, w1, counts), probs.unsqueeze(-1))
    assert torch.equal(out, grouped_matmul(h, w2, counts))
    gate, up = torch.chunk(torch.cat([r @ w1[e] for e, r in enumerate(torch.split(rows, counts.tolist()))]), 2, -1)
    loop = torch.cat(
        [r @ w2[e] for e, r in enumerate(torch.split(F.silu(gate) * up * probs[:, None], counts.tolist()))]
    )
    torch.testing.assert_close(out, loop, **TOL)


def test_fc2_bias_counts_once_over_expert_tp():
    """Rank 0 adds p * b; another expert-TP rank adds exactly 0 yet gives b the same gradient, and
    its probs no bias term (the probs' gradient is summed over expert TP)."""
    from moe_sft.layers.expert_bias import fc2_bias

    g = torch.Generator().manual_seed(5)
    counts = torch.tensor([3, 0, 2])
    out, g_out = torch.randn(5, H, generator=g), torch.randn(5, H, generator=g)
    results = []
    for etp_rank in (0, 1):
        b = torch.randn(3, H, generator=torch.Generator().manual_seed(6)).requires_grad_()
        p = torch.rand(5, generator=torch.Generator().manual_seed(7)).requires_grad_()
        y = fc2_bias(out, b, counts, p, etp_rank)
        (y * g_out).sum().backward()
        results.append((y.detach(), b.grad, p.grad))
    (y0, gb0, gp0), (y1, gb1, gp1) = results
    b_rows = torch.repeat_interleave(b.detach(), counts, dim=0)
    torch.testing.assert_close(y0, out + b_rows * p.detach()[:, None])
    assert torch.equal(y1, out)
    assert torch.equal(gb0, gb1)
    torch.testing.assert_close(gp0, (b_rows * g_out).sum(-1))
    assert gp1 is None  # not in this graph; the activation's probs product is, in the experts


def _entries(experts, prefix="decoder.layers.0.mlp."):
    sd = experts.sharded_state_dict(prefix=prefix, sharded_offsets=((0, 0, 1),))
    built = {name: sd[f"{prefix}{name}"].build() for name in ("bias1", "bias2")}
    return sd, built


def test_bias_checkpoint_entries_at_ep1(single_rank):
    experts = _experts()
    sd, built = _entries(experts)
    fc1, fc2 = built["bias1"], built["bias2"]
    assert [t.key for t in fc1] == ["decoder.layers.0.mlp.experts.linear_fc1.bias"] * 2
    assert all(t.global_shape == (1, E, 2 * FFN) for t in fc1)
    assert [t.global_offset for t in fc1] == [(0, 0, 0), (0, 0, FFN)]
    torch.testing.assert_close(torch.cat([t.data for t in fc1], -1), experts.bias1.detach())
    assert fc2.key == "decoder.layers.0.mlp.experts.linear_fc2.bias"
    assert (fc2.global_shape, fc2.global_offset) == ((1, E, H), (0, 0, 0))
    # the weights' entries are GroupedMLP's, untouched by the biases
    assert sd["decoder.layers.0.mlp.weight1"].key == "decoder.layers.0.mlp.experts.linear_fc1.weight"
    assert sd["decoder.layers.0.mlp.weight2"].key == "decoder.layers.0.mlp.experts.linear_fc2.weight"
    # and the merge is the build's inverse
    assert torch.equal(sd["decoder.layers.0.mlp.bias1"].merge_fn([t.data for t in fc1]), experts.bias1.detach())


def test_bias_checkpoint_entries_one_tensor_per_expert(single_rank):
    """megatron's `singleton_local_shards` format: a key per expert, GLU halves as _w/_v."""
    experts = _experts()
    prefix = "decoder.layers.0.mlp."
    sd = experts.sharded_state_dict(prefix=prefix, metadata={"singleton_local_shards": True})
    fc1, fc2 = sd[f"{prefix}bias1"].build(), sd[f"{prefix}bias2"].build()
    assert [t.key for t in fc1["w"]] == [f"{prefix}experts.{e}.linear_fc1.bias_w" for e in range(E)]
    assert [t.key for t in fc2] == [f"{prefix}experts.{e}.linear_fc2.bias" for e in range(E)]
    assert fc1["v"][0].global_shape == (FFN,) and fc2[0].global_shape == (H,)
    merged = sd[f"{prefix}bias1"].merge_fn({"w": [t.data for t in fc1["w"]], "v": [t.data for t in fc1["v"]]})
    assert torch.equal(merged, experts.bias1.detach())


def _reset_world():
    import torch.distributed as dist
    from megatron.core import parallel_state

    if parallel_state.model_parallel_is_initialized():
        parallel_state.destroy_model_parallel()
    if dist.is_initialized():
        dist.destroy_process_group()


def test_bias_checkpoint_entries_at_a_faked_ep2_etp2_rank():
    """Rank 3 of 4 with EP2 x ETP2 (torch's fake process group: collectives are no-ops): the second
    expert-TP rank of the second EP rank holds experts 2..3 of 4 (E=4 here), gate piece 1 and up
    piece 3 of 4 of fc1's bias, and a non-main replica of fc2's."""
    import torch.distributed as dist
    from megatron.core import parallel_state, tensor_parallel
    from torch.testing._internal.distributed.fake_pg import FakeStore

    _reset_world()
    try:
        dist.init_process_group("fake", store=FakeStore(), rank=3, world_size=4)
        parallel_state.initialize_model_parallel(
            expert_model_parallel_size=2, expert_tensor_parallel_size=2, create_gloo_process_groups=False
        )
        tensor_parallel.model_parallel_cuda_manual_seed(1)
        experts = _experts(num_experts=4)
        assert (experts.ep_group.rank(), experts.tp_group.rank()) == (1, 1)
        assert experts.bias1.shape == (2, FFN) and experts.bias2.shape == (2, H)  # FFN/2 of gate, FFN/2 of up
        assert experts.bias2.shared and experts.bias1.tensor_model_parallel
        _, built = _entries(experts)
        gate, up = built["bias1"]
        assert gate.global_shape == up.global_shape == (1, 4, 2 * FFN)
        assert (gate.global_offset, up.global_offset) == ((0, 2, FFN // 2), (0, 2, 3 * FFN // 2))
        fc2 = built["bias2"]
        assert (fc2.global_shape, fc2.global_offset) == ((1, 4, H), (0, 2, 0))
        assert fc2.replica_id[1] == 1  # rank 0 of expert TP writes it
    finally:
        _reset_world()


def _sequential_mlp(config):
    from megatron.core.process_groups_config import ProcessGroupCollection
    from megatron.core.tensor_parallel import ColumnParallelLinear, RowParallelLinear
    from megatron.core.transformer.mlp import MLPSubmodules
    from megatron.core.transformer.moe.experts import SequentialMLP

    subs = MLPSubmodules(linear_fc1=ColumnParallelLinear, linear_fc2=RowParallelLinear)
    return SequentialMLP(E, config, subs, pg_collection=ProcessGroupCollection.use_mpu_process_groups())


def _save_then_load(src, dst, directory):
    from megatron.core import dist_checkpointing

    prefix, offsets = "decoder.layers.0.mlp.", ((0, 0, 1),)
    directory.mkdir()
    dist_checkpointing.save({"m": src.sharded_state_dict(prefix, offsets)}, str(directory))
    loaded = dist_checkpointing.load(
        {"m": dst.sharded_state_dict(prefix, offsets)}, str(directory), strict="assume_ok_unexpected"
    )
    state = {k.removeprefix(prefix): v for k, v in loaded["m"].items() if "_extra_state" not in k}
    dst.load_state_dict(state, strict=False)


def test_bias_checkpoint_loads_into_sequential_mlp_and_back(single_rank, tmp_path):
    """The same global tensors as megatron's SequentialMLP (the per-expert format TEGroupedMLP shares)."""
    ours = _experts()
    seq = _sequential_mlp(ours.config)
    with torch.no_grad():
        for p in ours.parameters():
            p.copy_(torch.randn(p.shape, generator=torch.Generator().manual_seed(p.numel())))
    _save_then_load(ours, seq, tmp_path / "ours")
    for e, expert in enumerate(seq.local_experts):
        assert torch.equal(expert.linear_fc1.bias, ours.bias1[e]) and torch.equal(expert.linear_fc2.bias, ours.bias2[e])
        assert torch.equal(expert.linear_fc1.weight, ours.weight1.view(E, H, -1)[e].T)
    back = _experts()
    _save_then_load(seq, back, tmp_path / "seq")
    for name in ("weight1", "weight2", "bias1", "bias2"):
        assert torch.equal(getattr(back, name), getattr(ours, name)), name


@pytest.mark.parametrize("chunk", [1 << 24, 24 * 100])  # one pass, and chunks that split an expert's rows
def test_bias_gradient_is_each_experts_row_sum_in_fp32_rounded_once(monkeypatch, chunk):
    """bf16 rows, as on the GPU: the gradient is the fp64 sum over each expert's rows to one bf16
    rounding (an expert without rows gets 0), whatever the chunking of the fp32 accumulation."""
    from moe_sft.layers import expert_bias

    monkeypatch.setattr(expert_bias, "_SUM_CHUNK_ELEMENTS", chunk)
    counts = torch.tensor([300, 0, 1000, 57])
    rows = int(counts.sum())
    g = torch.Generator().manual_seed(0)
    bias = torch.randn(4, 24, generator=g).to(torch.bfloat16).requires_grad_(True)
    grad = torch.randn(rows, 24, generator=g).to(torch.bfloat16)
    out = expert_bias.per_row(bias, counts, rows)
    assert torch.equal(out, torch.repeat_interleave(bias.detach(), counts, dim=0))
    out.backward(grad)
    ends = counts.cumsum(0).tolist()
    exact = torch.stack([grad[e - n : e].double().sum(0) for n, e in zip(counts.tolist(), ends)])
    assert bias.grad.dtype == torch.bfloat16 and not bias.grad[1].any()
    # one rounding of the fp32 sum: within half a bf16 ulp of the exact value, plus fp32's error
    torch.testing.assert_close(bias.grad.double(), exact, rtol=2**-8, atol=1e-5)
