"""Typed configuration schema: one dataclass per recipe section.

The dataclasses are the single source of truth (DESIGN.md principle 5). Hydra/OmegaConf
are used only in `load.py`, at the edge, to compose YAML recipes onto these classes.

Field names follow megatron-core's own (`TransformerConfig`, `ModelParallelConfig`,
`OptimizerConfig`, `OptimizerParamScheduler`) wherever one exists, so the trainer can
forward them without renaming. Every field carries a one-line doc in
`metadata["help"]`; fields restricted to a fixed set carry `metadata["choices"]`,
which `validate.py` checks generically. Fields without a default are required.
"""

import dataclasses
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any


def _f(default: Any, doc: str, choices: Sequence[Any] | None = None) -> Any:
    """A schema field with a default, its one-line doc and (optionally) its allowed values."""
    meta: dict[str, Any] = {"help": doc}
    if choices is not None:
        meta["choices"] = tuple(choices)
    if isinstance(default, (list, dict)):
        return dataclasses.field(default_factory=lambda: type(default)(default), metadata=meta)
    return dataclasses.field(default=default, metadata=meta)


def _required(doc: str) -> Any:
    """A required schema field (no default; missing in YAML is reported by the loader)."""
    return dataclasses.field(metadata={"help": doc})


class ConfigError(ValueError):
    """A configuration problem; the message names the field(s), the value(s) and the fix.

    Defined here (plain Python, no Hydra import) so that `validate.py` and `load.py` share it.
    The entry point prints the message and exits with status 2.
    """


def format_errors(errors: Sequence[str]) -> str:
    """One ConfigError message for several problems, one per line."""
    head = "invalid configuration" if len(errors) == 1 else f"invalid configuration ({len(errors)} problems)"
    return head + ":\n" + "\n".join(f"  - {e}" for e in errors)


# Megatron-core 0.16.1 accepts these (TransformerConfig.moe_router_load_balancing_type).
LOAD_BALANCING_TYPES = (None, "aux_loss", "seq_aux_loss", "global_aux_loss", "sinkhorn", "none")


