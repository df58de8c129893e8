"""Host time per call (forward + backward) of moe-sft's fused ops against the torch ops they replace.

The timed training step is host-bound (docs/benchmarks.md): the GPU waits for Python to launch
kernels, so an op's cost in the step is its host time as much as its kernel time. Each op runs on
a 64-token input, too small for the GPU to lag behind, `--iters` times without a synchronisation;
the host's wall time per call is what the step pays for it. Usage: python3 benchmarks/gpu/host_overhead.py
"""

import json
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))


def host_us(fn, iters: int = 300) -> float:
    for _ in range(20):
        fn()
    torch.cuda.synchronize()
    start = time.perf_counter()
    for _ in range(iters):
        fn()
    host = time.perf_counter() - start
    torch.cuda.synchronize()
    return host / iters * 1e6


def cases():
    from moe_sft.config import KernelsConfig
    from moe_sft.kernels import gather_sum, install, router_topk
    from moe_sft.layers import norm
    from moe_sft.runtime import megatron_fixes

    megatron_fixes.apply_megatron_fixes()
    install.install(KernelsConfig())
    dev = "cuda"
    tokens, hidden, experts, k = 64, 2048, 128, 8
    x = torch.randn(tokens, hidden, device=dev, dtype=torch.bfloat16, requires_grad=True)
    w = torch.ones(hidden, device=dev, dtype=torch.bfloat16, requires_grad=True)
    logits = torch.randn(tokens, experts, device=dev, requires_grad=True)
    rows = torch.randn(tokens * k, hidden, device=dev, dtype=torch.bfloat16)
    slots = torch.randperm(tokens * k, device=dev).view(tokens, k)

    def norm_step(use_triton):
        def run():
            norm.rms_norm(x, w, 1e-6, use_triton=use_triton).sum().backward()

        return run

    def routing(fn):
        def run():
            probs, _ = fn(logits, k, score_function="softmax")
            probs.sum().backward()

        return run

    def aux_scores(fn):
        def run():
            _, scores = fn(logits, k, "softmax")
            scores.sum().backward()

        return run

    def flash(direct):
        from moe_sft.layers import attention

        q = torch.randn(tokens, 32, 128, device=dev, dtype=torch.bfloat16, requires_grad=True)
        kv = torch.randn(tokens, 4, 128, device=dev, dtype=torch.bfloat16, requires_grad=True)
        cu = torch.tensor([0, 20, tokens], device=dev, dtype=torch.int32)
        fn = attention._varlen_cuda if direct else attention.torch_varlen_attn

        def run():
            fn(q, kv, kv, cu, cu, 44, 44, 0.088).sum().backward()

        return run

    def empty_sum():
        x.detach().sum()

    yield "one torch op (sum of a [64, 2048] tensor), forward only", empty_sum, None
    yield "autograd baseline: (x * 2).sum().backward()", lambda: (x * 2).sum().backward(), None

    class Identity(torch.autograd.Function):  # megatron's collectives over a group of one rank
        @staticmethod
        def forward(ctx, t):
            return t

        @staticmethod
        def backward(ctx, g):
            return g

    yield (
        "the baseline with 4 identity autograd Functions | without",
        lambda: Identity.apply(Identity.apply(Identity.apply(Identity.apply(x * 2)))).sum().backward(),
        lambda: (x * 2).sum().backward(),
    )
    yield from triton_launch_paths()
    yield "rms_norm fwd+bwd: Triton | torch ops", norm_step(True), norm_step(False)
    yield (
        "top-k routing fwd+bwd: Triton | megatron's torch ops",
        routing(router_topk.topk_routing_with_score_function),
        routing(router_topk._megatron_topk_routing),
    )
    yield (
        "aux-loss scores fwd+bwd: Triton | megatron's torch ops",
        aux_scores(router_topk.compute_routing_scores_for_aux_loss),
        aux_scores(router_topk._megatron_aux_loss_scores),
    )
    yield ("direct flash varlen | torch's varlen_attn, fwd+bwd", flash(True), flash(False))
    from moe_sft.kernels import permute, topk_rows

    choice = torch.randn(tokens, experts, device=dev).topk(k, dim=1).indices
    routing_map = torch.zeros(tokens, experts, dtype=torch.bool, device=dev).scatter(1, choice, True)
    probs = torch.rand(tokens, experts, device=dev, requires_grad=True)

    def rows_torch():
        rows, places, flat = permute._rows_and_slots_known(routing_map, tokens * k, k, exact=True)
        width = k
        permute._slot_rows(places, tokens, width)
        probs.T.reshape(-1).index_select(0, flat)

    yield (
        "top-k permutation indices fwd: Triton | torch ops",
        lambda: topk_rows.topk_rows(routing_map, probs, k),
        rows_torch,
    )
    yield (
        "gather_sum fwd: Triton | torch ops",
        lambda: gather_sum.gather_sum(rows, slots),
        lambda: gather_sum._gather_sum_torch(rows, slots),
    )


def triton_launch_paths():
    """One trivial Triton kernel launched through Triton's JIT entry point, through the compiled
    kernel's runner, and through its launcher with everything precomputed: what a launch costs
    and how much of it a cached launch would save."""
    import triton
    import triton.language as tl

    @triton.jit
    def _copy(src, dst, n, BLOCK: tl.constexpr):
        i = tl.program_id(0) * BLOCK + tl.arange(0, BLOCK)
        tl.store(dst + i, tl.load(src + i, mask=i < n), mask=i < n)

    src = torch.randn(4096, device="cuda")
    dst = torch.empty_like(src)
    compiled = _copy[(4,)](src, dst, 4096, BLOCK=1024)
    compiled._init_handles()
    stream = torch.cuda.current_stream().cuda_stream

    def direct():
        compiled.run(
            4, 1, 1, stream, compiled.function, compiled.packed_metadata, None, None, None, src, dst, 4096, 1024
        )

    yield "Triton launch: JIT entry | direct launcher", lambda: _copy[(4,)](src, dst, 4096, BLOCK=1024), direct
    from moe_sft.kernels.triton_launch import launch

    yield (
        "Triton launch: compiled runner | moe_sft's launch()",
        lambda: compiled[(4, 1, 1)](src, dst, 4096, 1024),
        lambda: launch(_copy, (4,), src, dst, 4096, BLOCK=1024),
    )


def main() -> int:
    out = {}
    for name, ours, theirs in cases():
        a = host_us(ours)
        b = host_us(theirs) if theirs is not None else None
        out[name] = [a, b]
        print(f"[host] {name}: {a:.1f} us" + (f" | {b:.1f} us" if b is not None else ""), flush=True)
    if len(sys.argv) > 1:
        Path(sys.argv[1]).write_text(json.dumps(out, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
