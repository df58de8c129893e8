"""The torchtitan arm (EXPERIMENTAL: written without a GPU; CUDA only): torchtitan 0.2.2's Qwen3 MoE.

Why 0.2.2, not the latest 0.3.0 (docs/benchmarks.md#torchtitan): 0.3.0 passes `enable_gqa=` to
`varlen_attn`, which torch 2.11 does not have (Qwen3's 32 q / 4 kv heads would fail); 0.2.2
(February 2026) calls it the torch 2.11 way (`window_size=(-1, 0)`, GQA as is).

What runs: torchtitan's own model code (`Qwen3Model`: varlen attention with `block_causal`
document masking through its `VarlenAttentionWrapper` (a torch.compile'd `varlen_attn`), its
`MoE` with token-choice top-k routing, the token reorderer and `torch._grouped_mm` experts),
built from the same HF config, on the same packed batches: the documents' `cu_seqlens` become
its `VarlenMetadata`, positions restart per document. The step is torchtitan's single-GPU recipe
written out (its Trainer needs its own data loader and config system): fp32 parameters, the
forward under `torch.autocast(bf16)` (torchtitan's `maybe_enable_amp` without FSDP), the same
loss as the other arms, `clip_grad_norm_(1.0)`, fused `torch.optim.AdamW`. Differences kept:
no router aux loss and no expert-bias update (`load_balance_coeff=None`; its bias update needs
its optimizer hooks), and its MoE init (not megatron's).

Expert parallelism (`--ep N` under torchrun, N = every rank): torchtitan's own multi-GPU recipe,
not a re-implementation. `ParallelDims(dp_shard=N, ep=N)` builds its meshes; `parallelize_qwen3`
applies its `ExpertParallel` (all-to-all dispatch with the host-side split sizes, its permutation
kernel) to the routed experts and FSDP2 to the rest (the dense layers sharded over the N ranks,
the experts over the 1-rank `efsdp` mesh), with its default mixed precision: bf16 parameters in
compute, fp32 gradient reduction, fp32 master weights. The model is built on the meta device and
initialised after sharding, the optimizer is its `build_optimizers` (fused AdamW per mesh) and
the clip its EP-aware `clip_grad_norm_`. Its activation checkpointing and torch.compile are off,
as in our arms. Each rank takes its share of the same global batch as our EP arm.
"""

from __future__ import annotations

import os

import torch
import torch.distributed as dist

from benchmarks import phases
from benchmarks.plain_step import optimizer_update, token_loss
from benchmarks.workload import SyntheticPlan, Workload


def titan_args(cfg, max_seq_len: int):
    """torchtitan Qwen3ModelArgs for an HF Qwen3-MoE config."""
    from torchtitan.models.moe import MoEArgs
    from torchtitan.models.qwen3.model.args import Qwen3ModelArgs

    from moe_sft.models.hf_config import rope_theta

    return Qwen3ModelArgs(
        vocab_size=cfg.vocab_size,
        dim=cfg.hidden_size,
        n_layers=cfg.num_hidden_layers,
        n_heads=cfg.num_attention_heads,
        n_kv_heads=cfg.num_key_value_heads,
        head_dim=cfg.head_dim,
        hidden_dim=cfg.intermediate_size,
        norm_eps=cfg.rms_norm_eps,
        rope_theta=rope_theta(cfg),
        qk_norm=True,
        max_seq_len=max_seq_len,
        attn_type="varlen",
        attn_mask_type="block_causal",
        enable_weight_tying=bool(cfg.tie_word_embeddings),
        moe_enabled=True,
        moe_inter_dim=cfg.moe_intermediate_size,
        moe_args=MoEArgs(
            num_experts=cfg.num_experts,
            num_shared_experts=0,
            top_k=cfg.num_experts_per_tok,
            score_func="softmax",
            route_norm=bool(cfg.norm_topk_prob),
            route_scale=1.0,
            score_before_experts=False,
            load_balance_coeff=None,
        ),
    )


