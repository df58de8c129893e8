"""The Trainer: built in documented phases, then a plain loop of `train_step`s.

Phases (each a method, in order): runtime → distributed (rank 0 locks the output directory
first) → model source → data → model → optimizer → resume; a run whose checkpoint already reached
trainer.max_steps stops after distributed (nothing to train). Everything a phase needs from the
recipe is validated before any process group exists (moe_sft.config.validate), and again against
the model's dimensions once the HF config is known.
"""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import torch
import torch.distributed as dist
from megatron.core import parallel_state
from megatron.core.distributed import DistributedDataParallel as DDP
from megatron.core.distributed import DistributedDataParallelConfig, finalize_model_grads
from megatron.core.optimizer import OptimizerConfig as MegatronOptimizerConfig
from megatron.core.optimizer import get_megatron_optimizer
from megatron.core.optimizer_param_scheduler import OptimizerParamScheduler

from moe_sft.config import (ConfigError, TrainConfig, save_resolved_config, validate_against_model,
                            validate_config)
from moe_sft.config.validate import optimizer_offload_errors, resolve_global_batch
from moe_sft.conversion import mcore_io
from moe_sft.layers import dense_wgrad, wgrad
from moe_sft.layers.attention import attention_kernel_name
from moe_sft.models.builder import ModelOptions, build_model_chunks, build_transformer_config
from moe_sft.models.hf_config import num_experts
from moe_sft.plan.preflight import trainer_preflight
from moe_sft.runtime import device as rdevice, distributed
from moe_sft.trainer import (checkpoint, checkpoint_integrity, cuda_graphs, freeze, guard, offload,
                             optimizer_kernels, overlap, run_lock, step as train_step)
from moe_sft.trainer.gc_control import ScheduledGC
from moe_sft.trainer.metrics import MetricsLogger, Throughput, moe_aux_losses, peak_memory_per_rank
from moe_sft.trainer.telemetry import Telemetry

# The demo tokenizer shipped in the repo (made by tools/make_demo_assets.py); the quickstart's
# tiny model is built for it when the recipe names no other tokenizer.
DEMO_TOKENIZER = Path(__file__).resolve().parents[2] / "recipes" / "demo" / "tokenizer"

_TORCHRUN_ENV = ("RANK", "WORLD_SIZE", "LOCAL_RANK", "LOCAL_WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT",
                 "GROUP_RANK", "ROLE_RANK", "TORCHELASTIC_RUN_ID")


def _say(msg: str) -> None:
    if not dist.is_initialized() or dist.get_rank() == 0:
        print(f"[moe-sft] {msg}", flush=True)


def run_single_process(code: list[str]) -> None:
    """Run a tool in a fresh process outside the torchrun world (conversion, export)."""
    # torchrun's variables (TORCHELASTIC_USE_AGENT_STORE above all) would make the child try to
    # join the training world's rendezvous and hang.
    env = {k: v for k, v in os.environ.items()
           if k not in _TORCHRUN_ENV and not k.startswith("TORCHELASTIC_")}
    subprocess.run([sys.executable, *code], check=True, env=env)


