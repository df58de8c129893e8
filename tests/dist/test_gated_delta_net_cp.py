"""The Gated DeltaNet layer at CP2 equals the same layer at CP1 (torchrun, 2 ranks, gloo, CPU, fp32).

Each rank builds the layer twice with the same weights: once as at cp=1 on the whole packed
micro-batch (the reference), once at cp=2 on its load-balanced chunks (chunks r and 3-r of every
document), whose convolution and delta rule run after the head all-to-all. The rank's output rows
and input gradients must equal the reference's rows, and every parameter's gradient summed over
the CP ranks (what the DP x CP gradient reduction does) the reference's. Documents of 4 to 132
tokens straddle the delta rule's 64-token chunk; 4 key / 8 value heads give each rank two key
heads and the four value heads they serve. This file is also the worker torchrun runs.
Measured: outputs and input gradients bit-equal; parameter gradients within 3.8e-6 absolute
(out_proj, whose largest entry is 6.9: fp32 summation order). Taking the all-to-all's output
with its transposed input's strides (a bug found here) gave 0.06 in the output.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

from tests.dist.launch import REPO, clean_env

LENGTHS = (4, 8, 64, 68, 132, 12)  # multiples of 2·cp, as the CP sharding pads them
TOL = 1e-5


def test_gated_delta_net_at_cp2_equals_cp1(tmp_path):
    proc = subprocess.run(
        [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node=2", __file__],
        cwd=REPO,
        # the worker imports tests.dist; each rank writes its own file, since two ranks printing to
        # one pipe can interleave their lines (CI once read two results run together)
        env={**clean_env(), "PYTHONPATH": str(REPO), "GDN_CP_RESULTS": str(tmp_path)},
        capture_output=True,
        text=True,
        timeout=600,
    )
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-6000:]
    diffs = [json.loads(path.read_text()) for path in sorted(tmp_path.glob("rank*.json"))]
    assert len(diffs) == 2, proc.stdout[-3000:]
    for rank in diffs:
        print(rank)
        assert rank["out"] == 0.0 and rank["input_grad"] == 0.0, rank  # the same kernels, the same rows
        for name, diff in rank["grads"].items():
            assert diff <= TOL, (name, rank)


def _worker() -> None:
    import torch
    import torch.distributed as dist

    from moe_sft.runtime import cpu_compat

    cpu_compat.apply_cpu_compat()
    from megatron.core.packed_seq_params import PackedSeqParams

    from moe_sft.layers import gated_delta_net as gdn
    from moe_sft.layers.context_parallel import CPPackedSeqParams, local_token_index, plan_cp_attention
    from moe_sft.models import registry
    from moe_sft.models.builder import ModelOptions, build_transformer_config
    from moe_sft.runtime import distributed

    cp = 2
    distributed.init_process_group("cpu")
    distributed.init_model_parallel(cp=cp)
    rank = dist.get_rank()
    family = registry.family_by_name("qwen3_5_moe")
    hf = family.tiny_hf_config(linear_num_key_heads=4, linear_num_value_heads=8)
    options = ModelOptions(precision="fp32", backend="torch", device="cpu")
    torch.manual_seed(0)
    reference = gdn.GatedDeltaNet(build_transformer_config(family, hf, options), layer_number=1)
    options.transformer["context_parallel_size"] = cp
    layer = gdn.GatedDeltaNet(build_transformer_config(family, hf, options), layer_number=1)
    assert layer.cp_size == cp
    with torch.no_grad():  # distinct per-head decays, so a head routed to the wrong rank shows
        reference.A_log.copy_(torch.linspace(-1, 1, reference.A_log.numel()))
        reference.dt_bias.copy_(torch.linspace(0.5, 2, reference.dt_bias.numel()))
    layer.load_state_dict(reference.state_dict())

    cu = torch.tensor([0, *LENGTHS]).cumsum(0).to(torch.int32)
    bounds, longest = cu.tolist(), max(LENGTHS)
    g = torch.Generator().manual_seed(5)
    x = torch.randn(bounds[-1], 1, reference.config.hidden_size, generator=g)
    weights = torch.randn(x.shape, generator=g)

    whole = x.clone().requires_grad_()
    params = PackedSeqParams(
        qkv_format="thd", cu_seqlens_q=cu, cu_seqlens_kv=cu, max_seqlen_q=longest, max_seqlen_kv=longest
    )
    out, _ = reference(whole, packed_seq_params=params)
    (out * weights).sum().backward()

    mine = local_token_index(bounds, cp, rank)
    local = x[mine].clone().requires_grad_()
    cp_params = CPPackedSeqParams(
        qkv_format="thd",
        cu_seqlens_q=cu,
        cu_seqlens_kv=cu,
        cu_seqlens_q_padded=cu,
        cu_seqlens_kv_padded=cu,
        max_seqlen_q=longest,
        max_seqlen_kv=longest,
        cp_plan=plan_cp_attention(bounds, cp, rank),
    )
    local_out, _ = layer(local, packed_seq_params=cp_params)
    (local_out * weights[mine]).sum().backward()

    grads = {}
    for (name, p), (_, ref) in zip(layer.named_parameters(), reference.named_parameters()):
        summed = p.grad.clone()
        dist.all_reduce(summed)
        grads[name] = (summed - ref.grad).abs().max().item()
    result = dict(
        rank=rank,
        out=(local_out - out[mine]).abs().max().item(),
        input_grad=(local.grad - whole.grad[mine]).abs().max().item(),
        grads=grads,
    )
    (Path(os.environ["GDN_CP_RESULTS"]) / f"rank{rank}.json").write_text(json.dumps(result))
    distributed.destroy()


if __name__ == "__main__":
    _worker()