@dataclass(kw_only=True)
class ModelConfig:
    """Which checkpoint to train and the model-side knobs that are not in the HF config."""

    hf_path: str | None = _f(None, "HF checkpoint dir (the source; used for export and tiny-model creation)")
    mcore_path: str | None = _f(None, "converted megatron dist-checkpoint dir; the trainer loads this")
    hf_config: str | None = _f(
        None,
        "the model's HF config: a name under recipes/models/ (e.g. qwen3_235b_a22b) or a config.json "
        "path; the planner uses it when no checkpoint is at hand, and the checkpoint must match it",
    )
    create_tiny_if_missing: bool = _f(
        False, "quickstart only: make a tiny random HF model at hf_path and convert it to mcore_path when absent"
    )
    backend: str = _f(
        "auto",
        "layer spec: auto = torch (the torch-native spec, the tested one) | torch | te (Transformer "
        "Engine spec, explicit opt-in, needs CUDA; not validated by moe-sft's tests)",
        ("auto", "te", "torch"),
    )
    moe_router_load_balancing_type: str | None = _f(
        None,
        "router balancing loss: aux_loss | seq_aux_loss | none | ...; null = family default",
        LOAD_BALANCING_TYPES,
    )
    moe_aux_loss_coeff: float | None = _f(None, "aux loss coefficient; null = from the HF config")
    moe_router_enable_expert_bias: bool | None = _f(
        None, "aux-loss-free expert bias (DeepSeek-V3 style); null = family default"
    )
    moe_router_bias_update_rate: float | None = _f(
        None, "expert-bias update rate when the expert bias is enabled; null = family default"
    )
    moe_token_dispatcher_type: str = _f(
        "auto",
        "token dispatcher: auto (CPU: allgather; CUDA: allgather when 1 < EP x expert-TP <= top-k, else alltoall) | alltoall | allgather",
        ("auto", "alltoall", "allgather"),
    )
    moe_router_dtype: str | None = _f(
        "fp32", "router logits/softmax dtype: fp32 | fp64 | null (model dtype)", (None, "fp32", "fp64")
    )
    moe_expert_capacity_factor: float | None = _f(None, "expert capacity factor; null = dropless")
    moe_static_rows_capacity: float = _f(
        2.0,
        "allgather dispatcher, short micro-batches or CUDA graphs: a rank's permutation has a static "
        "row count, at most this multiple (>= 1) of its expected routed rows; a step whose routing "
        "sends more runs again without it (nothing is dropped; logged, train/row_capacity_reruns); "
        "lower is faster per step but re-runs more often (docs/log.md)",
    )
    moe_combine_dtype: str = _f(
        "bf16",
        "allgather dispatcher: dtype of the combine's reduce-scatter over the expert group; bf16 (the "
        "expert outputs' own dtype: half megatron's bytes, as a TP layer's reduce-scatter, sums "
        "rounded per hop; faster, and the quickstart learns the same: docs/log.md) "
        "| fp32 (megatron's: the outputs cast to fp32 first)",
        ("fp32", "bf16"),
    )
    attention_kernel: str = _f(
        "auto",
        "CUDA attention kernel: auto (flash-attn-4 for the calls it supports on SM90 / SM100 when it "
        "imports, else flash-attn, else torch's flash varlen kernel) | torch (torch's kernel only) | "
        "fa4 (flash-attn-4 required); CPU runs the per-document SDPA reference (moe_sft/layers/attention.py)",
        ("auto", "torch", "fa4"),
    )
    moe_dispatch_chunks: int = _f(
        1,
        "allgather dispatcher at EP x expert TP > 1: cut each micro-batch's MoE layer into this many "
        "token chunks, whose gather and reduce-scatter run while another chunk's experts compute "
        "(1: off; slower over NVLink on one host, docs/log.md; moe_sft/layers/split_dispatch.py)",
    )
    recompute_granularity: str | None = _f(
        None, "activation recomputation: null (off) | full | selective", (None, "full", "selective")
    )
    recompute_method: str | None = _f(
        None, "with full recompute: uniform | block (required then)", (None, "uniform", "block")
    )
    recompute_num_layers: int | None = _f(
        None, "with full recompute: layers per recompute unit (uniform) or recomputed per stage (block)"
    )
    recompute_modules: list[str] | None = _f(
        None,
        "with selective recompute: core_attn | mlp | moe | moe_act | layernorm | mla_up_proj | "
        "shared_experts; null = megatron's default [core_attn]",
    )
    activation_offload_modules: list[str] = _f(
        [],
        "inputs of these modules go to CPU memory until backward (megatron fine-grained activation "
        "offload; CUDA): attn_norm | qkv_linear | core_attn | attn_proj | mlp_norm | expert_fc1 | moe_act",
    )
    mtp_loss_weight: float = _f(
        0.1, "multi-token-prediction loss weight (DeepSeek-V3: 0.3 early, 0.1 late); 0 = MTP layers not run"
    )
    freeze_patterns: list[str] = _f(
        [],
        "megatron parameter names to freeze (fnmatch, e.g. 'embedding.*', '*.mlp.router.weight'); "
        "each must match something",
    )
    freeze_router: bool = _f(False, "freeze every MoE router's weights (and its expert bias)")
    freeze_expert_bias: bool = _f(False, "keep the aux-loss-free expert bias (DeepSeek-V3) as loaded")
    freeze_mtp: bool = _f(False, "keep MTP layers frozen: loaded, not run, not updated, exported unchanged")
    attention_dropout: float = _f(0.0, "dropout on attention probabilities")
    hidden_dropout: float = _f(0.0, "dropout on the residual-branch outputs")