class Trainer:
    def __init__(self, cfg: TrainConfig):
        self.cfg = cfg
        self.out = Path(cfg.trainer.output_dir)
        self.ckpt_root = self.out / "checkpoints"
        self.start_step = 0
        self.consumed_tokens = 0  # real (non-padding) tokens trained on, all DP ranks; checkpointed
        self.lock: run_lock.RunLock | None = None
        self.finished_at: int | None = None  # the checkpoint step when it is >= trainer.max_steps

    # ---------------------------------------------------------------- phases
    def setup(self) -> "Trainer":
        run_lock.check_output_dir(self.out)  # a file there: say so before anything
        self._runtime()
        self._distributed()
        if self._finished_already():
            return self
        self._model_source()
        self._data()  # before the model: bad data fails in seconds, not after loading weights
        self._model()
        self._optimizer()
        self._resume()
        self.telemetry = Telemetry.for_trainer(self)  # after loading: expert-bias drift starts here
        self._cuda_graphs()  # after the telemetry: its routing statistics are part of the graphs
        self.gc = ScheduledGC(self.cfg.trainer.gc_interval, self.rt.device)
        # What train_one_step records into; made here so a step needs nothing train() creates.
        self.skips = guard.SkipCounter(self.cfg.trainer.max_skipped_steps_in_a_row)
        self.zero_grads = guard.ZeroGradStreak()
        return self

    def _runtime(self) -> None:
        t = self.cfg.trainer
        self.rt = rdevice.choose_runtime(t.device, t.precision, self.cfg.model.backend)
        if self.cfg.optimizer.optimizer_cpu_offload:  # the recipe's 'auto' values, resolved
            errors = optimizer_offload_errors(self.rt.device, self.rt.precision)
            if errors:
                raise ConfigError(f"device={self.rt.device} precision={self.rt.precision}: " + "; ".join(errors))
        applied = rdevice.prepare_runtime(self.rt)
        if os.environ.get("RANK", "0") == "0":
            print(f"[moe-sft] {self.rt.describe()}", flush=True)
            print(f"[moe-sft] attention kernel: {attention_kernel_name(self.rt.device)}", flush=True)
            if self.rt.device == "cuda":
                alloc = os.environ.get("PYTORCH_CUDA_ALLOC_CONF") or os.environ.get("PYTORCH_ALLOC_CONF") or "default"
                print(f"[moe-sft] CUDA caching allocator: {alloc}", flush=True)
            for patch in applied:
                print(f"[moe-sft] compat: {patch}", flush=True)

    def _distributed(self) -> None:
        world = int(os.environ.get("WORLD_SIZE", "1"))
        batch_line = resolve_global_batch(self.cfg, world)
        if batch_line and int(os.environ.get("RANK", "0")) == 0:
            print(f"[moe-sft] {batch_line}", flush=True)
        self._preflight(world)
        self._lock_output_dir()
        distributed.init_process_group(self.rt.device)
        p = self.cfg.parallel
        distributed.init_model_parallel(
            tp=p.tensor_model_parallel_size, pp=p.pipeline_model_parallel_size,
            vpp=p.virtual_pipeline_model_parallel_size, ep=p.expert_model_parallel_size,
            etp=p.expert_tensor_parallel_size, cp=p.context_parallel_size, seed=self.cfg.trainer.seed)
        self.dp_rank = parallel_state.get_data_parallel_rank()
        self.dp_size = parallel_state.get_data_parallel_world_size()
        _say(f"world={world} tp={p.tensor_model_parallel_size} pp={p.pipeline_model_parallel_size} "
             f"ep={p.expert_model_parallel_size} cp={p.context_parallel_size} dp={self.dp_size}")
        if p.context_parallel_size > 1 and self.rt.backend == "torch":
            _say(f"context parallel: documents padded to a multiple of {2 * p.context_parallel_size}, "
                 f"load-balanced chunks, all-gathered K/V, {attention_kernel_name(self.rt.device)} "
                 f"with separate q/k cu_seqlens (bottom-right causal)")
        if dist.get_rank() == 0:
            self.out.mkdir(parents=True, exist_ok=True)
            save_resolved_config(self.cfg, self.out / "config.yaml")

    def _lock_output_dir(self) -> None:
        """Rank 0, before any process group and before it writes anything in the output dir: one
        run per directory (run_lock.py), then the partial saves of earlier runs go (a disk-full
        save's `.tmp` would otherwise keep the disk full and fail this run's config.yaml)."""
        if os.environ.get("RANK", "0") != "0":
            return
        self.lock = run_lock.RunLock.acquire(self.out)
        if self.lock.note:
            print(f"[moe-sft] {self.lock.note}", flush=True)
        for stale in run_lock.remove_stale_partial_checkpoints(self.ckpt_root):
            print(f"[moe-sft] removed {stale}: a partial checkpoint of an earlier run that never "
                  "completed", flush=True)

    def _finished_already(self) -> bool:
        """The checkpoint to resume already reached trainer.max_steps: no model, data or optimizer
        is built; train() says so (and exports when the HF export is missing)."""
        latest = checkpoint.latest_step(self.ckpt_root) if self.cfg.checkpoint.resume == "auto" else None
        if latest is not None and latest >= self.cfg.trainer.max_steps:
            self.finished_at = latest
        return self.finished_at is not None

    def _preflight(self, world: int) -> None:
        validate_config(self.cfg, world)
        trainer_preflight(self.cfg)  # partial / foreign checkpoints stop here, before any GPU work

    def _model_source(self) -> None:
        m = self.cfg.model
        mcore = Path(m.mcore_path)
        if m.create_tiny_if_missing and not (mcore / mcore_io.META_FILE).is_file():
            if dist.get_rank() == 0:
                _say(f"creating the tiny demo model at {m.hf_path} and converting it to {mcore}")
                tokenizer = self.cfg.data.tokenizer_path or str(DEMO_TOKENIZER)
                run_single_process(["-m", "moe_sft.quickstart_model", "--hf-path", m.hf_path,
                                    "--mcore-path", str(mcore), "--tokenizer", tokenizer])
            dist.barrier()
        self.meta = dict(mcore_io.read_meta(mcore), base_mcore_path=str(mcore.resolve()))
        self.hf_side = mcore / mcore_io.HF_SUBDIR
        self._check_load_source()

    def _check_load_source(self) -> None:
        """Before data and weights: what `_resume` loads is intact and, for a resume, the recipe's
        model; the run's own checkpoint wins (model config and meta come from it)."""
        latest = checkpoint.latest_step(self.ckpt_root)
        self.resume_path = (checkpoint.step_dir(self.ckpt_root, latest)
                            if self.cfg.checkpoint.resume == "auto" and latest is not None else None)
        if self.resume_path is None:
            checkpoint_integrity.verify_loadable(Path(self.cfg.model.mcore_path), "model.mcore_path", say=_say)
            return
        note = checkpoint_integrity.check_same_model(self.resume_path, Path(self.cfg.model.mcore_path))
        if note:
            _say(note)
        checkpoint_integrity.verify_loadable(self.resume_path, "resume checkpoint", self.ckpt_root, say=_say)
        self.meta = {k: v for k, v in mcore_io.read_meta(self.resume_path).items() if k != "step"}
        self.hf_side = self.ckpt_root / checkpoint.HF_SIDE_COPY  # a copy: keep_last prunes step dirs
        if dist.get_rank() == 0:
            mcore_io.copy_hf_side_files(self.resume_path / mcore_io.HF_SUBDIR, self.hf_side)
        dist.barrier()

    def _model(self) -> None:
        from moe_sft.conversion.hf_source import load_hf_config

        self.family, self.hf_cfg = load_hf_config(self.hf_side)
        validate_against_model(self.cfg, self.hf_cfg.num_hidden_layers, num_experts(self.hf_cfg) or None,
                               self.hf_cfg.num_attention_heads, self.hf_cfg.num_key_value_heads,
                               self.hf_cfg.vocab_size)
        m, p = self.cfg.model, self.cfg.parallel
        self.opts = ModelOptions(
            precision=self.rt.precision, backend=self.rt.backend, device=self.rt.device,
            tensor_model_parallel_size=p.tensor_model_parallel_size,
            pipeline_model_parallel_size=p.pipeline_model_parallel_size,
            virtual_pipeline_model_parallel_size=p.virtual_pipeline_model_parallel_size,
            expert_model_parallel_size=p.expert_model_parallel_size,
            expert_tensor_parallel_size=p.expert_tensor_parallel_size,
            context_parallel_size=p.context_parallel_size, sequence_parallel=p.sequence_parallel,
            moe_token_dispatcher_type=m.moe_token_dispatcher_type,
            moe_router_load_balancing_type=m.moe_router_load_balancing_type,
            moe_aux_loss_coeff=m.moe_aux_loss_coeff, moe_router_dtype=m.moe_router_dtype,
            moe_expert_capacity_factor=m.moe_expert_capacity_factor,
            recompute_granularity=m.recompute_granularity,
            extra={k: v for k, v in (("moe_router_enable_expert_bias", m.moe_router_enable_expert_bias),
                                     ("moe_router_bias_update_rate",
                                      0.0 if m.freeze_expert_bias or m.freeze_router
                                      else m.moe_router_bias_update_rate),
                                     ("recompute_method", m.recompute_method),
                                     ("recompute_num_layers", m.recompute_num_layers),
                                     ("recompute_modules", m.recompute_modules),
                                     ("fine_grained_activation_offloading",
                                      bool(m.activation_offload_modules) or None),
                                     ("offload_modules", list(m.activation_offload_modules) or None),
                                     ("num_layers_in_first_pipeline_stage", p.num_layers_in_first_pipeline_stage),
                                     ("num_layers_in_last_pipeline_stage", p.num_layers_in_last_pipeline_stage))
                   if v is not None})
        self.tconfig = build_transformer_config(self.family, self.hf_cfg, self.opts)
        chunks = build_model_chunks(self.family, self.hf_cfg, self.tconfig, self.opts)
        self._setup_mtp(chunks)
        patterns = list(m.freeze_patterns) + ([freeze.ROUTER_PATTERN] if m.freeze_router else [])
        frozen, names = freeze.freeze(chunks, patterns, self.rt.device)
        if patterns:
            _say(f"froze {patterns}: {len(names)} tensors, {frozen / 1e6:.2f}M parameters on rank 0")
        ddp_config = DistributedDataParallelConfig(
            grad_reduce_in_fp32=True, overlap_grad_reduce=p.overlap_grad_reduce,
            overlap_param_gather=p.overlap_param_gather,
            use_distributed_optimizer=p.use_distributed_optimizer)
        # Only the first VPP chunk's buffers are bucketed (as Megatron-LM does): its grads are the
        # last to be ready, so their reduction is what overlap can hide.
        self.model = [DDP(config=self.tconfig, ddp_config=ddp_config, module=c,
                          disable_bucketing=i > 0) for i, c in enumerate(chunks)]
        overlap.install_sync_funcs(self.tconfig, self.model, ddp_config)
        if self.rt.device == "cuda":
            wgrad.guard_grad_sync()  # bucket reductions wait for the experts' side-stream gradients
        fused = dense_wgrad.fuse_dense_wgrad(self.model, self.rt.device)
        if fused:
            _say(f"{fused} dense layers add their weight gradients into the fp32 main grads inside the "
                 "GEMM (megatron's gradient_accumulation_fusion, through torch.addmm), the input embedding's by row")
        params = sum(x.numel() for c in chunks for x in c.parameters())
        _say(f"model {self.family.name}: {params / 1e6:.2f}M parameters on rank 0's shard, "
             f"{self.tconfig.num_layers} layers, {self.tconfig.num_moe_experts} experts")

    def _cuda_graphs(self) -> None:
        if not self.cfg.trainer.cuda_graphs or cuda_graphs.captured_length(self.model) == self.seq_length:
            return
        errors = cuda_graphs.ineligible(self.rt.device, self.cfg)
        if errors:
            raise ConfigError("trainer.cuda_graphs=true: " + "; ".join(errors))
        graphs = cuda_graphs.capture_moe_graphs(self.model, self.seq_length)
        cuda_graphs.reset_after_capture(self.model, self.telemetry.moe)
        _say(f"CUDA graphs: the MoE half of {len(graphs)} layers captured for {self.seq_length}-token micro-batches "
             "(forward and backward)")

    def _setup_mtp(self, chunks) -> None:
        """MTP layers train with the recipe's loss weight, or stay frozen (before DDP sees them)."""
        depths = self.tconfig.mtp_num_layers or 0
        m = self.cfg.model
        self.train_mtp = train_mtp = bool(depths) and not m.freeze_mtp and m.mtp_loss_weight > 0
        if not depths:
            return
        for chunk in chunks:
            chunk.run_mtp = train_mtp
            for param in (chunk.mtp.parameters() if chunk.mtp_process and not train_mtp else ()):
                param.requires_grad_(False)
        _say(f"multi-token prediction: {depths} layer(s), " + (
            f"trained with loss weight {m.mtp_loss_weight}" if train_mtp else "frozen (exported unchanged)"))

    def _optimizer(self) -> None:
        o = self.cfg.optimizer
        bf16 = self.rt.precision == "bf16"
        oc = MegatronOptimizerConfig(
            optimizer="adam", lr=o.lr, min_lr=o.min_lr, weight_decay=o.weight_decay,
            adam_beta1=o.adam_beta1, adam_beta2=o.adam_beta2, adam_eps=o.adam_eps,
            clip_grad=o.clip_grad, bf16=bf16, params_dtype=self.tconfig.params_dtype,
            use_distributed_optimizer=self.cfg.parallel.use_distributed_optimizer,
            optimizer_cpu_offload=o.optimizer_cpu_offload,
            # megatron's default fraction is 0.0: offload on, nothing moved (docs/planner.md)
            optimizer_offload_fraction=o.optimizer_offload_fraction if o.optimizer_cpu_offload else 0.0)
        patterns = list(o.no_weight_decay_patterns)
        overrides, excluded = freeze.weight_decay_overrides(oc, checkpoint.unwrap(self.model), patterns, self.rt.device)
        if patterns:
            _say(f"no weight decay on {excluded} parameter tensor(s) matching {patterns} on rank 0 (besides "
                 "biases and 1-D parameters)")
        self.optimizer = get_megatron_optimizer(oc, self.model, config_overrides=overrides)
        if optimizer_kernels.use_fused_adam(self.optimizer):
            _say("optimizer: torch's fused Adam kernel (no TE/apex FusedAdam)")
        if triton_adam := optimizer_kernels.use_triton_adam(self.optimizer):
            _say(f"optimizer: {triton_adam}")
        if o.optimizer_cpu_offload:
            _say(f"optimizer CPU offload: {o.optimizer_offload_fraction:.0%} of this rank's fp32 optimizer "
                 "shard (main params, Adam moments) is stepped on the CPU (megatron's HybridDeviceOptimizer)")
        # megatron's scheduler needs warmup < decay steps; a short run may end inside warmup
        steps = max(self.cfg.trainer.max_steps, o.lr_warmup_steps + 1)
        self.scheduler = OptimizerParamScheduler(
            self.optimizer, init_lr=0.0 if o.lr_warmup_steps else o.lr, max_lr=o.lr, min_lr=o.min_lr,
            lr_warmup_steps=o.lr_warmup_steps, lr_decay_steps=steps, lr_decay_style=o.lr_decay_style,
            start_wd=o.weight_decay, end_wd=o.weight_decay, wd_incr_steps=steps,
            wd_incr_style="constant", use_checkpoint_opt_param_scheduler=False,
            override_opt_param_scheduler=True)  # the recipe's schedule wins on resume
        self.tconfig.grad_scale_func = self.optimizer.scale_loss
        self.tconfig.finalize_model_grads_func = finalize_model_grads
        self.tconfig.no_sync_func = ([c.no_sync for c in self.model] if len(self.model) > 1
                                     else self.model[0].no_sync)

    def _data(self) -> None:
        from transformers import AutoTokenizer

        from moe_sft.config.validate import doc_multiple_for
        from moe_sft.data.pipeline import build_pipeline

        d, p = self.cfg.data, self.cfg.parallel
        tokenizer_path = d.tokenizer_path or str(self.hf_side)
        self.tokenizer = AutoTokenizer.from_pretrained(tokenizer_path)
        pad_to = self._micro_batch_shape()
        # CP ranks of one DP rank get the same micro-batches (dp_rank excludes CP); each document is
        # padded to the multiple CP's 2*CP-chunk split (and SP) needs.
        self.data = build_pipeline(
            d, tokenizer_path=tokenizer_path, global_batch_size=self.cfg.trainer.global_batch_size, pad_to=pad_to,
            doc_multiple=d.pad_documents_to or doc_multiple_for(p.tensor_model_parallel_size, p.context_parallel_size,
                                                                p.sequence_parallel),
            pad_token_id=self.tokenizer.pad_token_id or 0)
        self.plan = self.data.train
        for line in self.data.summary:
            _say(line)

    def _micro_batch_shape(self) -> int:
        """Sets `fixed_shape` and `seq_length`; returns the multiple micro-batches are padded to."""
        d, p = self.cfg.data, self.cfg.parallel
        pad_to = p.tensor_model_parallel_size if p.sequence_parallel else 1
        # One shape for every micro-batch where megatron needs it: pipeline p2p, and the
        # allgather token dispatcher (it gathers equal-sized slices across the TPxEP group).
        dispatcher = self.cfg.model.moe_token_dispatcher_type
        allgather = dispatcher == "allgather" or (dispatcher == "auto" and self.rt.device == "cpu")
        expert_group = p.expert_model_parallel_size * (p.expert_tensor_parallel_size
                                                       or p.tensor_model_parallel_size)
        self.fixed_shape = p.pipeline_model_parallel_size > 1 or (allgather and expert_group > 1)
        if self.fixed_shape or self.cfg.trainer.cuda_graphs:  # graphs: one micro-batch length
            pad_to = d.pack_length
        self.seq_length = d.pack_length
        return pad_to

    def _resume(self) -> None:
        if self.resume_path is not None:  # checked by _check_load_source
            path = self.resume_path
            state = checkpoint.load_full(path, self.model, self.optimizer, self.scheduler,
                                         self._extra_state(), self.cfg.checkpoint.load_optimizer)
            self.plan.load_state_dict(state["data_state"])
            self.start_step = int(state["step"])
            self.consumed_tokens = int(state.get("consumed_tokens", 0))
            _say(f"resumed from {path} at step {self.start_step} ({self.consumed_tokens:,} tokens consumed)")
            if self.cfg.checkpoint.load_optimizer:
                return  # the fp32 main params came with the optimizer state: keep their precision
        else:
            checkpoint.load_model_weights(Path(self.cfg.model.mcore_path), self.model)
            _say(f"loaded weights from {self.cfg.model.mcore_path}")
        self.optimizer.reload_model_params()  # fp32 main params follow the loaded (bf16) weights

    # ---------------------------------------------------------------- loop
    def _extra_state(self) -> dict:
        return {"data_state": self.plan.state_dict(), "step": self.plan.next_step,
                "consumed_tokens": self.consumed_tokens}

    def _save(self, step: int) -> Path:
        meta = dict(self.meta, step=step)
        with overlap.params_synced(self.model):
            bad, checked = checkpoint_integrity.non_finite_tensors(self.model, self.optimizer)
            if bad:  # never checkpoint poisoned weights: `latest` stays on the last finite save
                self.saver.wait()
                raise guard.NonFiniteTrainingError(checkpoint_integrity.non_finite_message(
                    step, bad, checked, self.ckpt_root, self.cfg.optimizer.lr))
            path = self.saver.save(step, self.model, self.optimizer, self.scheduler, self._extra_state(), meta)
        if not self.cfg.checkpoint.async_save:
            _say(f"saved checkpoint {path}")
        return path

    def train_one_step(self, step: int) -> dict[str, float]:
        self.gc.before_step(step)
        batches, global_tokens = self.plan.batches_for_step(step, self.dp_rank, self.dp_size)
        if step + 1 < self.cfg.trainer.max_steps:
            self.plan.prefetch(step + 1, self.dp_rank, self.dp_size)  # built while this step trains
        for chunk in self.model:
            chunk.train()
            chunk.zero_grad_buffer()
        self.optimizer.zero_grad()
        timer = Throughput()
        timer.start()
        local = train_step.run_forward_backward(self.model, batches, global_tokens, self.rt.device,
                                                self.hf_cfg.vocab_size, self.seq_length,
                                                mtp_weight=self.cfg.model.mtp_loss_weight,
                                                fixed_shape=self.fixed_shape)
        loss, mtp_loss = train_step.global_loss(local)
        if guard.injected_fault("nan_loss", step + 1):
            loss = float("nan")
        if guard.injected_fault("nan_grad", step + 1):
            next(p for c in self.model for p in c.parameters() if p.requires_grad).main_grad.fill_(
                float("nan"))
        stepped, grad_norm = guard.step_unless_non_finite(self.optimizer, loss)
        if stepped:  # a skipped step does not advance the LR schedule (as in Megatron-LM)
            self.scheduler.step(increment=1)
        self.skips.record(step + 1, stepped, loss, grad_norm)
        if warning := self.zero_grads.record(step + 1, grad_norm, loss, self.scheduler.get_lr(
                self.optimizer.param_groups[0])):
            _say(warning)
        tokens = torch.tensor([sum(len(b.tokens) for b in batches), sum(len(b.tokens) - b.num_padding for b in batches)],
                              device=self.rt.device)
        dist.all_reduce(tokens, group=parallel_state.get_data_parallel_group())
        tokens_per_s, seconds = timer.stop(int(tokens[0].item()))
        self.consumed_tokens += int(tokens[1].item())
        metrics = {"train/loss": loss, "train/lr": self.scheduler.get_lr(
            self.optimizer.param_groups[0]), "train/grad_norm": grad_norm,
            "train/tokens_per_s": tokens_per_s, "train/step_seconds": seconds,
            "train/loss_tokens": float(global_tokens), "train/consumed_tokens": float(self.consumed_tokens)}
        metrics.update(moe_aux_losses(self.tconfig, len(batches)))
        metrics.update(self.telemetry.step_metrics(step, batches, seconds))
        metrics.update(self.plan.step_info(step))
        if self.train_mtp:
            metrics["train/mtp_loss"] = mtp_loss
        if self.skips.total:
            metrics["train/skipped_steps"] = float(self.skips.total)
        return metrics

    def train(self) -> None:
        if self.finished_at is not None:
            return self._nothing_to_train()
        t, c = self.cfg.trainer, self.cfg.checkpoint
        logger = MetricsLogger(self.out / "tensorboard", enabled=dist.get_rank() == 0)
        last_saved = self.start_step if self.start_step else None
        stop = guard.StopRequest(self.out / "STOP")
        self.saver = checkpoint.Saver(self.ckpt_root, self.hf_side, c.keep_last, c.async_save)
        if self.rt.device == "cuda":  # training peaks only, not the checkpoint load's
            torch.cuda.reset_peak_memory_stats()
        for step in range(self.start_step, t.max_steps):
            if t.offload_between_steps and step > self.start_step:
                offload.reload_to_gpu(self.model, self.optimizer)
            metrics = self.train_one_step(step)
            self.plan.next_step = step + 1
            self.saver.poll()  # commits a background save that has finished
            if c.save_interval and (step + 1) % c.save_interval == 0:
                self._save(step + 1)
                last_saved = step + 1
            if t.eval_interval and self.data.eval and (step + 1) % t.eval_interval == 0:
                with overlap.params_synced(self.model):
                    logger.log(step + 1, t.max_steps, self.evaluate(), label="eval")
            if t.offload_between_steps and step + 1 < t.max_steps:
                metrics["memory/gpu_allocated_offloaded_gib"] = offload.offload_to_cpu(
                    self.model, self.optimizer)
            if (step + 1) % t.log_interval == 0 or step + 1 == t.max_steps:
                logger.log(step + 1, t.max_steps, metrics)
            if step + 1 < t.max_steps and stop.agreed(self.rt.device):
                if last_saved != step + 1:
                    if t.offload_between_steps:
                        offload.reload_to_gpu(self.model, self.optimizer)
                    self._save(step + 1)
                self.saver.wait()
                logger.close()
                stop.consume()
                _say(f"stopped by {stop.received or 'a signal on another rank'} after step {step + 1}; "
                     "checkpoint saved: run the same command again to resume")
                self._summary(step + 1)
                return
        logger.close()
        self._summary(t.max_steps)
        if t.cuda_graphs:
            replays, eager = cuda_graphs.replay_counts(self.model)
            _say(f"CUDA graphs: {replays} MoE-half replays, {eager} eager training forwards"
                 + ("" if cuda_graphs.REPLAY else " (MOE_SFT_CUDA_GRAPHS_REPLAY=0)"))
        # the telemetry resets the CUDA peak every step (per-step peaks) and keeps the run's peak
        peaks = peak_memory_per_rank(self.rt.device, self.telemetry.run_peak_gib)
        if peaks:
            _say("peak memory per rank (GiB allocated/reserved): " + " ".join(
                f"{r}:{a:.2f}/{b:.2f}" for r, (a, b) in enumerate(peaks)))
        final = max(t.max_steps, self.start_step)
        if not c.save_at_end:
            self.saver.wait()
            return
        if last_saved != final:
            self._save(final)
        self.saver.wait()
        if t.export_hf_at_end:
            self.export(checkpoint.step_dir(self.ckpt_root, final))

    def evaluate(self) -> dict[str, float]:
        """Loss over the whole evaluation set: eval mode, no gradients, no update, Σ w·loss / Σ w."""
        from megatron.core.transformer.moe import moe_utils

        for chunk in self.model:
            chunk.eval()
        per_call = max(self.cfg.trainer.global_batch_size // self.dp_size, 1)
        total = torch.zeros(3, dtype=torch.float64, device=self.rt.device)
        with torch.no_grad():
            for batches in self.data.eval.for_rank(self.dp_rank, self.dp_size, per_call):
                total += train_step.run_forward_backward(
                    self.model, batches, 1.0, self.rt.device, self.hf_cfg.vocab_size, self.seq_length,
                    forward_only=True, mtp_weight=self.cfg.model.mtp_loss_weight)
        moe_utils.clear_aux_losses_tracker()
        loss, mtp_loss = train_step.global_loss(total)
        return {"eval/loss": loss, **({"eval/mtp_loss": mtp_loss} if self.train_mtp else {})}

    def export(self, ckpt: Path) -> None:
        if dist.get_rank() == 0:
            out = self.out / "hf"
            dtype = "bf16" if self.rt.precision == "bf16" else "fp32"
            run_single_process(["-c", "import sys; from moe_sft.conversion.export import export; "
                                "export(sys.argv[1], sys.argv[2], dtype=sys.argv[3])",
                                str(ckpt), str(out), dtype])
            _say(f"exported HF model to {out}")
        dist.barrier()

    def _summary(self, last: int) -> None:
        """End of run: what was trained and what went wrong without stopping it."""
        notes = [f"{self.skips.total} step(s) skipped (non-finite loss or gradient norm)"] if self.skips.total else []
        if zero := self.zero_grads.summary():
            notes.append(f"WARNING: {zero}: nothing trained there (collapsed model? check optimizer.lr)")
        _say(f"run summary: steps {self.start_step + 1}..{last} trained" + "".join(f"; {n}" for n in notes))

    def _nothing_to_train(self) -> None:
        t, step = self.cfg.trainer, self.finished_at
        path = checkpoint.step_dir(self.ckpt_root, step)
        hf = self.out / "hf" / "config.json"
        # an export is current when written after the checkpoint it would export was committed
        missing = t.export_hf_at_end and not (
            hf.is_file() and hf.stat().st_mtime >= (path / mcore_io.META_FILE).stat().st_mtime)
        _say(f"nothing to train: {path} is step {step} and trainer.max_steps={t.max_steps}"
             + ("; exporting it (the HF export is missing or older)" if missing else
                "; raise trainer.max_steps to train further, or use another trainer.output_dir"))
        if missing:
            self.export(path)

    def close(self) -> None:
        if getattr(self, "saver", None) is not None:
            self.saver.close()
        if getattr(self, "gc", None) is not None:
            self.gc.close()
        distributed.destroy()
        if self.lock is not None:
            self.lock.release()
