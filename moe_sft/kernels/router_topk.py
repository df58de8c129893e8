"""The router's score function, top-k choice and routing map in one Triton pass each way (CUDA).

megatron-core 0.16.1 routes without TE through torch ops: for a Qwen3 softmax router the top-k,
the softmax of the chosen logits, two zero fills and two scatters (probs and routing map); for
the aux loss a second softmax, top-k, zero fill and scatter; and their backward passes. Each op
is a kernel the host must launch: the router phase costs the host far more time than the GPU,
and the benchmark's step was host-bound (docs/log.md). TE's `moe_router_fusion` does each of the
two functions in one kernel; these are the same two functions in Triton, with megatron's
signatures and results:

- `topk_routing_with_score_function`: softmax (top-k of the logits then softmax of the chosen,
  or softmax then top-k: `moe_router_pre_softmax`) or sigmoid (expert bias for the choice only,
  the chosen scores normalised to sum 1 when k > 1), group-limited top-k (DeepSeek-V3: groups
  ranked by the sum of their top k/group_topk scores), scaling factor. Out: dense probs [T, E]
  and the bool routing map. Where the router running it follows transformers' rule instead
  (routing.py: groups ranked by their top 2, renormalisation by norm_topk_prob), the kernel takes
  that rule as two compile-time switches and CPU runs routing.torch_topk_routing.
- `compute_routing_scores_for_aux_loss`: softmax or normalised sigmoid scores of every expert
  and their top-k map.

Each backward recomputes the scores from the saved logits and the map (nothing else is saved)
in one pass. Ties go to the lower expert index. The exponential is Triton's, so probabilities can
differ from torch's in the last bit (tests/gpu/test_gpu_router.py). CPU, non-fp32 logits, router
replay, shapes the kernel does not cover and `fused=True` (TE's kernels) run megatron's code.
"""

from __future__ import annotations

import torch
from megatron.core.transformer.moe import moe_utils

from moe_sft.kernels.routing import routing_rule, torch_topk_routing
from moe_sft.kernels.triton_launch import launch
from moe_sft.runtime import patches

try:
    import triton
    import triton.language as tl
except ImportError:  # CPU-only installs: torch's CPU wheel ships no Triton
    triton = None

_megatron_topk_routing = moe_utils.topk_routing_with_score_function
_megatron_aux_loss_scores = moe_utils.compute_routing_scores_for_aux_loss

MAX_EXPERTS = 1024  # a row of fp32 scores per program lives in registers
NEG_INF = float("-inf")

