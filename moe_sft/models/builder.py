"""HF config + family + runtime → megatron TransformerConfig → GPTModel chunks (one per VPP stage)."""

from __future__ import annotations

from dataclasses import dataclass, field, fields

import torch
from megatron.core import parallel_state
from megatron.core.transformer.moe import moe_utils
from megatron.core.transformer.transformer_config import TransformerConfig

from moe_sft.config.layout import (
    Layout,
    token_dispatcher,  # noqa: F401  (re-exported)
)
from moe_sft.config.schema import ModelConfig, ParallelConfig
from moe_sft.layers.config import config_class
from moe_sft.layers.spec import decoder_block_spec, mtp_block_spec
from moe_sft.models.family import Family
from moe_sft.models.mtp import SFTGPTModel
from moe_sft.models.shape import VOCAB_DIVISOR, padded_vocab_size  # noqa: F401  (re-exported)


@dataclass
class ModelOptions:
    """What the recipe (not the HF config) decides about the megatron model.

    `transformer` holds TransformerConfig fields by megatron's own names (the recipe schema uses
    those names, so `from_recipe` forwards them without a relay); the rest are the runtime's.
    """

    precision: str = "fp32"  # bf16 | fp32
    backend: str = "torch"  # te | torch
    device: str = "cpu"
    transformer: dict = field(default_factory=dict)

    @classmethod
    def from_recipe(
        cls, model: ModelConfig, parallel: ParallelConfig, precision: str, backend: str, device: str
    ) -> ModelOptions:
        """Every recipe field that names a TransformerConfig field (null = the family's or megatron's
        default), plus the values derived from other recipe fields."""
        names = {f.name for f in fields(TransformerConfig)}
        transformer = {
            f.name: getattr(section, f.name)
            for section in (model, parallel)
            for f in fields(section)
            if f.name in names and getattr(section, f.name) is not None
        }
        transformer["expert_tensor_parallel_size"] = parallel.expert_tp
        transformer["moe_router_dtype"] = model.moe_router_dtype  # null is a value: the model's dtype
        if model.freeze_expert_bias or model.freeze_router:  # the bias stays as loaded
            transformer["moe_router_bias_update_rate"] = 0.0
        if model.activation_offload_modules:
            transformer.update(
                fine_grained_activation_offloading=True, offload_modules=list(model.activation_offload_modules)
            )
        return cls(precision=precision, backend=backend, device=device, transformer=transformer)


def build_transformer_config(family: Family, hf_cfg, opts: ModelOptions) -> TransformerConfig:
    kwargs = family.transformer_config_kwargs(hf_cfg)
    recipe = dict(opts.transformer)
    tp = recipe.get("tensor_model_parallel_size", 1)
    dispatcher = Layout(  # only the degrees the dispatcher depends on; no world size needed
        world=0,
        tp=tp,
        pp=1,
        vpp=None,
        cp=1,
        ep=recipe.get("expert_model_parallel_size", 1),
        etp=recipe.get("expert_tensor_parallel_size", tp),
        requested_dispatcher=recipe.pop("moe_token_dispatcher_type", "auto"),
        device=opts.device,
        topk=kwargs.get("moe_router_topk") or 0,
    ).dispatcher
    balancing = recipe.pop("moe_router_load_balancing_type", None) or family.training_defaults.get(
        "moe_router_load_balancing_type", "aux_loss"
    )
    bf16 = opts.precision == "bf16"
    kwargs.update(
        expert_tensor_parallel_size=tp,  # "null = TP" for callers that build options by hand
        bf16=bf16,
        params_dtype=torch.bfloat16 if bf16 else torch.float32,
        pipeline_dtype=torch.bfloat16 if bf16 else torch.float32,
        hidden_dropout=0.0,
        attention_dropout=0.0,
        moe_token_dispatcher_type=dispatcher,
        moe_router_load_balancing_type=balancing,
        moe_router_dtype="fp32",
        moe_grouped_gemm=True,
        moe_permute_fusion=False,
        # Fusions that need apex/TE kernels are off on the torch-native path.
        bias_dropout_fusion=opts.backend == "te",
        apply_rope_fusion=False,
        masked_softmax_fusion=False,
        gradient_accumulation_fusion=False,
        persist_layer_norm=False,
        use_cpu_initialization=opts.device == "cpu",
        perform_initialization=True,
        calculate_per_token_loss=False,  # we normalise by the global token count ourselves (step.py)
        # Batched p2p in the interleaved (VPP) schedule posts send-prev, recv-prev, send-next,
        # recv-next; with PP=2 "prev" and "next" are the same peer, so messages pair up crossed
        # and the gradients come out wrong under gloo and NCCL (docs/log.md). Unbatched p2p
        # orders sends/receives by rank parity and is correct on both.
        batch_p2p_comm=False,
    )
    if recipe.get("recompute_granularity") == "full":  # defaults; the recipe's recompute_* win
        kwargs.update(recompute_method="uniform", recompute_num_layers=1)
    kwargs.update(recipe)
    return config_class(bool(kwargs.get("multi_latent_attention")), "yarn_rotary_scaling_factor" in kwargs)(**kwargs)


def _reset_megatron_moe_globals() -> None:
    """megatron keeps MoE state per process, not per model; a second model built in the same
    process (tests, tools) inherited the first one's:
    - the aux-loss logging tracker sizes its per-layer tensor by the first model that logs, so a
      deeper model indexed past its end in its first training step (IndexError);
    - the aux-loss gradient scale is created as a 0-d tensor by a backward outside the pipeline
      schedule, and the schedule's later `set_loss_scale` copies a [1] tensor into it (RuntimeError).
    """
    moe_utils.get_moe_layer_wise_logging_tracker().clear()
    moe_utils.MoEAuxLossAutoScaler.main_loss_backward_scale = None


def build_model_chunks(
    family: Family, hf_cfg, config: TransformerConfig, opts: ModelOptions, vocab_size: int | None = None
) -> list[SFTGPTModel]:
    """The GPTModel chunks this rank holds (one per virtual pipeline stage), on opts.device."""
    gpt_kwargs = family.gpt_model_kwargs(hf_cfg)  # rope, tied embeddings, max positions
    vocab = padded_vocab_size(vocab_size or hf_cfg.vocab_size)
    vpp = config.virtual_pipeline_model_parallel_size
    _reset_megatron_moe_globals()
    chunks = []
    for vp_stage in range(vpp or 1):
        vp = vp_stage if vpp else None
        model = SFTGPTModel(
            config=config,
            transformer_layer_spec=decoder_block_spec(config, opts.backend, vp_stage=vp),
            mtp_block_spec=mtp_block_spec(config, opts.backend, vp_stage=vp),
            vocab_size=vocab,
            pre_process=parallel_state.is_pipeline_first_stage(ignore_virtual=False, vp_stage=vp),
            post_process=parallel_state.is_pipeline_last_stage(ignore_virtual=False, vp_stage=vp),
            vp_stage=vp,
            **gpt_kwargs,
        )
        if opts.device == "cuda":
            model.cuda(torch.cuda.current_device())
        chunks.append(model)
    return chunks
