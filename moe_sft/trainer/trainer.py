"""The Trainer: `setup` builds an explicit `TrainState` in documented phases, then `train` runs
a plain loop of `train_one_step`s over it.

Phases (each a method returning what it built, in order): runtime → distributed (rank 0 locks the
output directory first) → model source (its HF config read once: assemble.HFModel) → data → model
(trainer/assemble.py, the one place a model is built) → optimizer → resume → telemetry and CUDA
graphs; a run whose checkpoint already reached trainer.max_steps stops after distributed (nothing
to train). Everything a phase needs from the recipe is validated before any process group exists
(moe_sft.config.validate), and against the model's dimensions by `assemble` before it allocates.
The benchmark gives its own model source (random initialisation) and data to the constructor.
"""

from __future__ import annotations

import contextlib
import dataclasses
import os
import subprocess
import sys
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
from megatron.core import parallel_state

from moe_sft.config import ConfigError, TrainConfig, save_resolved_config, validate_config
from moe_sft.config.layout import Layout
from moe_sft.config.validate import doc_multiple_for, optimizer_offload_errors, resolve_global_batch
from moe_sft.conversion import mcore_io
from moe_sft.data.pipeline import DataPipeline
from moe_sft.kernels import install as kernels
from moe_sft.layers.attention import attention_kernel_name, set_attention_kernel
from moe_sft.peft import fp8_loading
from moe_sft.peft import install as peft_install
from moe_sft.peft import run_meta as peft_meta
from moe_sft.plan.preflight import trainer_preflight
from moe_sft.runtime import device as rdevice
from moe_sft.runtime import distributed
from moe_sft.runtime.logs import get_logger
from moe_sft.trainer import checkpoint, checkpoint_integrity, cuda_graphs, guard, offload, overlap, run_lock
from moe_sft.trainer import step as train_step
from moe_sft.trainer.assemble import HFModel, assemble, static_rows
from moe_sft.trainer.gc_control import ScheduledGC
from moe_sft.trainer.hooks import TrainHooks
from moe_sft.trainer.metrics import MetricsLogger, Throughput, moe_aux_losses, peak_memory_per_rank
from moe_sft.trainer.optimizer import build_optimizer
from moe_sft.trainer.row_capacity import RowCapacity
from moe_sft.trainer.telemetry import Telemetry

log = get_logger(__name__)

# The demo tokenizer shipped in the repo (made by tools/make_demo_assets.py); the quickstart's
# tiny model is built for it when the recipe names no other tokenizer.
DEMO_TOKENIZER = Path(__file__).resolve().parents[2] / "recipes" / "demo" / "tokenizer"

_TORCHRUN_ENV = (
    "RANK",
    "WORLD_SIZE",
    "LOCAL_RANK",
    "LOCAL_WORLD_SIZE",
    "MASTER_ADDR",
    "MASTER_PORT",
    "GROUP_RANK",
    "ROLE_RANK",
    "TORCHELASTIC_RUN_ID",
)


def run_single_process(code: list[str]) -> None:
    """Run a tool in a fresh process outside the torchrun world (conversion, export)."""
    # torchrun's variables (TORCHELASTIC_USE_AGENT_STORE above all) would make the child try to
    # join the training world's rendezvous and hang.
    subprocess.run([sys.executable, *code], check=True, env=_single_process_env())


def _single_process_env() -> dict[str, str]:
    return {k: v for k, v in os.environ.items() if k not in _TORCHRUN_ENV and not k.startswith("TORCHELASTIC_")}


_EXPORT_CODE = (
    "import sys; from moe_sft.errors import run_reporting_user_errors as run; from {module} import {name} as f; "
    "sys.exit(run(lambda a: [f(a[0], a[1], dtype=a[2]), 0][1], sys.argv[1:]))"
)


