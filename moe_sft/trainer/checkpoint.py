"""Atomic, resumable training checkpoints in megatron's dist-checkpoint format.

    <output_dir>/checkpoints/step_0000010/   model (+ optimizer, scheduler, RNG, data position)
    <output_dir>/checkpoints/latest          the newest complete step, written last
    <output_dir>/checkpoints/hf_side/        config + tokenizer of the step a resume loaded (the
                                             run's model wins over model.mcore_path's)

Each checkpoint is written into `step_N.tmp`, completed (meta + hf side files) and renamed;
`latest` is replaced atomically afterwards. A killed run therefore resumes from the newest
complete checkpoint and never from a partial one. Any checkpoint directory is also a valid
`--mcore-path` for tools/export_mcore_to_hf.py. Model and optimizer state are sharded by
megatron, so a resume may change TP/PP/EP/DP (RNG state is restored only for the same world).
"""

from __future__ import annotations

import os
import re
import shutil
import signal
import threading
import time
from pathlib import Path

import torch
import torch.distributed as dist
from megatron.core import dist_checkpointing, parallel_state, tensor_parallel
from megatron.core.dist_checkpointing.mapping import ShardedObject

from moe_sft.conversion import mcore_io
from moe_sft.peft import fp8_base, fp8_loading
from moe_sft.peft import state as peft_state
from moe_sft.runtime.logs import get_logger
from moe_sft.trainer import checkpoint_integrity
from moe_sft.trainer.guard import HELPER_IGNORED_SIGNALS, shield_helper_process
from moe_sft.trainer.hooks import TrainHooks

_STEP_DIR = re.compile(r"step_(\d{7})$")
HF_SIDE_COPY = "hf_side"
log = get_logger(__name__)


def step_dir(root: Path, step: int) -> Path:
    return Path(root) / f"step_{step:07d}"


def latest_step(root: Path) -> int | None:
    pointer = Path(root) / "latest"
    if not pointer.is_file():
        return None
    step = int(pointer.read_text().strip())
    return step if (step_dir(root, step) / mcore_io.META_FILE).is_file() else None


def unwrap(model_chunks) -> list:
    """The GPTModels inside megatron's DDP wrappers (DDP would prefix every key with 'module.')."""
    return [getattr(c, "module", c) for c in model_chunks]


def sharded_metadata() -> dict:
    """What megatron's sharded_state_dict needs to know about the layout (as Megatron-LM passes it).

    The data-parallel group decides which replica of a tied tensor is saved: the MTP stage's copy
    of the embedding, for one. Optimizer state is saved per parameter ('fully_reshardable') and
    without the `chained_i.` prefix megatron adds when EP splits the optimizer in two (dense +
    expert): a checkpoint saved without EP then resumes with EP and back.
    """
    return {
        "dp_cp_group": parallel_state.get_data_parallel_group(with_context_parallel=True),
        "distrib_optim_sharding_type": "fully_reshardable",
        "chained_optim_avoid_prefix": True,
    }


def model_sharded_state(model_chunks, part: str = "saved") -> dict:
    """The model's entries. An adapted model (LoRA/DoRA) saves and resumes only what it trains
    (part="saved": the adapters, and the routers when trained); its frozen base is loaded on its
    own (part="base")."""
    model_chunks, meta = unwrap(model_chunks), sharded_metadata()

    def entries(chunk) -> dict:
        full = chunk.sharded_state_dict(metadata=meta)
        if not getattr(chunk, "is_adapted", False):
            return full
        if part == "base":
            return peft_state.base_entries(full)
        return peft_state.trainable_entries(chunk, full, meta["dp_cp_group"])

    if len(model_chunks) == 1:
        return {"model": entries(model_chunks[0])}
    return {f"model{i}": entries(chunk) for i, chunk in enumerate(model_chunks)}


def _load_into(model_chunks, sharded: dict, state: dict, part: str) -> None:
    for key, chunk in zip(sharded, unwrap(model_chunks)):
        if not getattr(chunk, "is_adapted", False):
            chunk.load_state_dict(state[key])
        elif part == "base":
            peft_state.load_partial(chunk, state[key], peft_state.is_adapter_key)
        else:
            peft_state.load_partial(chunk, state[key], peft_state.frozen_key(chunk))


def _rng_object() -> ShardedObject:
    rank, world = dist.get_rank(), dist.get_world_size()
    state = {
        "cpu": torch.get_rng_state(),
        "cuda": torch.cuda.get_rng_state() if torch.cuda.is_available() else None,
        "tracker": tensor_parallel.get_cuda_rng_tracker().get_states(),
    }
    return ShardedObject("rng_state", state, (world,), (rank,), replica_id=0)


