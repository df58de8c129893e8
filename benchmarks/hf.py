"""The transformers arm: `AutoModelForCausalLM` of the same HF config, a plain torch training step.

transformers 5.x runs MoE experts through `experts_implementation` (`grouped_mm`: tokens sorted
by expert, `torch.nn.functional.grouped_mm` over the stacked expert weights; the default when it
can dispatch, requested explicitly here). Packed sequences: each micro-batch is fed as one row
with `position_ids` restarting at every document and no attention mask; transformers' masking
utilities detect the packing from the position ids (`find_packed_sequence_indices`) and build a
block-diagonal causal mask, which `sdpa` applies as a dense [T, T] mask (all T^2 pairs computed)
and `flex_attention` as a block-sparse mask (compiled; one compilation per budget). Same loss as
ours (sum of token CE over the loss mask / the global batch's loss tokens, plus the router aux
loss with the config's coefficient), one backward per micro-batch, then
`clip_grad_norm_(1.0)` and `torch.optim.AdamW` (fused on CUDA). Parameters, gradients and Adam
state are bf16 on CUDA (the usual transformers + torch setup): no fp32 master weights, unlike
the megatron arm's distributed optimizer.

The transformers-peft arm (`lora=(rank, alpha)`) is the same model and step with peft's LoRA
(`get_peft_model`): on the attention's `q_proj` / `k_proj` / `v_proj` / `o_proj` and, through
`LoraConfig.target_parameters` (peft >= 0.17), on the fused expert tensors transformers 5 keeps,
`mlp.experts.gate_up_proj` / `mlp.experts.down_proj` (every routed expert); the base frozen, AdamW
over the adapters only; peft's defaults otherwise (its adapters on a bf16 base held in fp32:
`autocast_adapter_dtype`). That is the setup of issue 46's reference figures (peft 0.21.2).
"""

from __future__ import annotations

import copy

import torch

from benchmarks import phases
from benchmarks.plain_step import optimizer_update, token_loss
from benchmarks.workload import SyntheticPlan, Workload

# peft's targets: transformers' attention projections and fused expert tensors (issue 46)
PEFT_MODULES = ("q_proj", "k_proj", "v_proj", "o_proj")
PEFT_PARAMETERS = ("mlp.experts.gate_up_proj", "mlp.experts.down_proj")
# the same modules in megatron's names, for the LoRA FLOP count (moe_sft.trainer.flops): q/k/v/o
# are attention's linear_qkv / linear_proj (not a hybrid model's Gated DeltaNet projections)
PEFT_PLAN_TARGETS = (
    "decoder.layers.*.self_attention.linear_qkv",
    "decoder.layers.*.self_attention.linear_proj",
    "experts",
)