def run_export_process(function: str, ckpt: Path, out: Path, dtype: str) -> None:
    """`function` ("module:name") called as `name(ckpt, out, dtype=dtype)` in a process of its own
    (as run_single_process). Its user error (a damaged checkpoint, a user's file in `out`, a full
    disk) is its one `error:` line, raised here as an ExportError with its exit status (4: disk
    full) instead of a traceback; its other output passes through as it comes."""
    from moe_sft.conversion.export import ExportError

    module, name = function.split(":")
    code = ["-c", _EXPORT_CODE.format(module=module, name=name), str(ckpt), str(out), dtype]
    child = subprocess.Popen(
        [sys.executable, *code], env=_single_process_env(), stderr=subprocess.PIPE, text=True, errors="replace"
    )
    error = None
    for line in child.stderr:
        if line.startswith("error: "):
            error = line.removeprefix("error: ").strip()
        else:
            sys.stderr.write(line)
    if child.wait() == 0:
        return
    if error is None:
        raise subprocess.CalledProcessError(child.returncode, [sys.executable, *code])
    raise ExportError(f"the HF export of {ckpt} into {out} did not finish: {error}", exit_code=child.returncode)


@dataclass
class ModelSource:
    """Where the weights and the HF side files (config, tokenizer) come from."""

    meta: dict
    hf_side: Path
    resume_path: Path | None  # the run's own checkpoint to resume, or None: model.mcore_path
    random_init: bool = False  # load no weights: megatron's initialisation (the benchmark's source)


@dataclass(frozen=True)
class BatchShape:
    """The micro-batch geometry every step uses, derived once from the recipe and the runtime."""

    seq_length: int
    fixed_shape: bool  # every micro-batch is seq_length tokens (pipeline p2p, allgather dispatch)
    pad_to: int  # micro-batches are padded to a multiple of this


@dataclass
class TrainState:
    """Everything a step needs, built by `Trainer.setup`; a step replaces none of it."""

    family: Any
    hf_cfg: Any
    tconfig: Any
    model: list
    optimizer: Any
    scheduler: Any
    data: Any  # moe_sft.data.pipeline.DataPipeline: the training loader, eval batches
    batches: Any  # the training loader (data.train; the benchmark swaps in its own)
    shape: BatchShape
    train_mtp: bool
    dp_rank: int
    dp_size: int
    telemetry: Telemetry
    gc: ScheduledGC
    skips: guard.SkipCounter
    zero_grads: guard.ZeroGradStreak
    row_capacity: RowCapacity
    start_step: int = 0
    consumed_tokens: int = 0  # real (non-padding) tokens trained on, all DP ranks; checkpointed