def _materialise_optimizer_state(optimizer) -> None:
    """A fresh torch Adam has no state yet, but the sharded state dict describes existing state.

    megatron's own loader fills it with dummy values that the checkpoint then overwrites in place.
    """
    for opt in getattr(optimizer, "chained_optimizers", [optimizer]):
        if not opt.optimizer.state and hasattr(opt, "_init_optimizer_states_with_dummy_values"):
            opt._init_optimizer_states_with_dummy_values()


def _optimizer_parts(optimizer) -> list:
    return list(getattr(optimizer, "chained_optimizers", [optimizer]))


def _optimizer_part_count(saved: dict) -> int:
    """1 for a single distributed optimizer's state ({'optimizer': ..., 'param_state': ...}), N for
    a ChainedOptimizer's ({0: ..., 1: ...}: dense + expert when EP > 1)."""
    return 1 if "optimizer" in saved else len(saved)


def _saved_adam_step(saved: dict) -> int:
    parts = [saved] if "optimizer" in saved else list(saved.values())
    steps = {g["step"] for part in parts for g in part["optimizer"]["param_groups"] if "step" in g}
    if len(steps) != 1:
        raise RuntimeError(f"checkpoint optimizer groups disagree on the Adam step: {sorted(steps)}")
    return steps.pop()


def _restructure_optimizer_state(loaded: dict, optimizer, step: int):
    """The optimizer state of a checkpoint saved with another split (EP=1: one optimizer; EP>1:
    dense + expert) in the structure of this run's optimizer.

    Per-parameter tensors are layout-free (fully_reshardable, no chained prefix), so megatron's
    loader already put them where this run's sharded state dict asked. Only the non-tensor part
    ('param_groups': hyper-parameters and the Adam step) is structured per sub-optimizer; it is
    rebuilt from this run's optimizer, whose groups come from the same recipe (lr and weight decay
    are set by the scheduler every step), with the saved step.
    """
    parts = _optimizer_parts(optimizer)
    states = [loaded] if len(parts) == 1 else [loaded[i] for i in range(len(parts))]
    rebuilt = []
    for part, state in zip(parts, states):
        live = part.state_dict()
        for group in live["optimizer"]["param_groups"]:
            group["step"] = step
        rebuilt.append(dict(live, param_state=state["param_state"], param_state_sharding_type="fully_reshardable"))
    return rebuilt[0] if len(parts) == 1 else dict(enumerate(rebuilt))


# What a param group holds besides its hyper-parameters: the parameters and Adam's step count.
_GROUP_STATE = ("params", "step")
# The scheduler's saved fields that the recipe sets (num_steps is the run's position: it is loaded).
_SCHEDULE_FIELDS = {
    "max_lr": "lr",
    "min_lr": "min_lr",
    "lr_warmup_steps": "lr_warmup_steps",
    "lr_decay_steps": "lr_decay_steps",
    "lr_decay_style": "lr_decay_style",
    "start_wd": "weight_decay",
}
# Param-group keys by the recipe field they come from (the same names as _SCHEDULE_FIELDS').
_GROUP_FIELDS = {
    "max_lr": "lr",
    "min_lr": "min_lr",
    "betas": "adam betas",
    "eps": "adam_eps",
    "lr": "current lr",
    "weight_decay": "current weight_decay",
}


def _hyperparameters(optimizer) -> list[list[dict]]:
    """Each sub-optimizer's param groups without their parameters and step: the recipe's values
    (max_lr / min_lr from optimizer.lr or peft.lr, betas, eps, weight-decay multipliers)."""
    return [
        [{k: v for k, v in group.items() if k not in _GROUP_STATE} for group in part.optimizer.param_groups]
        for part in _optimizer_parts(optimizer)
    ]


def _restore_hyperparameters(optimizer, recipe: list[list[dict]]) -> dict[str, tuple]:
    """Puts the recipe's hyper-parameters back into the param groups a checkpoint just loaded.

    torch's `load_state_dict` replaces every group entry with the saved one, and megatron's
    scheduler reads each group's `max_lr` / `min_lr` before its own: without this, a resume with
    another optimizer.lr trains on the checkpoint's peak while config.yaml records the new one.
    Returns {name: (checkpoint's value, recipe's value)} of what differed (first group that differs).
    """
    changed: dict[str, tuple] = {}
    for part, groups in zip(_optimizer_parts(optimizer), recipe):
        for group, wanted in zip(part.optimizer.param_groups, groups):
            for key, value in wanted.items():
                name = _GROUP_FIELDS.get(key, key)
                if key in group and group[key] != value and name not in changed:
                    changed[name] = (group[key], value)
            group.update(wanted)
    # the scheduler sets each group's current lr and weight decay every step (from the fields above)
    return {k: v for k, v in changed.items() if k not in ("current lr", "current weight_decay")}


