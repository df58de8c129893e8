"""Context parallel without process groups: the CP ranks are simulated in one process.

For cp in {2, 3, 4}, the packed batch is split with the load-balanced layout (rank r keeps chunks
r and 2cp-1-r of every document), each simulated rank's attention runs on the K/V of all ranks
concatenated in rank order (what the all-gather returns), and the outputs put back in place must
equal plain causal attention over each document, values and gradients, with GQA and an MLA-like
smaller v head dim. Negative controls: the contiguous split with the same plan, and a top-left
aligned causal mask, both fail. Then megatron's THD rope under CP, and the batch sharding.
"""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from moe_sft.layers.attention import sdpa_varlen_reference
from moe_sft.layers.context_parallel import (
    attention_on_gathered_kv,
    local_token_index,
    plan_cp_attention,
    sdpa_bottom_right,
)
from moe_sft.trainer import cp_sharding as cpt

DOCS = [13, 1, 29, 7, 22]  # odd lengths, one single-token document
SCALE = 0.3


def _pad_docs(lengths, cp):
    """Global cu_seqlens with every document padded to 2cp, and where the real tokens sit."""
    padded = [-(-n // (2 * cp)) * 2 * cp for n in lengths]
    cu = [0]
    for p in padded:
        cu.append(cu[-1] + p)
    real = torch.cat([torch.arange(s, s + n) for s, n in zip(cu[:-1], lengths)])
    return cu, real


def _qkv(total, hq=4, hkv=2, dk=8, dv=8, seed=0):
    g = torch.Generator().manual_seed(seed)
    mk = lambda h, d: torch.randn(total, h, d, generator=g, dtype=torch.float64).requires_grad_()
    return mk(hq, dk), mk(hkv, dk), mk(hkv, dv)


def _cp_forward(q, k, v, cu, cp, kernel=sdpa_bottom_right, split=local_token_index):
    """Every simulated rank's output, scattered back to global token order."""
    index = [split(cu, cp, r) for r in range(cp)]
    k_all = torch.cat([k[i] for i in index])  # rank-major, as all_gather_into_tensor
    v_all = torch.cat([v[i] for i in index])
    out = q.new_zeros(q.shape[0], q.shape[1], v.shape[-1])
    for r in range(cp):
        plan = plan_cp_attention(cu, cp, r)
        local = attention_on_gathered_kv(q[index[r]], k_all, v_all, plan, SCALE, kernel)
        out = out.index_put((index[r],), local)
    return out


def _grads(out, weight, tensors):
    return torch.autograd.grad((out * weight).sum(), tensors)


@pytest.mark.parametrize("cp", [2, 3, 4])
@pytest.mark.parametrize("dv", [8, 5])  # 5: MLA-like v head dim smaller than q/k's
def test_cp_attention_equals_full_attention(cp, dv):
    cu, real = _pad_docs(DOCS, cp)
    q, k, v = _qkv(cu[-1], dv=dv)
    ours = _cp_forward(q, k, v, cu, cp)
    full = sdpa_varlen_reference(q, k, v, torch.tensor(cu), SCALE)
    # and the real tokens alone, unpadded: the pads appended to a document change nothing
    unpadded_cu = torch.tensor([0] + DOCS).cumsum(0)
    alone = sdpa_varlen_reference(q[real], k[real], v[real], unpadded_cu, SCALE)
    torch.testing.assert_close(ours, full, rtol=1e-6, atol=1e-10)
    torch.testing.assert_close(ours[real], alone, rtol=1e-6, atol=1e-10)

    weight = torch.randn(ours.shape, dtype=ours.dtype, generator=torch.Generator().manual_seed(1))
    mask = torch.zeros(cu[-1], 1, 1, dtype=ours.dtype)
    mask[real] = 1  # the loss sees real tokens only
    for ours_g, ref_g in zip(_grads(ours, weight * mask, (q, k, v)), _grads(full, weight * mask, (q, k, v))):
        torch.testing.assert_close(ours_g, ref_g, rtol=1e-6, atol=1e-10)


def _top_left_causal(q, k, v, cu_q, cu_k, max_q, max_k, scale):
    out = q.new_empty(q.shape[0], q.shape[1], v.shape[-1])
    groups = q.shape[1] // k.shape[1]
    qb, kb = cu_q.tolist(), cu_k.tolist()
    for qs, qe, ks, ke in zip(qb[:-1], qb[1:], kb[:-1], kb[1:]):
        kd = k[ks:ke].transpose(0, 1).repeat_interleave(groups, 0)
        vd = v[ks:ke].transpose(0, 1).repeat_interleave(groups, 0)
        out[qs:qe] = F.scaled_dot_product_attention(
            q[qs:qe].transpose(0, 1), kd, vd, is_causal=True, scale=scale
        ).transpose(0, 1)
    return out


def _contiguous_split(cu, cp, rank):
    """Rank r keeps chunks 2r and 2r+1 (the unbalanced split) — wrong pairing for the plan."""
    parts = []
    for s, e in zip(cu[:-1], cu[1:]):
        c = (e - s) // (2 * cp)
        parts.append(torch.arange(s + 2 * rank * c, s + (2 * rank + 2) * c))
    return torch.cat(parts)


@pytest.mark.parametrize("wrong", ["top_left_causal", "contiguous_chunks"])
def test_negative_controls_fail(wrong):
    cp = 2
    cu, real = _pad_docs(DOCS, cp)
    q, k, v = _qkv(cu[-1])
    kwargs = {"kernel": _top_left_causal} if wrong == "top_left_causal" else {"split": _contiguous_split}
    ours = _cp_forward(q, k, v, cu, cp, **kwargs)
    full = sdpa_varlen_reference(q, k, v, torch.tensor(cu), SCALE)
    assert (ours[real] - full[real]).abs().max() > 1e-2


def test_causal_work_is_balanced():
    cu, _ = _pad_docs([64, 128], 4)
    work = []
    for r in range(4):
        plan = plan_cp_attention(cu, 4, r)
        q, kk = plan.cu_seqlens_q.diff(), plan.cu_seqlens_k.diff()
        work.append(int((q * kk).sum()))
    assert len(set(work)) == 1, work


class _FakeGroup:
    def __init__(self, size, rank):
        self._size, self._rank = size, rank

    def size(self):
        return self._size

    def rank(self):
        return self._rank


@pytest.mark.parametrize("docs", [[13, 1, 29, 7], [37]])  # [37]: megatron's one-segment (offset) path
def test_megatron_thd_rope_uses_original_positions_under_cp(docs):
    """The function megatron's SelfAttention / MLA call for THD rope, fed global cu_seqlens."""
    from megatron.core.models.common.embeddings.rope_utils import _apply_rotary_pos_emb_thd

    cp = 2
    cu, _ = _pad_docs(docs, cp)
    max_len = max(b - a for a, b in zip(cu[:-1], cu[1:]))
    inv_freq = 1.0 / (10000 ** (torch.arange(0, 16, 2, dtype=torch.float32) / 16))
    angles = torch.outer(torch.arange(max_len, dtype=torch.float32), inv_freq)
    freqs = torch.cat([angles, angles], dim=-1)[:, None, None, :]  # RotaryEmbedding.get_emb's layout
    t = torch.randn(cu[-1], 3, 16, dtype=torch.float32)
    cu_t = torch.tensor(cu, dtype=torch.int32)
    full = _apply_rotary_pos_emb_thd(t, cu_t, freqs, cp_group=_FakeGroup(1, 0))
    for r in range(cp):
        keep = local_token_index(cu, cp, r)
        ours = _apply_rotary_pos_emb_thd(t[keep], cu_t, freqs, cp_group=_FakeGroup(cp, r))
        torch.testing.assert_close(ours, full[keep], rtol=0, atol=1e-6)
        wrong = _contiguous_split(cu, cp, r)  # control: another split gets other positions
        assert (
            _apply_rotary_pos_emb_thd(t[wrong], cu_t, freqs, cp_group=_FakeGroup(cp, r)) - full[wrong]
        ).abs().max() > 1e-2


class _Doc:
    def __init__(self, ids, mask):
        self.input_ids, self.assistant_mask = ids, mask


@pytest.mark.parametrize("cp,tp,pad_to", [(2, 1, 1), (2, 2, 1), (3, 1, 128), (4, 2, 1)])
def test_sharding_keeps_every_token_label_and_position(cp, tp, pad_to):
    from moe_sft.data.packing import build_micro_batch

    g = torch.Generator().manual_seed(3)
    docs = [_Doc(torch.randint(1, 50, (n,), generator=g).tolist(), [i % 3 > 0 for i in range(n)]) for n in DOCS]
    mb = build_micro_batch(docs, pad_to=pad_to)
    total = cpt.padded_length(mb, cp, 2 * cp * tp)
    assert total % (2 * cp * tp) == 0 and total >= sum(DOCS)
    shards = [cpt.shard_micro_batch(mb, cp, r, total) for r in range(cp)]
    cu = shards[0].cu_seqlens.tolist()
    assert all(torch.equal(s.cu_seqlens, shards[0].cu_seqlens) for s in shards)
    assert all((b - a) % (2 * cp) == 0 for a, b in zip(cu[:-1], cu[1:]))
    assert all(len(s.tokens) == total // cp for s in shards)
    # put the shards back in global order: the real tokens are the micro-batch's, in order
    glob = {
        name: torch.zeros(total, dtype=getattr(shards[0], name).dtype)
        for name in ("tokens", "labels", "loss_mask", "position_ids", "padding")
    }
    for r, s in enumerate(shards):
        keep = local_token_index(cu, cp, r)
        for name in glob:
            glob[name][keep] = getattr(s, name)
    real = ~glob["padding"]
    n_real = sum(DOCS)
    assert int(real.sum()) == n_real
    for name in ("tokens", "labels", "loss_mask", "position_ids"):
        assert torch.equal(glob[name][real], getattr(mb, name)[:n_real]), name
    assert float(glob["loss_mask"].sum()) == mb.num_loss_tokens
    assert not glob["loss_mask"][~real].any() and not glob["labels"][~real].any()
    # every document starts a segment at position 0 (rope restarts there)
    starts = [int(glob["position_ids"][a]) for a in cu[:-1]]
    assert starts == [0] * len(starts)
