"""Attention sinks and sliding windows for the packed core attention (gpt-oss).

A sink is one extra logit s_h per head whose value vector is zero: for query i of head h,
    out_i = Σ_j exp(S_ij) v_j / (Σ_j exp(S_ij) + exp(s_h)),
with S the scaled, masked scores. megatron-core calls it `softmax_type="learnable"` (parameter
`softmax_offset`, [heads / TP]); "off-by-one" is the same with s_h = 0. gpt-oss alternates
layers with a causal sliding window; megatron's `window_size=(left, 0)` lets query i see keys j
with i - left <= j <= i, so HF's `sliding_window=W` (kv_idx > q_idx - W) is `left = W - 1`.

Two implementations, tested against each other and against transformers' eager gpt-oss math:

* `sink_attention_reference`: the explicit masked softmax with the sink column (CPU path);
* `SinkFlashVarlen`: the flash kernel (which knows windows but not sinks), with the sink folded
  in afterwards from the kernel's log-sum-exp, lse_i = log Σ_j exp(S_ij):
      out_i = flash_out_i · w_i,   w_i = e^lse_i / (e^lse_i + e^s_h) = sigmoid(lse_i - s_h).
  The backward needs no extra kernel (derivation at `SinkFlashVarlen.backward`).

Masks are bottom-right aligned (query i of a segment with sq queries and sk keys sits at key
position i + sk - sq), flash's convention, so the same code serves context parallel, where a
query chunk attends to its document's key prefix.
"""

from __future__ import annotations

import torch
from megatron.core.transformer.utils import is_layer_window_attention


def layer_window(config, layer_number: int) -> int | None:
    """This layer's left window (megatron's window_size[0]), or None for plain causal attention."""
    if not is_layer_window_attention(config.window_size, config.window_attn_skip_freq, layer_number):
        return None
    left, right = config.window_size
    if right != 0:
        # The module is causal-only: a right window > 0 would let queries see later tokens.
        raise ValueError(
            f"window_size={tuple(config.window_size)}: VarlenCoreAttention needs a causal window (left, 0)"
        )
    return None if left < 0 else int(left)  # -1: megatron's infinite window


def visible_keys(sq: int, sk: int, window: int | None, device=None) -> torch.Tensor:
    """[sq, sk] bool: causal (bottom-right aligned), and within `window` keys behind the query."""
    pos = torch.arange(sq, device=device)[:, None] + (sk - sq)
    cols = torch.arange(sk, device=device)[None, :]
    mask = cols <= pos
    if window is not None:
        mask &= pos - cols <= window
    return mask


def _segments(cu_seqlens_q, cu_seqlens_k):
    qb, kb = cu_seqlens_q.tolist(), cu_seqlens_k.tolist()
    return [(qs, qe, ks, ke) for qs, qe, ks, ke in zip(qb[:-1], qb[1:], kb[:-1], kb[1:]) if qe > qs]


def _scores(q, k, qs, qe, ks, ke, scale, window):
    """Masked scaled scores [hq, sq, sk] of one segment (GQA: query head h uses kv head h // groups)."""
    groups = q.shape[1] // k.shape[1]
    qd = q[qs:qe].transpose(0, 1)
    kd = k[ks:ke].transpose(0, 1).repeat_interleave(groups, dim=0)
    scores = torch.matmul(qd, kd.transpose(1, 2)) * scale
    mask = visible_keys(qe - qs, ke - ks, window, q.device)
    return scores.masked_fill(~mask, float("-inf")), mask


def sink_attention_reference(q, k, v, cu_seqlens_q, cu_seqlens_k, scale, sink=None, window=None):
    """Exact attention per (query segment, key segment) pair with the sink column and window;
    q [tq, hq, d], k/v [tk, hkv, d], sink [hq] or None. Differentiable in q, k, v and sink."""
    out = q.new_zeros(q.shape[0], q.shape[1], v.shape[-1])
    groups = q.shape[1] // k.shape[1]
    for qs, qe, ks, ke in _segments(cu_seqlens_q, cu_seqlens_k):
        logits, _ = _scores(q, k, qs, qe, ks, ke, scale, window)
        if sink is not None:
            column = sink.to(logits.dtype)[:, None, None].expand(-1, qe - qs, 1)
            logits = torch.cat([logits, column], dim=-1)
        probs = torch.softmax(logits, dim=-1)[..., : ke - ks]  # drop the sink: its value is zero
        vd = v[ks:ke].transpose(0, 1).repeat_interleave(groups, dim=0)
        out[qs:qe] = torch.matmul(probs, vd).transpose(0, 1)
    return out


