"""Time the optimizer update alone, each followed by megatron's cast of the fp32 main parameters into
the bf16 model parameters: the foreach clip multiply + torch's fused AdamW + `copy_`, the clip + Adam
Triton kernel (moe_sft/kernels/adam.py) + `copy_`, and the kernel writing the bf16 parameters
itself; on fp32 tensors shaped like the benchmark shard's (one big expert tensor per layer and many
small ones), with each side's bytes moved and the bandwidth that gives.

Usage: python3 benchmarks/gpu/adam_speed.py [--params 5.6e9 --iters 10]
"""

import argparse
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))

from benchmarks.ceilings import seconds_per_call  # noqa: E402  (after the path insert)


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--params", type=float, default=2.0e9, help="fp32 elements in all (4 arrays of each)")
    p.add_argument("--iters", type=int, default=10)
    args = p.parse_args()

    from moe_sft.kernels import adam as adam_kernel

    total = int(args.params)
    big = total // 10  # ten large tensors (stacked experts) ...
    sizes = [big] * 10 + [2048] * 40 + [2048 * 4096] * 10  # ... plus norms and attention projections
    params = [torch.nn.Parameter(torch.randn(n, device="cuda")) for n in sizes]
    for q in params:
        q.grad = torch.randn_like(q)
    group = dict(lr=1e-5, betas=(0.9, 0.95), eps=1e-8, weight_decay=0.1)
    reference = torch.optim.AdamW(params, fused=True, **group)
    grads = [q.grad for q in params]
    coeff = 0.5

    models = [torch.empty_like(q, dtype=torch.bfloat16) for q in params]

    def copy_to_models():  # DistributedOptimizer._copy_main_params_to_model_params: one copy_ per tensor
        for q, model in zip(params, models):
            model.copy_(q.data)

    def torch_path():
        torch._foreach_mul_(grads, coeff)
        reference.step()
        copy_to_models()

    states = [(torch.zeros_like(q), torch.zeros_like(q)) for q in params]
    step = torch.ones((), device="cuda")

    def kernel_path(write_models):
        hyper = adam_kernel.hyper_parameters(group, coeff, "cuda")
        for q, (m, v), model in zip(params, states, models):
            adam_kernel.adam_step(
                q.data,
                q.grad,
                m,
                v,
                step,
                hyper,
                decoupled=True,
                weight_decay=True,
                grad_coeff=True,
                model_param=model if write_models else None,
            )
        if not write_models:
            copy_to_models()

    elements = sum(sizes)
    # bytes per parameter: fp32 reads and writes, + the bf16 copy's 4-byte read and 2-byte write
    for name, fn, bytes_per in (
        ("foreach clip multiply + torch fused AdamW + copy_", torch_path, 4 * (2 + 4 + 3) + 6),
        ("clip + Adam Triton kernel + copy_", lambda: kernel_path(False), 4 * (4 + 3) + 6),
        ("clip + Adam Triton kernel writing the bf16 parameters", lambda: kernel_path(True), 4 * (4 + 3) + 2),
    ):
        ms = seconds_per_call(fn, "cuda", 1, args.iters) * 1e3
        print(
            f"[adam] {name}: {ms:.2f} ms for {elements / 1e9:.2f}G parameters; {bytes_per} B/param moved, "
            f"{elements * bytes_per / ms / 1e9:.2f} TB/s"
        )
    return 0


if __name__ == "__main__":
    sys.exit(main())
