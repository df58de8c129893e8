"""moe_sft/layers/gated_delta_net.py: packed documents never see each other, in the convolution,
the recurrent state or the gradients; the whole hybrid model matches transformers per document on
lengths that straddle the delta rule's 64-token chunk, a 1-token document and documents longer
than the convolution kernel."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from moe_sft.layers import gated_delta_net as gdn
from moe_sft.models import registry
from moe_sft.runtime import cpu_compat

LENGTHS = (1, 3, 63, 65, 130)  # 1 token; < kernel; one short of, one past and two chunks


def _cu(lengths) -> torch.Tensor:
    return torch.tensor([0, *lengths]).cumsum(0).to(torch.int32)


def test_convolution_restarts_at_every_document():
    g = torch.Generator().manual_seed(0)
    x = torch.randn(sum(LENGTHS), 6, generator=g, dtype=torch.float64)
    w = torch.randn(6, 4, generator=g, dtype=torch.float64)
    packed = gdn.causal_conv_per_document(x, w, _cu(LENGTHS))
    alone = [
        F.silu(F.conv1d(doc.T[None], w[:, None], padding=3, groups=6)[0, :, : len(doc)].T)
        for doc in torch.split(x, LENGTHS)
    ]
    torch.testing.assert_close(packed, torch.cat(alone), rtol=1e-12, atol=1e-12)


def test_delta_rule_state_and_gradients_stay_in_their_document():
    g = torch.Generator().manual_seed(1)
    tokens, heads = sum(LENGTHS), 2
    q = F.normalize(torch.randn(tokens, heads, 8, generator=g), dim=-1).requires_grad_()
    k = F.normalize(torch.randn(tokens, heads, 8, generator=g), dim=-1).requires_grad_()
    v = torch.randn(tokens, heads, 4, generator=g, requires_grad=True)
    decay = -torch.rand(tokens, heads, generator=g)
    beta = torch.rand(tokens, heads, generator=g)
    packed = gdn.gated_delta_rule_per_document(q, k, v, decay, beta, _cu(LENGTHS))
    weights = torch.randn(packed.shape, generator=g)
    (packed * weights).sum().backward()
    grads = [t.grad.clone() for t in (q, k, v)]
    # a change in the last document changes nothing before it, forward or backward
    v2 = v.detach().clone()
    v2[-LENGTHS[-1] :] += 1.0
    changed = gdn.gated_delta_rule_per_document(q.detach(), k.detach(), v2, decay, beta, _cu(LENGTHS))
    head = tokens - LENGTHS[-1]
    assert torch.equal(changed[:head], packed.detach()[:head])
    assert not torch.equal(changed[head:], packed.detach()[head:])
    # each document alone gives the packed rows and gradients
    start = 0
    for n in LENGTHS:
        part = [t.detach()[start : start + n].clone().requires_grad_() for t in (q, k, v)]
        out = gdn.gated_delta_rule_per_document(*part, decay[start : start + n], beta[start : start + n], None)
        torch.testing.assert_close(out, packed.detach()[start : start + n], rtol=1e-6, atol=1e-6)
        (out * weights[start : start + n]).sum().backward()
        for mine, ref in zip(part, grads):
            torch.testing.assert_close(mine.grad, ref[start : start + n], rtol=1e-5, atol=1e-6)
        start += n


def test_delta_rule_equals_megatrons_torch_implementation_per_document():
    """The batched delta rule (one triangular solve, all documents' chunks at once) against
    megatron's `torch_chunk_gated_delta_rule` run on each document alone: outputs and the
    gradients of q, k, v, the decay and beta within fp32 rounding, on documents of 1 to 200 tokens
    (random lengths, seeded) that straddle the 64-token chunk."""
    from megatron.core.ssm.gated_delta_net import torch_chunk_gated_delta_rule

    g = torch.Generator().manual_seed(3)
    lengths = [*LENGTHS, 64, 128, 200, *torch.randint(1, 140, (12,), generator=g).tolist()]
    tokens, heads = sum(lengths), 3
    inputs = [
        F.normalize(torch.randn(tokens, heads, 16, generator=g), dim=-1),
        F.normalize(torch.randn(tokens, heads, 16, generator=g), dim=-1),
        torch.randn(tokens, heads, 8, generator=g),
        -torch.rand(tokens, heads, generator=g) * 2,
        torch.rand(tokens, heads, generator=g),
    ]
    weights = torch.randn(tokens, heads, 8, generator=g)

    def run(fn):
        leaves = [x.clone().requires_grad_() for x in inputs]
        out = fn(*leaves)
        (out * weights).sum().backward()
        return out.detach(), [x.grad for x in leaves]

    def megatron(q, k, v, decay, beta):
        parts = [
            torch_chunk_gated_delta_rule(
                q[None, a:b], k[None, a:b], v[None, a:b], g=decay[None, a:b], beta=beta[None, a:b]
            )[0][0]
            for a, b in zip(_cu(lengths).tolist()[:-1], _cu(lengths).tolist()[1:])
        ]
        return torch.cat(parts)

    ours, our_grads = run(lambda *x: gdn.gated_delta_rule_per_document(*x, _cu(lengths)))
    reference, reference_grads = run(megatron)
    torch.testing.assert_close(ours, reference, rtol=1e-5, atol=1e-6)
    for name, mine, ref in zip(("q", "k", "v", "decay", "beta"), our_grads, reference_grads):
        torch.testing.assert_close(mine, ref, rtol=1e-5, atol=1e-5, msg=name)


def test_packed_hybrid_model_matches_transformers_per_document(tmp_path):
    from moe_sft.conversion.convert import convert
    from moe_sft.conversion.export import load_model_from_checkpoint
    from moe_sft.models.forward import packed_logits

    family = registry.family_by_name("qwen3_next")
    vocab = 300
    with cpu_compat.suspended():
        torch.manual_seed(0)
        hf = family.hf_model_class(family.tiny_hf_config(vocab_size=vocab)).eval()
        hf.save_pretrained(str(tmp_path / "hf"))
    convert(tmp_path / "hf", tmp_path / "mcore")
    g = torch.Generator().manual_seed(2)
    docs = [torch.randint(0, vocab, (n,), generator=g).tolist() for n in LENGTHS]
    with cpu_compat.suspended(), torch.no_grad():
        refs = [hf(torch.tensor([d])).logits[0].float() for d in docs]
    model = load_model_from_checkpoint(tmp_path / "mcore").eval()
    ours = packed_logits(model, docs, vocab)
    worst = max((r - o).abs().max().item() for r, o in zip(refs, ours))
    print(f"qwen3_next packed {LENGTHS}: max abs logit diff {worst:.3e}")
    assert worst <= 1e-4


def test_head_all_to_all_gives_whole_documents_and_back():
    """CP's all-to-all (simulated: rank j receives head group j of every rank's tokens) gives every
    rank the packed sequence in document order for its head group, exactly; the way back restores
    each rank's tokens in its load-balanced chunk order. Taking the blocks rank-major as they
    arrive (no reorder) is the failing control."""
    from moe_sft.layers.context_parallel import (
        local_token_index,
        plan_cp_attention,
        received_to_sequences,
        sequences_to_sent,
    )

    g = torch.Generator().manual_seed(3)
    for cp in (2, 3, 4):
        lengths = [-(-n // (2 * cp)) * 2 * cp for n in LENGTHS]
        bounds = _cu(lengths).tolist()
        full = torch.randn(bounds[-1], cp, 5, generator=g)  # [T, head group, channels]
        local = [full[local_token_index(bounds, cp, r)] for r in range(cp)]
        plans = [plan_cp_attention(bounds, cp, r) for r in range(cp)]
        for j in range(cp):
            received = torch.stack([local[r][:, j] for r in range(cp)])  # [cp, T_local, w]
            assert torch.equal(received_to_sequences(received, plans[j]), full[:, j])
            assert not torch.equal(received.reshape(-1, 5), full[:, j])
        sent = [sequences_to_sent(full[:, j], plans[j], cp) for j in range(cp)]  # from each rank j
        for r in range(cp):
            assert torch.equal(torch.stack([sent[j][r] for j in range(cp)], dim=1), local[r])


def test_context_parallel_needs_key_heads_divisible_by_tp_times_cp():
    from moe_sft.config import ConfigError, load_config
    from moe_sft.trainer.assemble import HFModel, check_against_model
    from tests.cpu.test_plan import REPO

    family = registry.family_by_name("qwen3_5_moe")
    cfg = family.tiny_hf_config()  # 2 key heads, 4 value heads
    hf = HFModel(family, cfg, family.shape(cfg))
    recipe = ["--config-path", str(REPO / "recipes"), "--config-name", "quickstart"]
    check_against_model(load_config(recipe), hf)  # CP1
    check_against_model(load_config([*recipe, "parallel.context_parallel_size=2"]), hf)  # 1 key head per CP rank
    with pytest.raises(ConfigError, match=r"context_parallel_size=4 does not divide linear_num_key_heads=2"):
        check_against_model(load_config([*recipe, "parallel.context_parallel_size=4"]), hf)


@pytest.fixture
def one_rank_world():
    """A one-rank fake process group (the layer reads the TP group at construction)."""
    import torch.distributed as dist
    from megatron.core import parallel_state
    from torch.testing._internal.distributed.fake_pg import FakeStore

    from tests.cpu.test_plan import _reset_world

    _reset_world()
    dist.init_process_group("fake", store=FakeStore(), rank=0, world_size=1)
    parallel_state.initialize_model_parallel(tensor_model_parallel_size=1, create_gloo_process_groups=False)
    yield
    _reset_world()


def test_each_head_group_alone_gives_its_heads_of_the_whole_mixer(one_rank_world):
    """What a CP rank computes after the all-to-all: head group j of cp (its q/k key heads, the
    value heads they serve, their conv channels, A_log and dt_bias) on whole documents equals
    those heads of the mixer over all heads; the wrong group's weights are the failing control."""
    from moe_sft.models.builder import ModelOptions, build_transformer_config

    family = registry.family_by_name("qwen3_5_moe")
    hf = family.tiny_hf_config(linear_num_key_heads=4, linear_num_value_heads=8)
    config = build_transformer_config(family, hf, ModelOptions(precision="fp32", backend="torch", device="cpu"))
    torch.manual_seed(0)
    layer = gdn.GatedDeltaNet(config, layer_number=1)
    with torch.no_grad():  # distinct per-head decays, so a wrong slice shows
        layer.A_log.copy_(torch.linspace(-1, 1, layer.A_log.numel()))
        layer.dt_bias.copy_(torch.linspace(0.5, 2, layer.dt_bias.numel()))
    g = torch.Generator().manual_seed(4)
    cu = gdn.Documents(_cu(LENGTHS), _cu(LENGTHS))
    tokens = torch.randn(int(cu.host[-1]), layer.in_proj_dim, generator=g)
    qk, v_dim, heads = layer.qk_dim, layer.v_dim, layer.local_value_heads
    q, k, v, _, b, a = torch.split(tokens, [qk, qk, v_dim, v_dim, heads, heads], dim=-1)
    with torch.no_grad():
        whole = layer._mix(q, k, v, b, a, cu, group=0, groups=1)  # [T, H, Dv]
        for cp in (2, 4):
            parts = [t.reshape(len(t), cp, -1) for t in (q, k, v, b, a)]
            mine = lambda j: [p[:, j] for p in parts]  # noqa: E731
            split = torch.cat([layer._mix(*mine(j), cu, group=j, groups=cp) for j in range(cp)], dim=1)
            torch.testing.assert_close(split, whole, rtol=1e-6, atol=1e-6)
            wrong = layer._mix(*mine(0), cu, group=1, groups=cp)
            assert not torch.allclose(wrong, whole[:, : heads // cp], atol=1e-3)


def test_the_trainer_hands_the_document_bounds_over_on_the_host():
    """A training micro-batch's params carry the CPU bounds it was packed with, and the GDN layers
    take those (no copy back from the device, which would wait for the GPU); every layer of the
    micro-batch shares one Documents."""
    from moe_sft.data.packing import PackedMicroBatch
    from moe_sft.trainer.step import _to_device

    lengths = [3, 5, 8]
    total = sum(lengths)
    cu = torch.tensor([0, 3, 8, 16], dtype=torch.int32)
    mb = PackedMicroBatch(
        tokens=torch.arange(total),
        labels=torch.arange(total),
        loss_mask=torch.ones(total),
        position_ids=torch.cat([torch.arange(n) for n in lengths]),
        cu_seqlens=cu,
        max_seqlen=8,
        num_loss_tokens=total,
    )
    params = _to_device(mb, "cpu")["params"]
    assert params.cu_seqlens_host is cu
    like = torch.empty(total, 4)
    documents = gdn._documents(params, 1, total, like)
    assert documents.host is cu and documents.chunks is None  # off fla's path: no chunk indices
    assert gdn._documents(params, 1, total, like) is documents