def _schedule_changes(saved: dict, scheduler) -> dict[str, tuple]:
    """{recipe field: (checkpoint's, recipe's)} of the LR / WD schedule (megatron's scheduler
    takes the recipe's with override_opt_param_scheduler=True)."""
    return {
        name: (saved[key], getattr(scheduler, key))
        for key, name in _SCHEDULE_FIELDS.items()
        if key in saved and saved[key] != getattr(scheduler, key)
    }


def _is_number(*values) -> bool:
    return all(isinstance(v, (int, float)) and not isinstance(v, bool) for v in values)


def _load_optimizer_keeping_the_recipe(optimizer, scheduler, state: dict) -> None:
    """The checkpoint's optimizer state (moments, main params, Adam step) and schedule position,
    with the recipe's hyper-parameters and LR schedule: a resume may change optimizer.lr,
    optimizer.min_lr, peft.lr, the warmup or the decay, and the change is logged in one line."""
    recipe_groups = _hyperparameters(optimizer)
    optimizer.load_state_dict(state["optimizer"])
    changed = _restore_hyperparameters(optimizer, recipe_groups)
    changed.update(_schedule_changes(state["scheduler"], scheduler))
    scheduler.load_state_dict(state["scheduler"])  # after the groups: it sets each group's lr from them
    if changed:
        log.info(
            "resume: the recipe's optimizer settings win over the checkpoint's: "
            + ", ".join(
                f"{k} {a:g} -> {b:g}" if _is_number(a, b) else f"{k} {a} -> {b}" for k, (a, b) in changed.items()
            )
        )


def full_sharded_state(model_chunks, optimizer, scheduler, extra: dict, is_loading=False) -> dict:
    if is_loading:
        _materialise_optimizer_state(optimizer)
    state = model_sharded_state(model_chunks)
    # 'fully_reshardable': optimizer state in the canonical per-parameter form, so a resume may
    # change TP/PP/EP/DP (the default format relies on flattened ranges torch_dist rejects).
    state["optimizer"] = optimizer.sharded_state_dict(state, is_loading=is_loading, metadata=sharded_metadata())
    state["scheduler"] = scheduler.state_dict()
    state["rng_state"] = _rng_object()
    state["world_size"] = dist.get_world_size()
    state.update(extra)
    return state


def _start_write_results_queue():
    """megatron's writer hands its results to the trainer through a queue in a manager process
    (filesystem_async._get_write_results_queue: `mp.get_context("spawn").Manager().Queue()`).
    Started here instead, with an initializer: megatron's manager dies of the SIGTERM that asks
    for a stop checkpoint (torchrun sends it to the worker's process group, scancel to every
    process), and that save then fails. Returns the manager (None if megatron already has one).
    """
    import multiprocessing
    from multiprocessing.managers import SyncManager

    from megatron.core.dist_checkpointing.strategies import filesystem_async

    if filesystem_async._results_queue is not None:
        return None
    manager = SyncManager(ctx=multiprocessing.get_context("spawn"))
    manager.start(initializer=shield_helper_process, initargs=(os.getpid(),))
    filesystem_async._results_queue = manager.Queue()
    return manager


def _warm_up_write_results_queue(saver: Saver) -> None:
    """Starts, while training runs, what makes a process's first save ~3 s slower than the rest:
    the writer's results manager (`_start_write_results_queue`), which imports torch when it
    unpickles the first result. Put and take back one such object now.

    Runs in a thread with the stop signals blocked: the spawned manager inherits the mask until its
    initializer ignores them (no window in which a SIGTERM kills it); the main thread still gets
    them. Private megatron API: if it moves, the first save pays the 3 s and uses megatron's manager.
    """
    try:
        signal.pthread_sigmask(signal.SIG_BLOCK, HELPER_IGNORED_SIGNALS)
        from megatron.core.dist_checkpointing.strategies import filesystem_async
        from torch.distributed.checkpoint.metadata import MetadataIndex

        saver._manager = _start_write_results_queue()
        results = filesystem_async._get_write_results_queue()
        results.put(MetadataIndex("warm-up"))
        results.get()
    except Exception:  # an optimisation only
        pass