class TitanArm:
    name = "torchtitan"
    heads_over_loss_rows = False  # logits of every position

    def __init__(
        self,
        hf_cfg,
        *,
        device: str,
        max_seq_len: int,
        ep: int = 1,
        lr: float = 1e-5,
        clip_grad: float = 1.0,
        seed: int = 0,
    ):
        if device != "cuda":
            raise RuntimeError("the torchtitan arm needs CUDA (varlen attention, its MoE's integer histc)")
        if getattr(hf_cfg, "model_type", "") != "qwen3_moe":
            raise RuntimeError(f"the torchtitan arm covers Qwen3-MoE only, not {hf_cfg.model_type}")
        import torchtitan

        self.version = getattr(torchtitan, "__version__", "?")
        self.device, self.ep, self.clip_grad = device, ep, clip_grad
        self.world = int(os.environ.get("WORLD_SIZE", "1"))
        if ep != self.world:
            raise RuntimeError(
                f"the torchtitan arm's expert parallelism spans every rank: run --ep {ep} under "
                f"torchrun --nproc_per_node={ep} (WORLD_SIZE is {self.world})"
            )
        self.rank = int(os.environ.get("RANK", "0"))
        torch.manual_seed(seed)
        if ep == 1:
            self._build_one_gpu(hf_cfg, max_seq_len, lr)
        else:
            self._build_expert_parallel(hf_cfg, max_seq_len, lr)
        self.model.train()
        self.plan: SyntheticPlan | None = None

    def _build_one_gpu(self, hf_cfg, max_seq_len: int, lr: float) -> None:
        from torchtitan.models.qwen3.model.model import Qwen3Model

        with torch.device(self.device):
            self.model = Qwen3Model(titan_args(hf_cfg, max_seq_len))
        with torch.no_grad():
            self.model.init_weights(buffer_device=torch.device(self.device))
        self.params = [p for p in self.model.parameters() if p.requires_grad]
        self.optimizer = torch.optim.AdamW(
            self.params, lr=lr, betas=(0.9, 0.95), eps=1e-8, weight_decay=0.0, fused=True
        )
        self.autocast = True
        self.loss_scale = 1.0

    def _build_expert_parallel(self, hf_cfg, max_seq_len: int, lr: float) -> None:
        from torchtitan.components.optimizer import build_optimizers
        from torchtitan.config import JobConfig
        from torchtitan.distributed import ParallelDims
        from torchtitan.models.qwen3.infra.parallelize import parallelize_qwen3
        from torchtitan.models.qwen3.model.model import Qwen3Model

        torch.cuda.set_device(int(os.environ.get("LOCAL_RANK", "0")))
        if not dist.is_initialized():
            dist.init_process_group("nccl")
        self.dims = ParallelDims(
            dp_replicate=1, dp_shard=-1, cp=1, tp=1, pp=1, ep=self.ep, etp=1, world_size=self.world
        )
        self.dims.build_mesh()
        job = JobConfig()
        job.training.seq_len = max_seq_len
        job.activation_checkpoint.mode = "none"
        job.compile.enable = False
        job.optimizer.lr, job.optimizer.weight_decay = lr, 0.0
        with torch.device("meta"):
            self.model = Qwen3Model(titan_args(hf_cfg, max_seq_len))
        parallelize_qwen3(self.model, self.dims, job)
        self.model.to_empty(device=self.device)
        with torch.no_grad():
            self.model.init_weights(buffer_device=torch.device(self.device))
        self.params = [p for p in self.model.parameters() if p.requires_grad]
        self.optimizer = build_optimizers([self.model], job.optimizer, self.dims)
        self.autocast = False  # FSDP2's mixed precision casts the parameters to bf16
        # FSDP2 divides the reduced gradients by the data-parallel size; the loss is already
        # normalised over the global batch's loss tokens (token_loss).
        self.loss_scale = float(self.dims.fsdp_gradient_divide_factor)

    def use(self, workload: Workload) -> None:
        self.plan = SyntheticPlan(workload)

    def prepare(self, step: int) -> None:
        self.plan.global_batch(step)

    def step(self, step: int) -> float:
        from torchtitan.models.attention import VarlenMetadata

        batches, loss_tokens = self.plan.batches_for_step(step, self.rank, self.world)
        total = torch.zeros((), device=self.device)
        self.optimizer.zero_grad()
        for mb in batches:
            cu = mb.cu_seqlens.to(self.device, torch.int32)
            masks = VarlenMetadata(cu_seq_q=cu, cu_seq_k=cu, max_q=mb.max_seqlen, max_k=mb.max_seqlen)
            with torch.autocast("cuda", dtype=torch.bfloat16, enabled=self.autocast):
                logits = self.model(
                    mb.tokens[None].to(self.device),
                    attention_masks=masks,
                    positions=mb.position_ids[None].to(self.device),
                )
            loss = token_loss(logits, mb, loss_tokens, self.device)
            total += loss.detach()
            (loss * self.loss_scale).backward()
        if self.world == 1:
            optimizer_update(self.params, self.optimizer, self.clip_grad)
        else:
            self._update_expert_parallel()
            dist.all_reduce(total)
        return float(total.item())

    def _update_expert_parallel(self) -> None:
        from torch.autograd.profiler import record_function
        from torchtitan.distributed.utils import clip_grad_norm_

        with record_function(phases.SCOPE + "optimizer"):
            clip_grad_norm_(self.params, self.clip_grad, foreach=True, ep_enabled=True)
            self.optimizer.step()

    def install_scopes(self) -> phases.Scopes:
        scopes = phases.Scopes()
        scopes.modules(self.model)
        return scopes

    def fed(self) -> tuple[int, str]:
        return self.plan.fed_tokens, self.plan.fed_digest

    def reset_fed(self) -> None:
        self.plan.reset_record()

    def reset_peak(self) -> None:
        torch.cuda.empty_cache()
        torch.cuda.reset_peak_memory_stats()

    def peak_memory_gib(self) -> tuple[float, float]:
        peak = torch.tensor(
            [torch.cuda.max_memory_allocated() / 2**30, torch.cuda.max_memory_reserved() / 2**30],
            device=self.device,
        )
        if self.world > 1:
            dist.all_reduce(peak, op=dist.ReduceOp.MAX)
        return float(peak[0]), float(peak[1])

    def describe(self) -> dict:
        if self.world == 1:
            how = "fp32 params + bf16 autocast, torch AdamW"
            precision = "fp32 + bf16 autocast"
        else:
            how = f"its ExpertParallel (EP {self.ep}) + FSDP2 (bf16 compute, fp32 reduce), its fused AdamW"
            precision = "FSDP2 mixed precision (bf16 params in compute, fp32 master and reduce)"
        return dict(
            implementation=f"torchtitan {self.version} Qwen3Model (varlen block_causal, grouped_mm MoE), "
            f"{how} (EXPERIMENTAL arm)",
            params_rank0=sum(_local(p).numel() for p in self.params),
            ep=self.ep,
            precision=precision,
            attention="torch varlen_attn (torch.compile'd by torchtitan)",
        )

    def close(self) -> None:
        del self.optimizer, self.model, self.params
        torch.cuda.empty_cache()


def _local(param: torch.Tensor) -> torch.Tensor:
    """A rank's own part of a parameter (FSDP2 and expert parallelism hold DTensors)."""
    return param.to_local() if hasattr(param, "to_local") else param