@dataclass(kw_only=True)
class DataConfig:
    """Where the conversations come from and how they are tokenized and packed."""

    train_files: list[str] = _required(
        "training data: .jsonl / .json / .parquet files or HF save_to_disk dirs (relative to the cwd)"
    )
    train_weights: list[float] = _f(
        [], "mixture weight per train file = passes per epoch (2 = twice, 0.5 = a random half); [] = 1 each"
    )
    eval_files: list[str] = _f([], "evaluation data files (same kinds as train_files); empty = none")
    eval_fraction: float = _f(0.0, "fraction of each train file held out for evaluation (e.g. 0.01); 0 = none")
    tokenizer_path: str | None = _f(None, "tokenizer dir; null = the tokenizer saved with the converted checkpoint")
    chat_template: str | None = _f(None, "chat template file (.jinja) used instead of the tokenizer's; null = it")
    format: str = _f(
        "auto",
        "row format: auto (per row, from its keys) | messages | sharegpt | alpaca | prompt_completion",
        ("auto", "messages", "sharegpt", "alpaca", "prompt_completion"),
    )
    fields: dict[str, str] = _f({}, "renamed row fields, canonical name: yours (e.g. {messages: chat, role: speaker})")
    loss_on: str = _f(
        "all_assistant",
        "trained turns: all_assistant | last_assistant; a message's numeric 'weight' overrides",
        ("all_assistant", "last_assistant"),
    )
    end_of_turn: str | None = _f(
        None,
        "string closing every assistant turn; null = eos token or a known end token (<|im_end|>, <|eot_id|>, "
        "Gemma's <end_of_turn> / <turn|> / <|tool_response>, ...), else the next role tag (GLM: "
        "<|user|>/<|observation|>, trained) or the end of the text",
    )
    close_last_turn: bool = _f(
        True,
        "templates that close no turn with an end token (GLM): append the role tag the model emits to hand "
        "over (<|user|>) after a trained last assistant turn, trained as its stop token, which the template "
        "does not write there; false = no stop token for that turn, ids exactly apply_chat_template's",
    )
    empty_think: str = _f(
        "train",
        "the empty <think></think> (<think>\\n\\n</think>) templates write into turns without reasoning: "
        "train (the template's text as rendered; ms-swift's and NeMo Automodel's default) | mask (not trained, "
        "so answers without reasoning do not teach a hybrid-reasoning model to skip thinking)",
        ("train", "mask"),
    )
    max_seq_len: int = _f(2048, "max tokens per conversation (after the chat template)")
    pack_length: int = _f(4096, "tokens per packed micro-batch (sequences are packed THD with cu_seqlens)")
    pad_documents_to: int | None = _f(
        None,
        "pad each document to a multiple of this; null = what the layout needs (2*CP, times TP with SP). "
        "Set it (a multiple of every layout's need) to resume across CP/TP layouts with the same batches",
    )
    pack_window: int = _f(8192, "samples packed together best-fit decreasing; larger = fuller micro-batches")
    overlong: str = _f(
        "truncate", "what to do with conversations longer than max_seq_len: truncate | drop", ("truncate", "drop")
    )
    on_error: str = _f(
        "fail",
        "bad rows (invalid JSON or UTF-8, wrong shape, unknown role, empty answer, ...): "
        "fail = stop at the first, naming file:line | skip = count and report each",
        ("fail", "skip"),
    )
    shuffle: bool = _f(True, "shuffle conversations each epoch")
    seed: int = _f(1234, "data shuffling seed")
    cache_dir: str | None = _f(
        None, "pre-tokenized cache dir (shared FS for multi-node); null = $MOE_SFT_DATA_CACHE or ~/.cache/moe_sft/data"
    )
    num_workers: int = _f(2, "processes that tokenize while the cache is built; 0 = in the training process")
    prefetch: bool = _f(True, "build the next step's micro-batches in a background thread")