class HFArm:
    name = "transformers"
    heads_over_loss_rows = False  # logits of every position
    peft_plan = None  # moe_sft.plan.peft_memory.PeftPlan of a LoRA arm (its FLOP count)

    def __init__(
        self,
        hf_cfg,
        *,
        device: str,
        attn: str = "sdpa",
        experts: str = "grouped_mm",
        lr: float = 1e-5,
        clip_grad: float = 1.0,
        seed: int = 0,
        lora: tuple[int, float] | None = None,
    ):
        from transformers import AutoModelForCausalLM

        from moe_sft.runtime import cpu_compat

        self.device, self.world, self.rank = device, 1, 0
        self.compat = cpu_compat.suspended  # megatron's CPU patches (if active here) must not touch HF
        cfg = copy.deepcopy(hf_cfg)
        cfg.use_cache = False
        self.dtype = torch.bfloat16 if device == "cuda" else torch.float32
        self.aux_coef = float(getattr(cfg, "router_aux_loss_coef", 0.0) or 0.0)
        torch.manual_seed(seed)
        with self.compat(), torch.device(device):
            self.model = AutoModelForCausalLM.from_config(
                cfg, dtype=self.dtype, attn_implementation=attn, experts_implementation=experts
            )
        self.attn = self.model.config._attn_implementation
        self.experts = getattr(self.model.config, "_experts_implementation", None)
        if lora is not None:
            self._add_peft(*lora)
        self.model.train()
        self.params = [p for p in self.model.parameters() if p.requires_grad]
        self.clip_grad = clip_grad
        self.optimizer = torch.optim.AdamW(
            self.params, lr=lr, betas=(0.9, 0.95), eps=1e-8, weight_decay=0.0, fused=device == "cuda"
        )
        self.plan: SyntheticPlan | None = None

    def _add_peft(self, rank: int, alpha: float) -> None:
        import peft

        from moe_sft.plan.peft_memory import PeftPlan

        config = peft.LoraConfig(
            r=rank,
            lora_alpha=alpha,
            lora_dropout=0.0,
            target_modules=list(PEFT_MODULES),
            target_parameters=list(PEFT_PARAMETERS),
        )
        with self.compat():
            self.model = peft.get_peft_model(self.model, config)
        self.name = "transformers-peft"
        self.peft_plan = PeftPlan(rank=rank, target_modules=PEFT_PLAN_TARGETS)
        self.lora = (rank, alpha)

    def use(self, workload: Workload) -> None:
        self.plan = SyntheticPlan(workload)

    def prepare(self, step: int) -> None:
        self.plan.global_batch(step)

    def step(self, step: int) -> float:
        batches, loss_tokens = self.plan.batches_for_step(step, 0, 1)
        aux = self.aux_coef > 0 and hasattr(self.model.config, "output_router_logits")
        total = torch.zeros((), device=self.device, dtype=torch.float32)
        with self.compat():
            self.optimizer.zero_grad(set_to_none=True)
            for mb in batches:
                out = self.model(
                    input_ids=mb.tokens[None].to(self.device),
                    position_ids=mb.position_ids[None].to(self.device),
                    use_cache=False,
                    **({"output_router_logits": True} if aux else {}),
                )
                loss = token_loss(out.logits, mb, loss_tokens, self.device)
                total += loss.detach()
                if aux and getattr(out, "aux_loss", None) is not None:
                    loss = loss + self.aux_coef * out.aux_loss / len(batches)
                loss.backward()
            optimizer_update(self.params, self.optimizer, self.clip_grad)
        return float(total.item())

    def install_scopes(self) -> phases.Scopes:
        from transformers.modeling_utils import ALL_ATTENTION_FUNCTIONS

        scopes = phases.Scopes()
        scopes.modules(self.model)
        if self.attn in ALL_ATTENTION_FUNCTIONS:  # the kernel call itself (eager has no entry)
            original = ALL_ATTENTION_FUNCTIONS[self.attn]

            def scoped(*args, **kwargs):
                with torch.autograd.profiler.record_function(phases.SCOPE + "attention_core"):
                    return original(*args, **kwargs)

            ALL_ATTENTION_FUNCTIONS[self.attn] = scoped  # a local override of the shared interface
            scopes._undo.append(lambda: ALL_ATTENTION_FUNCTIONS._local_mapping.pop(self.attn, None))
        return scopes

    def fed(self) -> tuple[int, str]:
        return self.plan.fed_tokens, self.plan.fed_digest

    def reset_fed(self) -> None:
        self.plan.reset_record()

    def reset_peak(self) -> None:
        if self.device == "cuda":
            torch.cuda.empty_cache()
            torch.cuda.reset_peak_memory_stats()

    def peak_memory_gib(self) -> tuple[float, float]:
        if self.device != "cuda":
            return 0.0, 0.0
        return torch.cuda.max_memory_allocated() / 2**30, torch.cuda.max_memory_reserved() / 2**30

    def describe(self) -> dict:
        import transformers

        lora = ""
        if self.peft_plan is not None:
            import peft

            lora = (
                f", peft {peft.__version__} LoRA r{self.lora[0]} alpha {self.lora[1]:g} on {'/'.join(PEFT_MODULES)} "
                f"and (target_parameters) {', '.join(PEFT_PARAMETERS)}, base frozen"
            )
        return dict(
            implementation=f"transformers {transformers.__version__} {type(self.model).__name__}, "
            f"attn_implementation={self.attn}, experts_implementation={self.experts}{lora}, torch AdamW",
            params_rank0=sum(p.numel() for p in self.model.parameters()),
            trained_params_rank0=sum(p.numel() for p in self.params),
            peft="lora" if self.peft_plan is not None else "none",
            ep=1,
            precision="bf16" if self.dtype == torch.bfloat16 else "fp32",
            attention=self.attn,
        )

    def close(self) -> None:
        del self.optimizer, self.model, self.params
        if self.device == "cuda":
            torch.cuda.empty_cache()
