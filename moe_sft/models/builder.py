"""HF config + family + runtime → megatron TransformerConfig → GPTModel chunks (one per VPP stage)."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Optional

import torch
from megatron.core import parallel_state
from megatron.core.transformer.moe import moe_utils
from megatron.core.transformer.transformer_config import TransformerConfig

from moe_sft.layers.config import config_class
from moe_sft.layers.spec import decoder_block_spec, mtp_block_spec
from moe_sft.models.family import Family
from moe_sft.models.mtp import SFTGPTModel
from moe_sft.models.shape import VOCAB_DIVISOR, padded_vocab_size  # noqa: F401  (re-exported)


@dataclass
class ModelOptions:
    """What the recipe (not the HF config) decides about the megatron model."""

    precision: str = "fp32"            # bf16 | fp32
    backend: str = "torch"             # te | torch
    device: str = "cpu"
    tensor_model_parallel_size: int = 1
    pipeline_model_parallel_size: int = 1
    virtual_pipeline_model_parallel_size: Optional[int] = None
    expert_model_parallel_size: int = 1
    expert_tensor_parallel_size: Optional[int] = None
    context_parallel_size: int = 1
    sequence_parallel: bool = False
    moe_token_dispatcher_type: str = "auto"
    moe_router_load_balancing_type: Optional[str] = None
    moe_aux_loss_coeff: Optional[float] = None
    moe_router_dtype: Optional[str] = "fp32"
    moe_expert_capacity_factor: Optional[float] = None
    recompute_granularity: Optional[str] = None
    extra: dict = field(default_factory=dict)  # any further TransformerConfig field


def build_transformer_config(family: Family, hf_cfg, opts: ModelOptions) -> TransformerConfig:
    kwargs = family.transformer_config_kwargs(hf_cfg)
    dispatcher = opts.moe_token_dispatcher_type
    if dispatcher == "auto":  # alltoall needs CUDA streams; allgather runs anywhere
        dispatcher = "alltoall" if opts.device == "cuda" else "allgather"
    balancing = opts.moe_router_load_balancing_type or family.training_defaults.get(
        "moe_router_load_balancing_type", "aux_loss")
    bf16 = opts.precision == "bf16"
    kwargs.update(
        tensor_model_parallel_size=opts.tensor_model_parallel_size,
        pipeline_model_parallel_size=opts.pipeline_model_parallel_size,
        virtual_pipeline_model_parallel_size=opts.virtual_pipeline_model_parallel_size,
        expert_model_parallel_size=opts.expert_model_parallel_size,
        expert_tensor_parallel_size=opts.expert_tensor_parallel_size or opts.tensor_model_parallel_size,
        context_parallel_size=opts.context_parallel_size,
        sequence_parallel=opts.sequence_parallel,
        bf16=bf16,
        params_dtype=torch.bfloat16 if bf16 else torch.float32,
        pipeline_dtype=torch.bfloat16 if bf16 else torch.float32,
        hidden_dropout=0.0,
        attention_dropout=0.0,
        moe_token_dispatcher_type=dispatcher,
        moe_router_load_balancing_type=balancing,
        moe_router_dtype=opts.moe_router_dtype,
        moe_expert_capacity_factor=opts.moe_expert_capacity_factor,
        moe_grouped_gemm=True,
        moe_permute_fusion=False,
        recompute_granularity=opts.recompute_granularity,
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
        # recv-next; with PP=2 "prev" and "next" are the same peer, so messages pair up crossed.
        # Measured: grad norm 625 (gloo) and 2429 (NCCL, 2 H200) instead of 7.1-7.2. Unbatched
        # p2p orders sends/receives by rank parity and is correct on both.
        batch_p2p_comm=False,
    )
    if opts.moe_aux_loss_coeff is not None:
        kwargs["moe_aux_loss_coeff"] = opts.moe_aux_loss_coeff
    if opts.recompute_granularity == "full":  # defaults; the recipe's recompute_* (extra) win
        kwargs.update(recompute_method="uniform", recompute_num_layers=1)
    kwargs.update(opts.extra)
    return config_class(bool(kwargs.get("multi_latent_attention")))(**kwargs)


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


def build_model_chunks(family: Family, hf_cfg, config: TransformerConfig, opts: ModelOptions,
                       vocab_size: Optional[int] = None) -> list[SFTGPTModel]:
    """The GPTModel chunks this rank holds (one per virtual pipeline stage), on opts.device."""
    gpt_kwargs = family.gpt_model_kwargs(hf_cfg)  # rope, tied embeddings, max positions
    vocab = padded_vocab_size(vocab_size or hf_cfg.vocab_size)
    vpp = opts.virtual_pipeline_model_parallel_size or 1
    _reset_megatron_moe_globals()
    chunks = []
    for vp_stage in range(vpp):
        vp = vp_stage if opts.virtual_pipeline_model_parallel_size else None
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