@dataclass(kw_only=True)
class ParallelConfig:
    """Parallel layout; names and semantics are megatron-core's ModelParallelConfig ones."""

    tensor_model_parallel_size: int = _f(1, "tensor parallel size (TP)")
    pipeline_model_parallel_size: int = _f(1, "pipeline parallel size (PP)")
    virtual_pipeline_model_parallel_size: int | None = _f(
        None, "virtual pipeline stages per PP rank (interleaved schedule); null = off"
    )
    num_layers_in_first_pipeline_stage: int | None = _f(
        None, "uneven PP: transformer layers on the first stage; null = even split"
    )
    num_layers_in_last_pipeline_stage: int | None = _f(
        None, "uneven PP: transformer layers on the last stage; null = even split"
    )
    expert_model_parallel_size: int = _f(1, "expert parallel size (EP)")
    expert_tensor_parallel_size: int | None = _f(None, "tensor parallel size inside experts (ETP); null = TP")
    context_parallel_size: int = _f(1, "context parallel size (CP)")
    sequence_parallel: bool = _f(False, "sequence parallelism; must be true when TP>1 with MoE")
    use_distributed_optimizer: bool = _f(True, "shard optimizer state across data-parallel ranks")
    overlap_grad_reduce: bool = _f(False, "reduce(-scatter) gradient buckets during backward")
    overlap_param_gather: bool = _f(
        False,
        "all-gather updated parameters during the next forward (needs the distributed optimizer "
        "and overlap_grad_reduce)",
    )

    @property
    def expert_tp(self) -> int:
        """The expert tensor-parallel size in effect: expert_tensor_parallel_size, null meaning TP."""
        if self.expert_tensor_parallel_size is None:
            return self.tensor_model_parallel_size
        return self.expert_tensor_parallel_size


@dataclass(kw_only=True)
class OptimizerConfig:
    """AdamW and its LR schedule; names follow megatron-core OptimizerConfig / OptimizerParamScheduler."""

    lr: float = _f(1e-5, "peak learning rate (reached after warmup)")
    min_lr: float = _f(0.0, "learning rate at the end of decay")
    weight_decay: float = _f(0.0, "decoupled (AdamW) weight decay")
    no_weight_decay_patterns: list[str] = _f(
        [],
        "parameters without weight decay besides megatron's default (biases and 1-D parameters such as "
        "norms): fnmatch patterns on names with global layer numbers, e.g. ['*word_embeddings*', '*.router.*']",
    )
    adam_beta1: float = _f(0.9, "Adam beta1")
    adam_beta2: float = _f(0.95, "Adam beta2")
    adam_eps: float = _f(1e-8, "Adam epsilon")
    clip_grad: float = _f(1.0, "global gradient-norm clip; 0 = off")
    lr_warmup_steps: int = _f(0, "linear warmup steps from 0 to lr")
    lr_decay_style: str = _f(
        "cosine", "decay after warmup until max_steps: cosine | linear | constant", ("cosine", "linear", "constant")
    )
    optimizer_cpu_offload: bool = _f(
        False, "keep optimizer state and step on the CPU (needs the distributed optimizer)"
    )
    optimizer_offload_fraction: float = _f(
        1.0,
        "with optimizer_cpu_offload: fraction of the parameters whose optimizer state and step "
        "live on the CPU (the rest stays on the GPU)",
    )