class Trainer:
    def __init__(
        self,
        cfg: TrainConfig,
        hooks: TrainHooks | None = None,
        *,
        source: ModelSource | None = None,
        data: DataPipeline | None = None,
    ):
        """`source` and `data` replace the model source and data phases (the benchmark gives a
        randomly initialised model and its synthetic batches); everything else is the run's."""
        self.cfg = cfg
        self.hooks = hooks or TrainHooks()
        self.given_source, self.given_data = source, data
        self.out = Path(cfg.trainer.output_dir)
        self.ckpt_root = self.out / "checkpoints"
        self.lock: run_lock.RunLock | None = None
        self.finished_at: int | None = None  # the checkpoint step when it is >= trainer.max_steps
        self.saver: checkpoint.Saver | None = None
        self.gc: ScheduledGC | None = None
        self.state: TrainState | None = None  # set by setup()
        self.layout: Layout | None = None  # the derived parallel facts (config/layout.py), set by setup()

    # ---------------------------------------------------------------- phases
    def setup(self) -> Trainer:
        run_lock.check_output_dir(self.out)  # a file there: say so before anything
        guard.forked_helpers_die_with_this_process()  # checkpoint writers must not outlive a killed rank
        self.rt = self._runtime()
        dp_rank, dp_size = self._distributed()
        if self._finished_already():
            return self
        self.source = self.given_source or self._model_source()
        self.hf = HFModel.read(self.source.hf_side)  # the one read of the model's HF config
        self.layout = self.layout.with_topk(self.hf.shape.topk)
        shape = self._batch_shape()
        data = self.given_data or self._data(shape)  # before the model: bad data fails in seconds
        rt = self.rt
        built = assemble(self.cfg, self.hf, self.layout, precision=rt.precision, backend=rt.backend, device=rt.device)
        tconfig, model, train_mtp = built.tconfig, built.model, built.train_mtp
        optimizer, scheduler = self._optimizer(model, tconfig)
        start_step, consumed = self._resume(model, optimizer, scheduler, data.train)
        # after loading: expert-bias drift starts here
        t = self.cfg.trainer
        telemetry = Telemetry(
            config=tconfig,
            model_chunks=model,
            vocab_size=self.hf.config.vocab_size,
            run_mtp=train_mtp,
            device=self.rt.device,
            precision=self.rt.precision,
            peak_tflops=t.peak_tflops,
            log_interval=t.log_interval,
            max_steps=t.max_steps,
        )
        self.gc = ScheduledGC(t.gc_interval, self.rt.device)
        self.state = TrainState(
            family=self.hf.family,
            hf_cfg=self.hf.config,
            tconfig=tconfig,
            model=model,
            optimizer=optimizer,
            scheduler=scheduler,
            data=data,
            batches=data.train,
            shape=shape,
            train_mtp=train_mtp,
            dp_rank=dp_rank,
            dp_size=dp_size,
            telemetry=telemetry,
            gc=self.gc,
            skips=guard.SkipCounter(t.max_skipped_steps_in_a_row),
            zero_grads=guard.ZeroGradStreak(),
            row_capacity=RowCapacity(
                model,
                tconfig.num_layers,
                collective=tconfig.moe_token_dispatcher_type == "allgather" and self.layout.expert_group > 1,
                routing_stats=telemetry.moe,
            ),
            start_step=start_step,
            consumed_tokens=consumed,
        )
        self._cuda_graphs()  # after the telemetry: its routing statistics are part of the graphs
        return self

    def _runtime(self) -> rdevice.RuntimeChoice:
        t = self.cfg.trainer
        rt = rdevice.choose_runtime(t.device, t.precision, self.cfg.model.backend)
        if self.cfg.optimizer.optimizer_cpu_offload:  # the recipe's 'auto' values, resolved
            errors = optimizer_offload_errors(rt.device, rt.precision)
            if errors:
                raise ConfigError(f"device={rt.device} precision={rt.precision}: " + "; ".join(errors))
        applied = rdevice.prepare_runtime(rt)
        log.info(rt.describe())
        try:  # after prepare_runtime: "fa4" checks the current CUDA device
            set_attention_kernel(self.cfg.model.attention_kernel)
        except RuntimeError as exc:
            raise ConfigError(str(exc)) from exc
        log.info(f"attention kernel: {attention_kernel_name(rt.device)}")
        if rt.device == "cuda":
            alloc = os.environ.get("PYTORCH_CUDA_ALLOC_CONF") or os.environ.get("PYTORCH_ALLOC_CONF") or "default"
            log.info(f"CUDA caching allocator: {alloc}")
        for patch in applied:
            log.info(f"megatron fix: {patch}")
        for line in kernels.install(self.cfg.kernels):
            log.info(f"kernels: {line}")
        return rt

    def _distributed(self) -> tuple[int, int]:
        """Validates, locks the output dir, makes the process groups; returns (DP rank, DP size)."""
        world = int(os.environ.get("WORLD_SIZE", "1"))
        if batch_line := resolve_global_batch(self.cfg, world):
            log.info(batch_line)
        self._preflight(world)
        self._lock_output_dir()
        distributed.init_process_group(self.rt.device)
        # the model's top-k completes it once the HF config is known (_model_source)
        self.layout = Layout.from_config(self.cfg, world, device=self.rt.device)
        lay = self.layout
        distributed.init_layout(lay, seed=self.cfg.trainer.seed)
        dp_rank, dp_size = parallel_state.get_data_parallel_rank(), parallel_state.get_data_parallel_world_size()
        log.info(f"world={world} tp={lay.tp} pp={lay.pp} ep={lay.ep} cp={lay.cp} dp={dp_size}")
        if lay.cp > 1 and self.rt.backend == "torch":
            log.info(
                f"context parallel: documents padded to a multiple of {2 * lay.cp}, "
                f"load-balanced chunks, all-gathered K/V, {attention_kernel_name(self.rt.device)} "
                f"with separate q/k cu_seqlens (bottom-right causal)"
            )
        if dist.get_rank() == 0:
            self.out.mkdir(parents=True, exist_ok=True)
            save_resolved_config(self.cfg, self.out / "config.yaml")
        return dp_rank, dp_size

    def _lock_output_dir(self) -> None:
        """Rank 0, before any process group and before it writes anything in the output dir: one
        run per directory (run_lock.py), then the partial saves of earlier runs go (a disk-full
        save's `.tmp` would otherwise keep the disk full and fail this run's config.yaml)."""
        if os.environ.get("RANK", "0") != "0":
            return
        self.lock = run_lock.RunLock.acquire(self.out)
        if self.lock.note:
            log.info(self.lock.note)
        for stale in run_lock.remove_stale_partial_checkpoints(self.ckpt_root):
            log.info(f"removed {stale}: a partial checkpoint of an earlier run that never completed")
        if self.cfg.checkpoint.resume == "never" and (moved := checkpoint.set_aside_earlier_run(self.ckpt_root)):
            dest, steps = moved
            log.info(
                f"checkpoint.resume=never: moved the earlier run's checkpoints (steps "
                f"{', '.join(map(str, steps)) or 'none'}) and `latest` to {dest}, so that this run's "
                f"checkpoint.keep_last and `latest` count only its own steps; delete {dest} to free its space"
            )

    def _finished_already(self) -> bool:
        """The checkpoint to resume already reached trainer.max_steps: no model, data or optimizer
        is built; train() says so (and exports when the HF export is missing)."""
        latest = checkpoint.latest_step(self.ckpt_root) if self.cfg.checkpoint.resume == "auto" else None
        if latest is not None and latest >= self.cfg.trainer.max_steps:
            self.finished_at = latest
        return self.finished_at is not None

    def _preflight(self, world: int) -> None:
        validate_config(self.cfg, world)
        if self.given_source is not None and self.given_source.random_init:
            return  # no checkpoint to check
        if self.cfg.checkpoint.resume == "auto":  # a garbled meta: resume an earlier step, not "reconvert"
            checkpoint_integrity.check_resume_meta(self.ckpt_root)
        trainer_preflight(self.cfg)  # partial / foreign checkpoints stop here, before any GPU work

    def _model_source(self) -> ModelSource:
        """Before data and weights: what `_resume` loads is intact and, for a resume, the recipe's
        model; the run's own checkpoint wins (model config and meta come from it)."""
        m = self.cfg.model
        mcore = Path(m.mcore_path)
        if m.create_tiny_if_missing and not (mcore / mcore_io.META_FILE).is_file():
            if dist.get_rank() == 0:
                log.info(f"creating the tiny demo model at {m.hf_path} and converting it to {mcore}")
                tokenizer = self.cfg.data.tokenizer_path or str(DEMO_TOKENIZER)
                run_single_process(
                    [
                        "-m",
                        "moe_sft.quickstart_model",
                        "--hf-path",
                        m.hf_path,
                        "--mcore-path",
                        str(mcore),
                        "--tokenizer",
                        tokenizer,
                    ]
                )
            dist.barrier()
        latest = checkpoint.latest_step(self.ckpt_root)
        if self.cfg.checkpoint.resume != "auto" or latest is None:
            checkpoint_integrity.verify_loadable(mcore, "model.mcore_path")
            return ModelSource(
                meta=dict(
                    mcore_io.read_meta(mcore),
                    base_mcore_path=str(mcore.resolve()),
                    **peft_meta.record(self.cfg.peft, mcore),
                ),
                hf_side=mcore / mcore_io.HF_SUBDIR,
                resume_path=None,
            )
        resume_path = checkpoint.step_dir(self.ckpt_root, latest)
        # first: the checksums cover the meta and hf/config.json the checks below read
        checkpoint_integrity.verify_loadable(resume_path, "resume checkpoint", self.ckpt_root)
        peft_meta.check_resume(mcore_io.read_meta(resume_path), self.cfg.peft, mcore, resume_path)
        if note := checkpoint_integrity.check_same_model(resume_path, mcore):
            log.info(note)
        hf_side = self.ckpt_root / checkpoint.HF_SIDE_COPY  # a copy: keep_last prunes step dirs
        if dist.get_rank() == 0:
            mcore_io.copy_hf_side_files(resume_path / mcore_io.HF_SUBDIR, hf_side)
        dist.barrier()
        meta = {k: v for k, v in mcore_io.read_meta(resume_path).items() if k != "step"}
        return ModelSource(meta=meta, hf_side=hf_side, resume_path=resume_path)

    def _batch_shape(self) -> BatchShape:
        d, p = self.cfg.data, self.cfg.parallel
        pad_to = p.tensor_model_parallel_size if p.sequence_parallel else 1
        # One shape for every micro-batch where megatron needs it (Layout.fixed_shape)
        fixed_shape = self.layout.fixed_shape
        if fixed_shape or self.cfg.trainer.cuda_graphs:  # graphs: one micro-batch length
            pad_to = d.pack_length
        return BatchShape(seq_length=d.pack_length, fixed_shape=fixed_shape, pad_to=pad_to)

    def _data(self, shape: BatchShape) -> DataPipeline:
        from transformers import AutoTokenizer

        from moe_sft.data.pipeline import build_pipeline

        d, p = self.cfg.data, self.cfg.parallel
        tokenizer_path = d.tokenizer_path or str(self.source.hf_side)
        tokenizer = AutoTokenizer.from_pretrained(tokenizer_path)
        # CP ranks of one DP rank get the same micro-batches (dp_rank excludes CP); each document is
        # padded to the multiple CP's 2*CP-chunk split (and SP) needs.
        data = build_pipeline(
            d,
            tokenizer_path=tokenizer_path,
            global_batch_size=self.cfg.trainer.global_batch_size,
            pad_to=shape.pad_to,
            pad_token_id=tokenizer.pad_token_id or 0,
            doc_multiple=d.pad_documents_to
            or doc_multiple_for(p.tensor_model_parallel_size, p.context_parallel_size, p.sequence_parallel),
            vocab_size=self.hf.config.vocab_size,  # ids past it would train silently
        )
        for line in data.summary:
            log.info(line)
        return data

    def _optimizer(self, model, tconfig):
        optimizer, scheduler, lines = build_optimizer(self.cfg, model, tconfig, self.rt)
        for line in lines:
            log.info(line)
        return optimizer, scheduler

    def _resume(self, model, optimizer, scheduler, batches) -> tuple[int, int]:
        """Loads the weights (and for a resume everything else); returns (start step, consumed tokens)."""
        path = self.source.resume_path
        adapted = self.cfg.peft.method != "none"
        if self.source.random_init:  # the optimizer made its fp32 main params from these same weights
            if adapted and self.cfg.peft.fp8_base:  # its FP8 storage was never initialised
                chunks = checkpoint.unwrap(model)
                fp8_loading.fill_random(chunks, chunks[0].config.init_method_std)
            log.info("random initialisation: no weights loaded")
            return 0, 0
        if path is None or adapted:  # a LoRA checkpoint holds the adapters, not the base
            checkpoint.load_model_weights(Path(self.cfg.model.mcore_path), model)
            log.info(f"loaded {'the frozen base' if adapted else 'weights'} from {self.cfg.model.mcore_path}")
        if path is None:
            if adapted:
                peft_install.init_dora_magnitudes(checkpoint.unwrap(model))
            optimizer.reload_model_params()  # fp32 main params follow the loaded (bf16) weights
            return 0, 0
        template = {"data_state": batches.state_dict(), "step": 0, "consumed_tokens": 0}
        state = checkpoint.load_full(path, model, optimizer, scheduler, template, self.cfg.checkpoint.load_optimizer)
        batches.load_state_dict(state["data_state"])
        start, consumed = int(state["step"]), int(state.get("consumed_tokens", 0))
        log.info(f"resumed from {path} at step {start} ({consumed:,} tokens consumed)")
        if not self.cfg.checkpoint.load_optimizer:  # with it, the fp32 main params came with the optimizer state
            optimizer.reload_model_params()
        return start, consumed

    def use_pack_length(self, pack_length: int) -> None:
        """Micro-batches of `pack_length` tokens from the next step on, for the model already built
        (the benchmark runs several lengths in one process): the batch shape, the static rows and
        the CUDA graphs follow it as a run with this data.pack_length would have them."""
        self.cfg.data.pack_length = pack_length
        self.layout = dataclasses.replace(self.layout, tokens=pack_length)
        self.state.shape = self._batch_shape()
        static_rows(self.state.model, self.layout, self.cfg.model.moe_static_rows_capacity)
        self._cuda_graphs()

    def _cuda_graphs(self) -> None:
        s = self.state
        if not self.cfg.trainer.cuda_graphs or cuda_graphs.captured_length(s.model) == s.shape.seq_length:
            return
        errors = cuda_graphs.ineligible(self.rt.device, self.cfg) + cuda_graphs.dispatch_ineligible(
            s.model, self.layout.expert_group
        )
        if errors:
            raise ConfigError("trainer.cuda_graphs=true: " + "; ".join(errors))
        graphs = cuda_graphs.capture_moe_graphs(
            s.model, s.shape.seq_length, self.layout.expert_group, replay=self.cfg.trainer.cuda_graphs_replay
        )
        cuda_graphs.reset_after_capture(s.model, s.telemetry.moe)
        log.info(
            f"CUDA graphs: the MoE half of {len(graphs)} layers captured for {s.shape.seq_length}-token "
            "micro-batches (forward and backward)"
        )

    # ---------------------------------------------------------------- loop
    def _extra_state(self) -> dict:
        s = self.state
        return {"data_state": s.batches.state_dict(), "step": s.batches.next_step, "consumed_tokens": s.consumed_tokens}

    def _save(self, step: int) -> Path:
        s = self.state
        with overlap.params_synced(s.model):
            bad, checked = checkpoint_integrity.non_finite_tensors(s.model, s.optimizer)
            if bad:  # never checkpoint poisoned weights: `latest` stays on the last finite save
                self.saver.wait()
                raise guard.NonFiniteTrainingError(
                    checkpoint_integrity.non_finite_message(step, bad, checked, self.ckpt_root, self.cfg.optimizer.lr)
                )
            path = self.saver.save(
                step, s.model, s.optimizer, s.scheduler, self._extra_state(), dict(self.source.meta, step=step)
            )
        if not self.cfg.checkpoint.async_save:
            log.info(f"saved checkpoint {path}")
        return path

    def train_one_step(self, step: int) -> dict[str, float]:
        s = self.state
        s.gc.before_step(step)
        batches, global_tokens = s.batches.batches_for_step(step, s.dp_rank, s.dp_size)
        if step + 1 < self.cfg.trainer.max_steps:
            s.batches.prefetch(step + 1, s.dp_rank, s.dp_size)  # built while this step trains
        for chunk in s.model:
            chunk.train()
            chunk.zero_grad_buffer()
        s.optimizer.zero_grad()
        timer = Throughput()
        timer.start()
        s.row_capacity.before_step()
        local = self._forward_backward(batches, global_tokens)
        if overflows := s.row_capacity.overflows():
            log.info(
                f"step {step + 1}: routing exceeded the static row capacity (model.moe_static_rows_capacity="
                f"{self.cfg.model.moe_static_rows_capacity:g}) in {'; '.join(overflows)}: the step runs again "
                "with exact row counts"
            )
            s.row_capacity.restore()
            s.optimizer.zero_grad()
            with s.row_capacity.exact_rows():
                local = self._forward_backward(batches, global_tokens)
        loss, mtp_loss = train_step.global_loss(local)
        loss = self.hooks.after_backward(step + 1, loss, s.model)
        stepped, grad_norm = guard.step_unless_non_finite(s.optimizer, loss)
        if stepped:  # a skipped step does not advance the LR schedule (as in Megatron-LM)
            s.scheduler.step(increment=1)
        lr = s.scheduler.get_lr(s.optimizer.param_groups[0])
        s.skips.record(step + 1, stepped, loss, grad_norm)
        if warning := s.zero_grads.record(step + 1, grad_norm, loss, lr):
            log.info(warning)
        tokens = torch.tensor(
            [sum(len(b.tokens) for b in batches), sum(len(b.tokens) - b.num_padding for b in batches)],
            device=self.rt.device,
        )
        dist.all_reduce(tokens, group=parallel_state.get_data_parallel_group())
        tokens_per_s, seconds = timer.stop(int(tokens[0].item()))
        s.consumed_tokens += int(tokens[1].item())
        metrics = {
            "train/loss": loss,
            "train/lr": lr,
            "train/grad_norm": grad_norm,
            "train/tokens_per_s": tokens_per_s,
            "train/step_seconds": seconds,
            "train/loss_tokens": float(global_tokens),
            "train/consumed_tokens": float(s.consumed_tokens),
        }
        metrics.update(moe_aux_losses(s.tconfig, len(batches)))
        metrics.update(s.telemetry.step_metrics(step, batches, seconds))
        metrics.update(s.batches.step_info(step))
        if s.train_mtp:
            metrics["train/mtp_loss"] = mtp_loss
        if s.skips.total:
            metrics["train/skipped_steps"] = float(s.skips.total)
        if s.row_capacity.reruns:
            metrics["train/row_capacity_reruns"] = float(s.row_capacity.reruns)
        return metrics

    def _dora_norms_once(self):
        """DoRA's weight norms once per step (the weights change only at the optimizer step)."""
        if self.cfg.peft.method != "dora":
            return contextlib.nullcontext()
        return peft_install.dora_norms_once(self.state.model)

    def _forward_backward(self, batches, global_tokens: int) -> torch.Tensor:
        s = self.state
        with self._dora_norms_once():
            return train_step.run_forward_backward(
                s.model,
                batches,
                global_tokens,
                self.rt.device,
                s.hf_cfg.vocab_size,
                s.shape.seq_length,
                mtp_weight=self.cfg.model.mtp_loss_weight,
                fixed_shape=s.shape.fixed_shape,
            )

    def train(self) -> None:
        if self.finished_at is not None:
            return self._nothing_to_train()
        s, t, c = self.state, self.cfg.trainer, self.cfg.checkpoint
        metrics_out = MetricsLogger(self.out / "tensorboard", enabled=dist.get_rank() == 0)
        last_saved = s.start_step if s.start_step else None
        stop = guard.StopRequest(self.out / "STOP")
        self.saver = checkpoint.Saver(self.ckpt_root, self.source.hf_side, c.keep_last, c.async_save, self.hooks)
        if self.rt.device == "cuda":  # training peaks only, not the checkpoint load's
            torch.cuda.reset_peak_memory_stats()
        for step in range(s.start_step, t.max_steps):
            if t.offload_between_steps and step > s.start_step:
                offload.reload_to_gpu(s.model, s.optimizer)
            metrics = self.train_one_step(step)
            s.batches.next_step = step + 1
            self.saver.poll()  # commits a background save that has finished
            if c.save_interval and (step + 1) % c.save_interval == 0:
                self._save(step + 1)
                last_saved = step + 1
            if t.eval_interval and s.data.eval and (step + 1) % t.eval_interval == 0:
                with overlap.params_synced(s.model):
                    metrics_out.log(step + 1, t.max_steps, self.evaluate(), label="eval")
            if t.offload_between_steps and step + 1 < t.max_steps:
                metrics["memory/gpu_allocated_offloaded_gib"] = offload.offload_to_cpu(s.model, s.optimizer)
            if (step + 1) % t.log_interval == 0 or step + 1 == t.max_steps:
                metrics_out.log(step + 1, t.max_steps, metrics)
            if step + 1 < t.max_steps and stop.agreed(self.rt.device):
                if last_saved != step + 1:
                    if t.offload_between_steps:
                        offload.reload_to_gpu(s.model, s.optimizer)
                    self._save(step + 1)
                self.saver.wait()
                metrics_out.close()
                stop.consume()
                log.info(
                    f"stopped by {stop.received or 'a signal on another rank'} after step {step + 1}; "
                    "checkpoint saved: run the same command again to resume"
                )
                self._summary(step + 1)
                return
        metrics_out.close()
        self._summary(t.max_steps)
        self._end_of_run_report()
        final = max(t.max_steps, s.start_step)
        if not c.save_at_end:
            self.saver.wait()
            return
        if last_saved != final:
            self._save(final)
        self.saver.wait()
        if t.export_hf_at_end:
            self.export(checkpoint.step_dir(self.ckpt_root, final))

    def _end_of_run_report(self) -> None:
        if self.cfg.trainer.cuda_graphs:
            replays, eager = cuda_graphs.replay_counts(self.state.model)
            log.info(
                f"CUDA graphs: {replays} MoE-half replays, {eager} eager training forwards"
                + ("" if self.cfg.trainer.cuda_graphs_replay else " (trainer.cuda_graphs_replay=false)")
            )
        # the telemetry resets the CUDA peak every step (per-step peaks) and keeps the run's peak
        peaks = peak_memory_per_rank(self.rt.device, self.state.telemetry.run_peak_gib)
        if peaks:
            log.info(
                "peak memory per rank (GiB allocated/reserved): "
                + " ".join(f"{r}:{a:.2f}/{b:.2f}" for r, (a, b) in enumerate(peaks))
            )

    def evaluate(self) -> dict[str, float]:
        """Loss over the whole evaluation set: eval mode, no gradients, no update, Σ w·loss / Σ w."""
        from megatron.core.transformer.moe import moe_utils

        s = self.state
        for chunk in s.model:
            chunk.eval()
        per_call = max(self.cfg.trainer.global_batch_size // s.dp_size, 1)
        total = torch.zeros(3, dtype=torch.float64, device=self.rt.device)
        with torch.no_grad(), s.row_capacity.exact_rows(), self._dora_norms_once():  # rows counted: no rerun
            for batches in s.data.eval.for_rank(s.dp_rank, s.dp_size, per_call):
                total += train_step.run_forward_backward(
                    s.model,
                    batches,
                    1.0,
                    self.rt.device,
                    s.hf_cfg.vocab_size,
                    s.shape.seq_length,
                    forward_only=True,
                    mtp_weight=self.cfg.model.mtp_loss_weight,
                )
        moe_utils.clear_aux_losses_tracker()
        loss, mtp_loss = train_step.global_loss(total)
        return {"eval/loss": loss, **({"eval/mtp_loss": mtp_loss} if s.train_mtp else {})}

    def export(self, ckpt: Path) -> None:
        if dist.get_rank() == 0:
            out = self.out / "hf"
            dtype = "bf16" if self.rt.precision == "bf16" else "fp32"
            run_export_process("moe_sft.conversion.export:export", ckpt, out, dtype)
            log.info(f"exported HF model to {out}" + (" (adapters merged)" if self.cfg.peft.method != "none" else ""))
            if self.cfg.peft.method != "none":  # also as a PEFT adapter, where peft can express it
                adapter = self.out / "hf_adapter"
                run_export_process("moe_sft.peft.hf_adapter:export_adapter_if_expressible", ckpt, adapter, dtype)
                if (adapter / "adapter_config.json").is_file():
                    log.info(f"exported PEFT adapter to {adapter}")
                else:
                    log.warning(f"no PEFT adapter written to {adapter} (the reason is logged above); {out} is merged")
        dist.barrier()

    def _summary(self, last: int) -> None:
        """End of run: what was trained and what went wrong without stopping it."""
        s = self.state
        notes = [f"{s.skips.total} step(s) skipped (non-finite loss or gradient norm)"] if s.skips.total else []
        if zero := s.zero_grads.summary():
            notes.append(f"WARNING: {zero}: nothing trained there (collapsed model? check optimizer.lr)")
        log.info(f"run summary: steps {s.start_step + 1}..{last} trained" + "".join(f"; {n}" for n in notes))

    def _nothing_to_train(self) -> None:
        t, step = self.cfg.trainer, self.finished_at
        path = checkpoint.step_dir(self.ckpt_root, step)
        hf = self.out / "hf" / "config.json"
        # an export is current when written after the checkpoint it would export was committed
        missing = t.export_hf_at_end and not (
            hf.is_file() and hf.stat().st_mtime >= (path / mcore_io.META_FILE).stat().st_mtime
        )
        log.info(
            f"nothing to train: {path} is step {step} and trainer.max_steps={t.max_steps}"
            + (
                "; exporting it (the HF export is missing or older)"
                if missing
                else "; raise trainer.max_steps to train further, or use another trainer.output_dir"
            )
        )
        if missing:
            self.export(path)

    def close(self) -> None:
        if self.saver is not None:
            self.saver.close()
        if self.gc is not None:
            self.gc.close()
        if self.state is not None:
            cuda_graphs.release(self.state.model)
        distributed.destroy()
        if self.lock is not None:
            self.lock.release()