if triton is not None:

    @triton.jit
    def _softmax_rows(x):
        e = tl.exp(x - tl.max(x, axis=1)[:, None])
        return e / tl.sum(e, axis=1)[:, None]

    @triton.jit
    def _top_k(key, col, K: tl.constexpr):
        """A mask of the K largest keys of each row (-inf keys are never wanted)."""
        chosen = key < float("-inf")  # all False, the shape of key
        for _ in tl.static_range(K):
            best = tl.argmax(key, axis=1, tie_break_left=True)
            hit = col[None, :] == best[:, None]
            chosen = chosen | hit
            key = tl.where(hit, float("-inf"), key)
        return chosen

    @triton.jit
    def _limit_to_groups(
        key,
        ROWS: tl.constexpr,
        BLOCK_E: tl.constexpr,
        GROUPS: tl.constexpr,
        GROUP_K: tl.constexpr,
        PER_GROUP_K: tl.constexpr,
    ):
        """megatron's group_limited_topk: keep the GROUP_K groups whose PER_GROUP_K best keys sum
        highest; the other groups' keys become -inf."""
        PER: tl.constexpr = BLOCK_E // GROUPS
        grouped = tl.reshape(key, (ROWS, GROUPS, PER))
        member = tl.arange(0, PER)[None, None, :]
        group_score = tl.zeros((ROWS, GROUPS), dtype=tl.float32)
        for _ in tl.static_range(PER_GROUP_K):
            group_score += tl.max(grouped, axis=2)
            best = tl.argmax(grouped, axis=2, tie_break_left=True)
            grouped = tl.where(member == best[:, :, None], float("-inf"), grouped)
        kept = _top_k(group_score, tl.arange(0, GROUPS), GROUP_K)
        kept = tl.reshape(tl.broadcast_to(kept[:, :, None], (ROWS, GROUPS, PER)), (ROWS, BLOCK_E))
        return tl.where(kept, key, float("-inf"))

    @triton.jit
    def _rows_of_logits(logits_ptr, tokens, experts, ROWS: tl.constexpr, BLOCK_E: tl.constexpr):
        """This program's ROWS tokens: expert columns, the real-expert and in-bounds masks, row
        offsets, flat offsets into a [tokens, experts] tensor, and the logits (-inf outside)."""
        row = tl.program_id(0) * ROWS + tl.arange(0, ROWS)
        col = tl.arange(0, BLOCK_E)
        real = col[None, :] < experts
        inside = (row[:, None] < tokens) & real
        row64 = row.to(tl.int64)[:, None]
        offset = row64 * experts + col[None, :]
        return col, real, inside, row64, offset, tl.load(logits_ptr + offset, mask=inside, other=float("-inf"))

    @triton.jit(do_not_specialize=["tokens"])  # one compile for every micro-batch's token count
    def _routing_forward_kernel(
        logits_ptr,
        bias_ptr,
        probs_ptr,
        map_ptr,
        tokens,
        experts,
        scale,
        SIGMOID: tl.constexpr,
        PRE_SOFTMAX: tl.constexpr,
        HAS_BIAS: tl.constexpr,
        K: tl.constexpr,
        GROUPS: tl.constexpr,
        GROUP_K: tl.constexpr,
        GROUP_SCORE_K: tl.constexpr,
        NORMALIZE: tl.constexpr,
        ROWS: tl.constexpr,
        BLOCK_E: tl.constexpr,
    ):
        col, real, inside, _, offset, logits = _rows_of_logits(logits_ptr, tokens, experts, ROWS, BLOCK_E)
        if SIGMOID:
            scores = tl.sigmoid(logits)
            key = scores
            if HAS_BIAS:
                key = scores + tl.load(bias_ptr + col, mask=col < experts, other=0.0)[None, :]
        elif PRE_SOFTMAX:
            scores = _softmax_rows(logits)
            key = scores
        else:
            scores = logits
            key = logits
        key = tl.where(real, key, float("-inf"))
        if GROUPS > 1:
            key = _limit_to_groups(key, ROWS, BLOCK_E, GROUPS, GROUP_K, GROUP_SCORE_K)
        chosen = _top_k(key, col, K)
        if SIGMOID:
            probs = tl.where(chosen, scores, 0.0)
            if NORMALIZE:
                probs = probs / (tl.sum(probs, axis=1)[:, None] + 1e-20)
        elif PRE_SOFTMAX:
            probs = tl.where(chosen, scores, 0.0)
        else:  # softmax over the chosen logits (shifted by their own max: groups may drop the row's)
            probs = _softmax_rows(tl.where(chosen, logits, float("-inf")))
        tl.store(probs_ptr + offset, probs * scale, mask=inside)
        tl.store(map_ptr + offset, chosen.to(tl.int8), mask=inside)

    @triton.jit(do_not_specialize=["tokens"])
    def _routing_backward_kernel(
        logits_ptr,
        map_ptr,
        grad_ptr,
        grad_stride_t,
        grad_stride_e,
        out_ptr,
        tokens,
        experts,
        scale,
        SIGMOID: tl.constexpr,
        PRE_SOFTMAX: tl.constexpr,
        NORMALIZE: tl.constexpr,
        ROWS: tl.constexpr,
        BLOCK_E: tl.constexpr,
    ):
        """d logits from d probs: the chosen scores are recomputed from the logits and the map."""
        col, _, inside, row64, offset, logits = _rows_of_logits(logits_ptr, tokens, experts, ROWS, BLOCK_E)
        chosen = tl.load(map_ptr + offset, mask=inside, other=0) != 0
        grad = (
            tl.load(grad_ptr + row64 * grad_stride_t + col[None, :] * grad_stride_e, mask=inside, other=0.0).to(
                tl.float32
            )
            * scale
        )
        grad = tl.where(chosen, grad, 0.0)  # probs outside the choice are constant zeros
        if SIGMOID:
            scores = tl.sigmoid(logits)
            if NORMALIZE:
                total = tl.sum(tl.where(chosen, scores, 0.0), axis=1)[:, None] + 1e-20
                probs = tl.where(chosen, scores, 0.0) / total
                grad = tl.where(chosen, (grad - tl.sum(grad * probs, axis=1)[:, None]) / total, 0.0)
            d_logits = grad * scores * (1.0 - scores)
        elif PRE_SOFTMAX:
            scores = _softmax_rows(logits)
            d_logits = scores * (grad - tl.sum(grad * scores, axis=1)[:, None])
        else:
            probs = _softmax_rows(tl.where(chosen, logits, float("-inf")))
            d_logits = probs * (grad - tl.sum(grad * probs, axis=1)[:, None])
        tl.store(out_ptr + offset, d_logits, mask=inside)

    @triton.jit(do_not_specialize=["tokens"])
    def _aux_scores_forward_kernel(
        logits_ptr,
        scores_ptr,
        map_ptr,
        tokens,
        experts,
        SIGMOID: tl.constexpr,
        K: tl.constexpr,
        ROWS: tl.constexpr,
        BLOCK_E: tl.constexpr,
    ):
        col, real, inside, _, offset, logits = _rows_of_logits(logits_ptr, tokens, experts, ROWS, BLOCK_E)
        if SIGMOID:
            scores = tl.sigmoid(logits)
            scores = scores / (tl.sum(scores, axis=1)[:, None] + 1e-20)
        else:
            scores = _softmax_rows(logits)
        chosen = _top_k(tl.where(real, scores, float("-inf")), col, K)
        tl.store(scores_ptr + offset, scores, mask=inside)
        tl.store(map_ptr + offset, chosen.to(tl.int8), mask=inside)

    @triton.jit(do_not_specialize=["tokens"])
    def _aux_scores_backward_kernel(
        logits_ptr,
        grad_ptr,
        grad_stride_t,
        grad_stride_e,
        out_ptr,
        tokens,
        experts,
        SIGMOID: tl.constexpr,
        ROWS: tl.constexpr,
        BLOCK_E: tl.constexpr,
    ):
        col, _, inside, row64, offset, logits = _rows_of_logits(logits_ptr, tokens, experts, ROWS, BLOCK_E)
        grad = tl.load(grad_ptr + row64 * grad_stride_t + col[None, :] * grad_stride_e, mask=inside, other=0.0).to(
            tl.float32
        )
        if SIGMOID:
            sig = tl.sigmoid(logits)
            total = tl.sum(sig, axis=1)[:, None] + 1e-20
            d_sig = (grad - tl.sum(grad * sig / total, axis=1)[:, None]) / total
            d_logits = d_sig * sig * (1.0 - sig)
        else:
            scores = _softmax_rows(logits)
            d_logits = scores * (grad - tl.sum(grad * scores, axis=1)[:, None])
        tl.store(out_ptr + offset, d_logits, mask=inside)