@dataclass(kw_only=True)
class TrainerConfig:
    """The run: where outputs go, how long, on what device and precision."""

    output_dir: str = _required("run directory: checkpoints/, logs, resolved config, exported HF model")
    max_steps: int = _required("number of optimizer steps (> 0)")
    global_batch_size: int = _f(8, "packed micro-batches per optimizer step across all data-parallel ranks")
    global_batch_tokens: int | None = _f(
        None,
        "the global batch in tokens instead: global_batch_size = ceil(tokens / data.pack_length), rounded "
        "up to what the layout needs (a multiple of DP, times PP with VPP); null = use global_batch_size",
    )
    seed: int = _f(42, "model/dropout RNG seed")
    device: str = _f("auto", "auto (cuda when available) | cuda | cpu", ("auto", "cuda", "cpu"))
    precision: str = _f("auto", "auto (bf16 on cuda, fp32 on cpu) | bf16 | fp32", ("auto", "bf16", "fp32"))
    log_interval: int = _f(1, "log metrics every N steps")
    peak_tflops: float = _f(
        0.0,
        "peak TFLOP/s per GPU for MFU; 0 = from the GPU name with bf16 (H100/H200 SXM: 989 dense), "
        "none on CPU or fp32 (then MFU is not reported)",
    )
    export_hf_at_end: bool = _f(
        True, "export an HF checkpoint (safetensors + config + tokenizer) at the end of training"
    )
    gc_interval: int = _f(
        0,
        "N > 0: on CUDA, Python's automatic garbage collection is off during training and a full "
        "collection runs every N steps, the same step on every rank (Megatron-LM's --manual-gc); 0 = "
        "Python's automatic collection",
    )
    cuda_graphs: bool = _f(
        False,
        "capture the MoE half of every MoE layer (pre-MLP norm, router, dispatch, experts, combine) as "
        "CUDA graphs, forward and backward: the host stops bounding short micro-batches (docs/benchmarks.md). "
        "Needs CUDA, TP = ETP = CP = PP = 1, at EP > 1 the allgather dispatcher, no recompute or "
        "activation offload, no overlap_grad_reduce / overlap_param_gather; micro-batches are padded "
        "to data.pack_length",
    )
    max_skipped_steps_in_a_row: int = _f(
        3, "steps with a non-finite loss or grad norm are skipped (no update); the run stops after this many in a row"
    )
    offload_between_steps: bool = _f(
        False,
        "move parameters, gradients and optimizer state to CPU memory after every step and back "
        "before the next: the GPU is free between steps for a co-located job (CUDA; costs the copies)",
    )
    cuda_graphs_replay: bool = _f(
        True,
        "with trainer.cuda_graphs: replay the captured graphs; false = capture them but run every "
        "forward eager (measures what the capture itself costs)",
    )
    eval_interval: int = _f(0, "evaluate every N steps; 0 = never (needs data.eval_files)")
    dry_run: bool = _f(
        False, "validate, print the memory plan and every rank's role, then exit: no GPU, no process group"
    )


@dataclass(kw_only=True)
class CheckpointConfig:
    """Periodic distributed checkpoints under trainer.output_dir/checkpoints."""

    save_interval: int = _f(0, "save every N steps; 0 = only at the end")
    save_at_end: bool = _f(True, "save a checkpoint after the last step (benchmarks may turn it off)")
    async_save: bool = _f(
        False,
        "write checkpoints in a background process while training goes on (needs host "
        "memory for a copy of this rank's model + optimizer shard); committed when written",
    )
    keep_last: int = _f(2, "number of most recent checkpoints to keep (>= 1)")
    resume: str = _f(
        "auto", "auto = resume from the latest checkpoint in output_dir/checkpoints if any | never", ("auto", "never")
    )
    load_optimizer: bool = _f(True, "on resume, also load optimizer/scheduler state")


@dataclass(kw_only=True)
class KernelsConfig:
    """moe-sft's Triton kernels and fused replacements of megatron-core functions (moe_sft/kernels/)."""

    fused: bool = _f(
        True,
        "install moe-sft's kernels: router GEMM and top-k, token permutation, packed RoPE and MTP roll, "
        "one-rank collectives, foreach grad norm, Triton RMSNorm and cross entropy, expert and dense weight-gradient "
        "fusion, fused/Triton Adam. false = megatron-core's own functions and torch ops (same math; for "
        "A/B checks and debugging)",
    )
    wgrad_overlap: bool = _f(
        True,
        "CUDA: add the experts' weight gradients into the fp32 main grads on a side stream, overlapped "
        "with the rest of the backward; false = on the compute stream",
    )