class Saver:
    """Writes checkpoints: in this process, or (async_save) in a writer process per save.

    An async save snapshots the state at the save step (megatron copies it to host memory and
    forks the writer), training goes on, and the checkpoint is committed (meta, hf side files,
    rename, `latest`) by the first `poll()` or `wait()` after the writer finished. One save is in
    flight at a time. `poll()` and `wait()` are collectives while a save is in flight: every rank
    calls them at the same points.
    """

    def __init__(
        self, root: Path, hf_side_dir: Path, keep_last: int, async_save: bool = False, hooks: TrainHooks | None = None
    ):
        from megatron.core.dist_checkpointing.strategies.async_utils import AsyncCallsQueue

        self.root, self.hf_side_dir, self.keep_last = Path(root), hf_side_dir, keep_last
        self.hooks = hooks or TrainHooks()
        self.queue = AsyncCallsQueue() if async_save else None
        self._manager = None
        self._warm_up = threading.Thread(target=_warm_up_write_results_queue, args=(self,), daemon=True)
        self._warm_up.start()

    def close(self) -> None:
        """Stop the results manager (not a collective; call after the last `wait()`). Without it an
        exit while the warm-up was still starting the manager hung: multiprocessing's exit handler
        joins the manager process, whose shutdown finalizer was not registered yet."""
        from megatron.core.dist_checkpointing.strategies import filesystem_async

        self._warm_up.join()
        if self._manager is not None:
            self._manager.shutdown()
            filesystem_async._results_queue = None
            self._manager = None

    def save(self, step: int, model_chunks, optimizer, scheduler, extra: dict, meta: dict) -> Path:
        self._warm_up.join()
        self.wait()
        final = step_dir(self.root, step)
        tmp = final.with_name(final.name + ".tmp")
        if dist.get_rank() == 0:
            shutil.rmtree(tmp, ignore_errors=True)
            tmp.mkdir(parents=True)
        dist.barrier()
        started = time.perf_counter()
        request = dist_checkpointing.save(
            full_sharded_state(model_chunks, optimizer, scheduler, extra),
            str(tmp),
            async_sharded_save=self.queue is not None,
        )

        def commit() -> None:
            dist.barrier()  # every rank's files are written
            self._commit(step, tmp, final, meta, time.perf_counter() - started)

        if self.queue is None:
            commit()
        else:
            request.add_finalize_fn(commit)
            self.queue.schedule_async_request(request)
            log.info(
                f"checkpoint step {step}: writing in the background; training was blocked "
                f"{time.perf_counter() - started:.1f}s"
            )
        return final

    def _commit(self, step: int, tmp: Path, final: Path, meta: dict, seconds: float) -> None:
        self.hooks.before_commit(step)
        if dist.get_rank() == 0:  # before the checksums: they cover the meta and hf/config.json too
            mcore_io.copy_hf_side_files(self.hf_side_dir, tmp / mcore_io.HF_SUBDIR)
            mcore_io.write_meta(tmp, dict(meta, step=step))
        # every rank hashes the shards it wrote; rank 0 writes checksums.json (verified on load)
        files, hashed, hash_s = checkpoint_integrity.write_checksums(tmp)
        if dist.get_rank() == 0:
            size = sum(f.stat().st_size for f in tmp.rglob("*") if f.is_file())
            log.info(
                f"checkpoint step {step}: {size / 1e9:.3f} GB written in {seconds:.1f}s "
                f"({size / 1e9 / max(seconds, 1e-9):.3g} GB/s, all ranks"
                f"{', in the background' if self.queue is not None else ''}); CRC-32 of {files} files "
                f"({hashed / 1e9:.3f} GB) in {hash_s:.2f}s"
            )
            mcore_io.commit_dir(tmp, final)
            pointer_tmp = self.root / "latest.tmp"
            pointer_tmp.write_text(str(step))
            os.replace(pointer_tmp, self.root / "latest")
            _prune(self.root, self.keep_last)
        dist.barrier()

    def poll(self) -> None:
        """Commit a background save whose writer finished (collective while one is in flight)."""
        if self.queue is not None and self.queue.get_num_unfinalized_calls():
            self.queue.maybe_finalize_async_calls(blocking=False)

    def wait(self) -> None:
        """Block until a background save is written and committed."""
        if self.queue is not None and self.queue.get_num_unfinalized_calls():
            self.queue.maybe_finalize_async_calls(blocking=True)