def _launch(experts: int) -> tuple[int, int]:
    """(rows per program, padded expert count): ~2048 fp32 scores per program."""
    block_e = triton.next_power_of_2(experts)
    return max(1, 2048 // block_e), block_e


def _grid(tokens: int, rows: int) -> tuple[int]:
    return (triton.cdiv(tokens, rows),)


def _kernel_fits(logits: torch.Tensor, topk: int) -> bool:
    return (
        triton is not None
        and logits.is_cuda
        and logits.dtype == torch.float32
        and logits.dim() == 2
        and logits.shape[0] > 0
        and 0 < topk <= logits.shape[1] <= MAX_EXPERTS
    )


def _groups_fit(experts: int, topk: int, num_groups, group_topk, group_score_topk=None) -> bool:
    """The kernel's grouped choice needs power-of-two groups tiling a power-of-two expert count."""
    if not group_topk:
        return True
    per_group = group_score_topk or (topk // group_topk if topk % group_topk == 0 else 0)
    return (
        num_groups > 1
        and experts & (experts - 1) == 0
        and num_groups & (num_groups - 1) == 0
        and experts % num_groups == 0
        and group_topk <= num_groups
        and 0 < per_group <= experts // num_groups
    )


class _TopKRouting(torch.autograd.Function):
    @staticmethod
    def forward(
        ctx, logits, expert_bias, topk, pre_softmax, sigmoid, groups, group_topk, group_score_topk, normalize, scale
    ):
        logits = logits.contiguous()
        tokens, experts = logits.shape
        rows, block_e = _launch(experts)
        probs = torch.empty_like(logits)
        routing_map = torch.empty(tokens, experts, dtype=torch.bool, device=logits.device)
        has_bias = sigmoid and expert_bias is not None
        bias = expert_bias.float().contiguous() if has_bias else logits
        launch(
            _routing_forward_kernel,
            _grid(tokens, rows),
            logits,
            bias,
            probs,
            routing_map.view(torch.int8),
            tokens,
            experts,
            scale,
            SIGMOID=sigmoid,
            PRE_SOFTMAX=pre_softmax,
            HAS_BIAS=has_bias,
            K=topk,
            GROUPS=groups,
            GROUP_K=group_topk,
            GROUP_SCORE_K=group_score_topk,
            NORMALIZE=normalize,
            ROWS=rows,
            BLOCK_E=block_e,
        )
        ctx.save_for_backward(logits, routing_map)
        ctx.options = (pre_softmax, sigmoid, normalize, scale)
        ctx.mark_non_differentiable(routing_map)
        return probs, routing_map

    @staticmethod
    def backward(ctx, grad_probs, _grad_map):
        logits, routing_map = ctx.saved_tensors
        pre_softmax, sigmoid, normalize, scale = ctx.options
        tokens, experts = logits.shape
        rows, block_e = _launch(experts)
        grad_logits = torch.empty_like(logits)
        launch(
            _routing_backward_kernel,
            _grid(tokens, rows),
            logits,
            routing_map.view(torch.int8),
            grad_probs,
            grad_probs.stride(0),
            grad_probs.stride(1),
            grad_logits,
            tokens,
            experts,
            scale,
            SIGMOID=sigmoid,
            PRE_SOFTMAX=pre_softmax,
            NORMALIZE=normalize,
            ROWS=rows,
            BLOCK_E=block_e,
        )
        return grad_logits, None, None, None, None, None, None, None, None, None


class _AuxLossScores(torch.autograd.Function):
    @staticmethod
    def forward(ctx, logits, topk, sigmoid):
        logits = logits.contiguous()
        tokens, experts = logits.shape
        rows, block_e = _launch(experts)
        scores = torch.empty_like(logits)
        routing_map = torch.empty(tokens, experts, dtype=torch.bool, device=logits.device)
        launch(
            _aux_scores_forward_kernel,
            _grid(tokens, rows),
            logits,
            scores,
            routing_map.view(torch.int8),
            tokens,
            experts,
            SIGMOID=sigmoid,
            K=topk,
            ROWS=rows,
            BLOCK_E=block_e,
        )
        ctx.save_for_backward(logits)
        ctx.sigmoid = sigmoid
        ctx.mark_non_differentiable(routing_map)
        return routing_map, scores

    @staticmethod
    def backward(ctx, _grad_map, grad_scores):
        (logits,) = ctx.saved_tensors
        tokens, experts = logits.shape
        rows, block_e = _launch(experts)
        grad_logits = torch.empty_like(logits)
        launch(
            _aux_scores_backward_kernel,
            _grid(tokens, rows),
            logits,
            grad_scores,
            grad_scores.stride(0),
            grad_scores.stride(1),
            grad_logits,
            tokens,
            experts,
            SIGMOID=ctx.sigmoid,
            ROWS=rows,
            BLOCK_E=block_e,
        )
        return grad_logits, None, None


def topk_routing_with_score_function(
    logits,
    topk,
    use_pre_softmax=False,
    num_groups=None,
    group_topk=None,
    scaling_factor=None,
    score_function="softmax",
    expert_bias=None,
    fused=False,
    router_replay=None,
):
    """megatron's `moe_utils.topk_routing_with_score_function` (same arguments and results), routing
    as the HF model does where the router running it says so (moe_sft/kernels/routing.py)."""
    rule = routing_rule(topk, use_pre_softmax, num_groups, group_topk, score_function)
    if (
        fused
        or router_replay is not None
        or score_function not in ("softmax", "sigmoid")
        or not _kernel_fits(logits, topk)
        or not _groups_fit(logits.shape[1], topk, num_groups, group_topk, rule.group_score_topk)
    ):
        if rule.is_megatrons:
            return _megatron_topk_routing(
                logits,
                topk,
                use_pre_softmax=use_pre_softmax,
                num_groups=num_groups,
                group_topk=group_topk,
                scaling_factor=scaling_factor,
                score_function=score_function,
                expert_bias=expert_bias,
                fused=fused,
                router_replay=router_replay,
            )
        return torch_topk_routing(
            logits, topk, rule, num_groups, group_topk, scaling_factor, score_function, expert_bias
        )
    groups = num_groups if group_topk else 1
    sigmoid = score_function == "sigmoid"
    # Renormalised softmax weights are the softmax of the chosen logits: the kernel's post-top-k
    # path, which is also the only one whose top-1 weight is exactly 1 (as transformers').
    pre_softmax = bool(use_pre_softmax) if sigmoid else not rule.normalize
    return _TopKRouting.apply(
        logits,
        expert_bias,
        topk,
        pre_softmax,
        sigmoid,
        groups,
        group_topk or 1,
        rule.group_score_topk or 1,
        rule.normalize,
        float(scaling_factor) if scaling_factor else 1.0,
    )


def compute_routing_scores_for_aux_loss(logits, topk, score_function, fused=False, padding_mask=None):
    """megatron's `moe_utils.compute_routing_scores_for_aux_loss` (same arguments and results)."""
    if fused or score_function not in ("softmax", "sigmoid") or not _kernel_fits(logits, topk):
        return _megatron_aux_loss_scores(logits, topk, score_function, fused=fused, padding_mask=padding_mask)
    routing_map, scores = _AuxLossScores.apply(logits, topk, score_function == "sigmoid")
    if padding_mask is not None:  # as megatron: padding (True) rows leave the map and the scores
        valid = (~padding_mask).unsqueeze(-1)
        routing_map, scores = routing_map * valid, scores * valid
    return routing_map, scores


def use_fused_routing() -> None:
    """The router module imported both functions by name."""
    from megatron.core.transformer.moe import router

    for name in ("topk_routing_with_score_function", "compute_routing_scores_for_aux_loss"):
        patches.swap(router, name, globals()[name], group=patches.KERNELS, reason="fused routing")