# ---------------------------------------------------------------- flash kernels and their CPU stand-in
# forward(q, k, v, cu_q, cu_k, max_q, max_k, scale, window) -> (out, lse [hq, tq] fp32, aux tensors)
# backward(dout, q, k, v, out, lse, cu_q, cu_k, max_q, max_k, scale, window, aux) -> (dq, dk, dv)


def flash_forward(q, k, v, cu_q, cu_k, max_q, max_k, scale, window):
    """torch's flash varlen kernel, called as `varlen_attn` calls it: window (-1, 0) is plain
    causal; (left, 0) a causal sliding window, bottom-right aligned like the causal mask."""
    left = -1 if window is None else window
    out, lse, seed, offset, _ = torch.ops.aten._flash_attention_forward(
        q, k, v, cu_q, cu_k, max_q, max_k, 0.0, window is None, False, scale=scale,
        window_size_left=left, window_size_right=0,
    )  # fmt: skip
    if lse.shape != (q.shape[1], q.shape[0]):  # the varlen layout (torch/_meta_registrations.py)
        raise RuntimeError(f"flash varlen lse has shape {tuple(lse.shape)}, expected (heads, tokens)")
    return out, lse, (seed, offset)


def flash_backward(dout, q, k, v, out, lse, cu_q, cu_k, max_q, max_k, scale, window, aux):
    left = -1 if window is None else window
    seed, offset = aux
    return torch.ops.aten._flash_attention_backward(
        dout, q, k, v, out, lse, cu_q, cu_k, max_q, max_k, 0.0, window is None, seed, offset, scale=scale,
        window_size_left=left, window_size_right=0,
    )  # fmt: skip


FLASH_KERNELS = (flash_forward, flash_backward)


def standin_forward(q, k, v, cu_q, cu_k, max_q, max_k, scale, window):
    """CPU stand-in for `flash_forward`: the same outputs (out, lse [hq, tq]) in plain math."""
    out = q.new_zeros(q.shape[0], q.shape[1], v.shape[-1])
    lse = q.new_full((q.shape[1], q.shape[0]), float("-inf"))
    groups = q.shape[1] // k.shape[1]
    for qs, qe, ks, ke in _segments(cu_q, cu_k):
        scores, _ = _scores(q, k, qs, qe, ks, ke, scale, window)
        lse[:, qs:qe] = torch.logsumexp(scores, dim=-1)
        vd = v[ks:ke].transpose(0, 1).repeat_interleave(groups, dim=0)
        out[qs:qe] = torch.matmul(torch.softmax(scores, dim=-1), vd).transpose(0, 1)
    return out, lse, ()


def standin_backward(dout, q, k, v, out, lse, cu_q, cu_k, max_q, max_k, scale, window, aux):
    """CPU stand-in for `flash_backward`, using its inputs the way the kernel does: P from the
    scores and the saved lse, and D_i = rowsum(dO_i ∘ out_i) from the `out` it is given."""
    dq, dk, dv = torch.zeros_like(q), torch.zeros_like(k), torch.zeros_like(v)
    groups = q.shape[1] // k.shape[1]
    hkv = k.shape[1]
    for qs, qe, ks, ke in _segments(cu_q, cu_k):
        scores, mask = _scores(q, k, qs, qe, ks, ke, scale, window)
        p = torch.exp(scores - lse[:, qs:qe, None]) * mask  # [hq, sq, sk]
        do = dout[qs:qe].transpose(0, 1)  # [hq, sq, dv]
        vd = v[ks:ke].transpose(0, 1).repeat_interleave(groups, dim=0)
        kd = k[ks:ke].transpose(0, 1).repeat_interleave(groups, dim=0)
        d = (do * out[qs:qe].transpose(0, 1)).sum(-1, keepdim=True)  # D_i
        ds = p * (torch.matmul(do, vd.transpose(1, 2)) - d)
        dq[qs:qe] = (torch.matmul(ds, kd) * scale).transpose(0, 1)
        per_head_dk = torch.matmul(ds.transpose(1, 2), q[qs:qe].transpose(0, 1)) * scale
        per_head_dv = torch.matmul(p.transpose(1, 2), do)
        dk[ks:ke] += per_head_dk.reshape(hkv, groups, ke - ks, -1).sum(1).transpose(0, 1)
        dv[ks:ke] += per_head_dv.reshape(hkv, groups, ke - ks, -1).sum(1).transpose(0, 1)
    return dq, dk, dv


