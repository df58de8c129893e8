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
"""

from __future__ import annotations

import torch

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
        self, hf_cfg, *, device: str, max_seq_len: int, lr: float = 1e-5, clip_grad: float = 1.0, seed: int = 0
    ):
        if device != "cuda":
            raise RuntimeError("the torchtitan arm needs CUDA (varlen attention, its MoE's integer histc)")
        if getattr(hf_cfg, "model_type", "") != "qwen3_moe":
            raise RuntimeError(f"the torchtitan arm covers Qwen3-MoE only, not {hf_cfg.model_type}")
        import torchtitan
        from torchtitan.models.qwen3.model.model import Qwen3Model

        self.version = getattr(torchtitan, "__version__", "?")
        self.device, self.world, self.rank = device, 1, 0
        torch.manual_seed(seed)
        with torch.device(device):
            self.model = Qwen3Model(titan_args(hf_cfg, max_seq_len))
        with torch.no_grad():
            self.model.init_weights(buffer_device=torch.device(device))
        self.model.train()
        self.params = [p for p in self.model.parameters() if p.requires_grad]
        self.clip_grad = clip_grad
        self.optimizer = torch.optim.AdamW(
            self.params, lr=lr, betas=(0.9, 0.95), eps=1e-8, weight_decay=0.0, fused=True
        )
        self.plan: SyntheticPlan | None = None

    def use(self, workload: Workload) -> None:
        self.plan = SyntheticPlan(workload)

    def prepare(self, step: int) -> None:
        self.plan.global_batch(step)

    def step(self, step: int) -> float:
        from torchtitan.models.attention import VarlenMetadata

        batches, loss_tokens = self.plan.batches_for_step(step, 0, 1)
        total = torch.zeros((), device=self.device)
        self.optimizer.zero_grad(set_to_none=True)
        for mb in batches:
            cu = mb.cu_seqlens.to(self.device, torch.int32)
            masks = VarlenMetadata(cu_seq_q=cu, cu_seq_k=cu, max_q=mb.max_seqlen, max_k=mb.max_seqlen)
            with torch.autocast("cuda", dtype=torch.bfloat16):
                logits = self.model(
                    mb.tokens[None].to(self.device),
                    attention_masks=masks,
                    positions=mb.position_ids[None].to(self.device),
                )
            loss = token_loss(logits, mb, loss_tokens, self.device)
            total += loss.detach()
            loss.backward()
        optimizer_update(self.params, self.optimizer, self.clip_grad)
        return float(total.item())

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
        return torch.cuda.max_memory_allocated() / 2**30, torch.cuda.max_memory_reserved() / 2**30

    def describe(self) -> dict:
        return dict(
            implementation=f"torchtitan {self.version} Qwen3Model (varlen block_causal, grouped_mm MoE), "
            "fp32 params + bf16 autocast, torch AdamW (EXPERIMENTAL arm)",
            params_rank0=sum(p.numel() for p in self.params),
            ep=1,
            precision="fp32 + bf16 autocast",
            attention="torch varlen_attn (torch.compile'd by torchtitan)",
        )

    def close(self) -> None:
        del self.optimizer, self.model, self.params
        torch.cuda.empty_cache()