EARLIER_RUN_PREFIX = "earlier_run_"


def set_aside_earlier_run(root: Path) -> tuple[Path, list[int]] | None:
    """checkpoint.resume=never where an earlier run left checkpoints: they move, with `latest` and
    `hf_side`, into `checkpoints/earlier_run_<time>/`; returns (that dir, its steps), or None.

    Left in place, keep_last would count them and prune this run's own steps right after they are
    saved (an earlier run's steps 30 and 40 outrank a new run's 10), and `latest` would name a
    pruned step. Nothing is deleted. Rank 0, under the run lock, before anything is saved."""
    root = Path(root)
    if not root.is_dir():
        return None
    steps = sorted(int(m.group(1)) for p in root.iterdir() if (m := _STEP_DIR.match(p.name)))
    others = [root / n for n in ("latest", HF_SIDE_COPY) if (root / n).exists()]
    if not steps and not others:
        return None
    dest = root / f"{EARLIER_RUN_PREFIX}{time.strftime('%Y%m%d-%H%M%S')}"
    while dest.exists():
        dest = dest.with_name(dest.name + "_")
    dest.mkdir()
    for path in [step_dir(root, s) for s in steps] + others:
        os.replace(path, dest / path.name)
    return dest, steps


def _prune(root: Path, keep_last: int) -> None:
    steps = sorted(int(m.group(1)) for p in root.iterdir() if (m := _STEP_DIR.match(p.name)))
    for step in steps[:-keep_last]:
        shutil.rmtree(step_dir(root, step), ignore_errors=True)


def load_model_weights(path: Path, model_chunks) -> None:
    """Initial weights from a converted (or any moe-sft) checkpoint, in any parallel layout.

    Storage is keyed by each ShardedTensor's global key, not by the dict path, so the chunks of
    a VPP model read the single 'model' a converter wrote.
    """
    if any(fp8_base.fp8_modules(c) for c in unwrap(model_chunks)):  # peft.fp8_base: one layer at a time
        fp8_loading.load_quantised(unwrap(model_chunks), lambda keep: _load_base_part(path, model_chunks, keep))
        return
    sharded = model_sharded_state(model_chunks, part="base")
    state = dist_checkpointing.load(sharded, str(path), strict="assume_ok_unexpected")
    _load_into(model_chunks, sharded, state, part="base")


def _load_base_part(path: Path, model_chunks, keep) -> None:
    """The base entries whose local key `keep(chunk index, key)` accepts (fp8_base.load_quantised)."""
    full = model_sharded_state(model_chunks, part="base")
    sharded = {k: {n: e for n, e in v.items() if keep(i, n)} for i, (k, v) in enumerate(full.items())}
    state = dist_checkpointing.load(sharded, str(path), strict="assume_ok_unexpected")
    for key, chunk in zip(sharded, unwrap(model_chunks)):
        chunk.load_state_dict(state[key], strict=False)


def load_full(
    path: Path, model_chunks, optimizer, scheduler, extra_template: dict, load_optimizer: bool = True
) -> dict:
    """Resume: model, optimizer, scheduler, RNG (same world size only) and the extra entries."""
    sharded = full_sharded_state(model_chunks, optimizer, scheduler, extra_template, is_loading=True)
    if not load_optimizer:
        sharded.pop("optimizer")
    # RNG states are per rank: with another world size (a layout change) they do not map onto
    # the new ranks, so they are not loaded (they only seed dropout; model, optimizer, schedule
    # and data position all reshard).
    common = dist_checkpointing.load_common_state_dict(str(path))
    if common.get("world_size") != dist.get_world_size():
        sharded.pop("rng_state")
    state = dist_checkpointing.load(sharded, str(path), strict="assume_ok_unexpected")
    _load_into(model_chunks, model_sharded_state(model_chunks), state, part="saved")
    if load_optimizer:
        saved_parts = _optimizer_part_count(common["optimizer"])
        if saved_parts != len(_optimizer_parts(optimizer)):
            state["optimizer"] = _restructure_optimizer_state(
                state["optimizer"], optimizer, _saved_adam_step(common["optimizer"])
            )
        _load_optimizer_keeping_the_recipe(optimizer, scheduler, state)
    if state.get("world_size") == dist.get_world_size():
        rng = state["rng_state"]
        torch.set_rng_state(rng["cpu"])
        if rng["cuda"] is not None and torch.cuda.is_available():
            torch.cuda.set_rng_state(rng["cuda"])
        tensor_parallel.get_cuda_rng_tracker().set_states(rng["tracker"])
    return state