STANDIN_KERNELS = (standin_forward, standin_backward)


def _sink_weight(lse, sink):
    """w = sigmoid(lse - s_h) as [tq, hq, 1], in the lse's precision (fp32 from the kernel, fp64 in
    the tests) and at least fp32: the share of the softmax mass left to the keys."""
    dtype = torch.promote_types(lse.dtype, torch.float32)
    return torch.sigmoid(lse.to(dtype) - sink.to(dtype)[:, None]).t().unsqueeze(-1)


class SinkFlashVarlen(torch.autograd.Function):
    """Varlen attention with a sink and/or a causal window through a flash kernel pair
    (`FLASH_KERNELS` on CUDA, `STANDIN_KERNELS` in the CPU tests). sink None: window only."""

    @staticmethod
    def forward(ctx, q, k, v, sink, cu_q, cu_k, max_q, max_k, scale, window, kernels):
        out, lse, aux = kernels[0](q, k, v, cu_q, cu_k, max_q, max_k, scale, window)
        if sink is not None:
            w = _sink_weight(lse, sink)
            out = (out.to(w.dtype) * w).to(out.dtype)
        ctx.save_for_backward(q, k, v, out, lse, cu_q, cu_k, sink, *aux)
        ctx.args = (max_q, max_k, scale, window, kernels[1])
        return out

    @staticmethod
    def backward(ctx, grad_out):
        # With o = flash out, w_i = sigmoid(lse_i - s), final f_i = o_i w_i, upstream g_i = dL/df_i
        # and c_i = g_i · o_i:
        #   dL/do_i   = g_i w_i =: dO_i  (what the kernel is given)
        #   dL/dlse_i = c_i w_i (1 - w_i),   dL/ds = -Σ_i c_i w_i (1 - w_i)
        # The kernel's softmax backward is dS_ij = P_ij (dP_ij - D_i) with dP_ij = dO_i · v_j and
        # D_i = dO_i · out_i for the `out` it is passed; lse_i = log Σ_j exp S_ij adds
        # P_ij dL/dlse_i. Together: dS_ij = P_ij (dP_ij - w_i c_i + w_i c_i - w_i² c_i)
        #                               = P_ij (dP_ij - w_i² c_i),
        # and w_i² c_i = dO_i · (o_i w_i) = dO_i · f_i: passing f (the forward's output) as `out`
        # makes the kernel compute exactly this. dV = Pᵀ dO does not involve `out`.
        # In f's terms, c_i w_i (1 - w_i) = (g_i · f_i)(1 - w_i): no division by w.
        q, k, v, out, lse, cu_q, cu_k, sink, *aux = ctx.saved_tensors
        max_q, max_k, scale, window, backward = ctx.args
        dout = grad_out
        if sink is not None:
            w = _sink_weight(lse, sink)
            dout = (grad_out.to(w.dtype) * w).to(grad_out.dtype)
        dq, dk, dv = backward(dout.contiguous(), q, k, v, out, lse, cu_q, cu_k, max_q, max_k, scale, window, aux)
        dsink = None
        if sink is not None and ctx.needs_input_grad[3]:
            c_w = (grad_out.to(w.dtype) * out.to(w.dtype)).sum(-1)  # g_i · f_i, [tq, hq]
            dsink = -(c_w * (1 - w.squeeze(-1))).sum(0).to(sink.dtype)
        return dq, dk, dv, dsink, None, None, None, None, None, None, None