@dataclass(kw_only=True)
class PeftConfig:
    """Parameter-efficient fine-tuning: LoRA/DoRA adapters on a frozen base (moe_sft/peft/)."""

    method: str = _f("none", "none (full-parameter SFT) | lora | dora", ("none", "lora", "dora"))
    rank: int = _f(16, "adapter rank r (A: r x in, B: out x r)")
    alpha: float = _f(32.0, "scaling numerator: the update is (alpha / rank) * B @ A")
    dropout: float = _f(0.0, "dropout on the adapter's input (training only; 0 = off)")
    target_modules: list[str] = _f(
        ["attention", "experts"],
        "where adapters go: shorthands attention | dense_mlp | shared_experts | experts | all_linear, or "
        "fnmatch patterns over module names with global layer numbers (e.g. 'decoder.layers.*.self_attention.linear_qkv')",
    )
    share_expert_factor: str = _f(
        "none",
        "routed experts: none (one A and B per expert) | a (one A per layer, shared by its experts) | b (one B)",
        ("none", "a", "b"),
    )
    lr: float | None = _f(None, "adapter learning rate; null = optimizer.lr")
    train_router: bool = _f(False, "also train the MoE routers (full weights); else frozen with the base")
    train_embeddings: bool = _f(
        False,
        "also train the input embedding and the LM head (full weights; peft's modules_to_save): needed when "
        "the base's vocabulary does not fit the task yet (new tokens, a random base)",
    )
    init_seed: int = _f(0, "seed of the adapters' A initialisation (B starts at zero: the model starts as the base)")
    fp8_base: bool = _f(
        False,
        "keep the frozen base in FP8 on the GPU (e4m3 values, 128x128 block scales as DeepSeek-V3 ships them), "
        "dequantised per layer in the forward and backward; no resident bf16 copy",
    )


@dataclass(kw_only=True)
class HardwareConfig:
    """What the recipe is planned for (python -m moe_sft.plan, trainer.dry_run, recipes/slurm).

    The trainer itself runs on torchrun's world; these fields only describe the intended machines.
    """

    nodes: int = _f(1, "number of nodes")
    gpus_per_node: int = _f(1, "GPUs per node (ranks per node)")
    gpu: str = _f("h100_80gb", "GPU kind: h100_80gb | h200_141gb (memory, kernels)", ("h100_80gb", "h200_141gb"))


@dataclass(kw_only=True)
class TrainConfig:
    """A full run: the sections of a recipe."""

    model: ModelConfig = dataclasses.field(default_factory=ModelConfig, metadata={"help": "model section"})
    data: DataConfig = _required("data section")
    parallel: ParallelConfig = dataclasses.field(
        default_factory=ParallelConfig, metadata={"help": "parallel layout section"}
    )
    optimizer: OptimizerConfig = dataclasses.field(
        default_factory=OptimizerConfig, metadata={"help": "optimizer section"}
    )
    trainer: TrainerConfig = _required("trainer section")
    checkpoint: CheckpointConfig = dataclasses.field(
        default_factory=CheckpointConfig, metadata={"help": "checkpoint section"}
    )
    kernels: KernelsConfig = dataclasses.field(
        default_factory=KernelsConfig, metadata={"help": "kernels section (moe_sft/kernels/)"}
    )
    peft: PeftConfig = dataclasses.field(
        default_factory=PeftConfig, metadata={"help": "LoRA/DoRA section (moe_sft/peft/)"}
    )
    hardware: HardwareConfig = dataclasses.field(
        default_factory=HardwareConfig, metadata={"help": "planned hardware (planner / dry run only)"}
    )


# Section name -> dataclass, in recipe order.
SECTIONS: dict[str, type] = {f.name: f.type for f in dataclasses.fields(TrainConfig)}


def field_help(section: str, name: str) -> str:
    """The one-line doc of `section.name` ('' if unknown)."""
    cls = SECTIONS.get(section)
    if cls is None:
        return ""
    for f in dataclasses.fields(cls):
        if f.name == name:
            return f.metadata.get("help", "")
    return ""
