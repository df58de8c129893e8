"""What is saved is finite, what is loaded is whole, and a resume loads the run's own model.

* Save: `non_finite_tensors` (collective) finds parameters, fp32 main parameters and Adam moments
  holding NaN/Inf before a save, so a run never checkpoints poisoned weights; `write_checksums`
  (collective, at commit) records every file's size and CRC-32 in `checksums.json`: each rank
  hashes the shards it wrote (`__<rank>_*.distcp`, still in its page cache), rank 0 the rest.
* Load: `verify_loadable` (collective) checks the files megatron's `.metadata` lists against the
  directory (present, long enough), then the checksums (spread over the ranks by size), and names
  the bad file and the previous complete step instead of a torch/megatron traceback.
* Resume: `check_same_model` compares the run's checkpoint with `model.mcore_path` (architecture:
  error; other weights of the same architecture: the run's checkpoint wins, with a warning).

CRC-32 (zlib, streamed in 8 MiB chunks, GIL released: docs/log.md for its speed) detects every
corruption of up to 32 bits and any other with probability 1 - 2^-32: corruption, not tampering.
"""

from __future__ import annotations

import json
import os
import re
import time
from collections.abc import Callable
from pathlib import Path

import torch
import torch.distributed as dist

from moe_sft.conversion import mcore_io
from moe_sft.conversion.checksums import (  # the pure file checks; CHUNK, file_crc32: the old import path
    CHECKSUM_FILE,
    CHUNK,  # noqa: F401
    checksum_problems,
    complete_steps,
    file_crc32,  # noqa: F401
    read_checksums,
    storage_problems,
)
from moe_sft.conversion.checksums import hash_files as _hash_files
from moe_sft.conversion.hf_reader import CheckpointError
from moe_sft.runtime.logs import get_logger

_STEP_DIR = re.compile(r"step_(\d{7})$")  # = checkpoint.step_dir's names
_MOMENTS = ("exp_avg", "exp_avg_sq")


class CheckpointIntegrityError(CheckpointError):
    """A checkpoint to load is damaged or holds another model; the message names file and fix."""


def _rank_world() -> tuple[int, int]:
    if dist.is_available() and dist.is_initialized():
        return dist.get_rank(), dist.get_world_size()
    return 0, 1


def _gather(obj) -> list:
    world = _rank_world()[1]
    if world == 1:
        return [obj]
    out = [None] * world
    dist.all_gather_object(out, obj)
    return out


# ----------------------------------------------------------------------------- save: finite


def _main_param_pairs(opt):
    """(model param, fp32 main param) pairs of one megatron optimizer (distributed or not)."""
    for model_attr, main_attr in (
        ("model_float16_groups", "shard_fp32_from_float16_groups"),
        ("model_fp32_groups", "shard_fp32_groups"),
        ("float16_groups", "fp32_from_float16_groups"),
    ):
        for model_group, main_group in zip(getattr(opt, model_attr, None) or [], getattr(opt, main_attr, None) or []):
            yield from zip(model_group, main_group)


def _checked_tensors(model_chunks, optimizer):
    """(name, tensor): this rank's parameters, its fp32 main-parameter shards and their Adam moments."""
    names = {}
    for chunk in model_chunks:
        for name, param in getattr(chunk, "module", chunk).named_parameters():
            names[id(param)] = name
            yield name, param
    for opt in getattr(optimizer, "chained_optimizers", [optimizer]):
        state = getattr(getattr(opt, "optimizer", None), "state", None) or {}
        for model_param, main in _main_param_pairs(opt):
            name = names.get(id(model_param), "?")
            if main.untyped_storage().data_ptr() != model_param.untyped_storage().data_ptr():
                yield f"{name} (fp32 main)", main  # fp32 models: the shard is a view of the parameter
            moments = state.get(main, {}) if isinstance(state, dict) else {}
            for key in _MOMENTS:
                if isinstance(moments.get(key), torch.Tensor):
                    yield f"{name} ({key})", moments[key]


def non_finite_tensors(model_chunks, optimizer) -> tuple[list[str], int]:
    """(names of the tensors holding NaN/Inf on any rank, number of distinct tensor names checked
    on all ranks; 0 when all are finite). Collective.

    aminmax per tensor (NaN propagates into both, an Inf shows in one; no tensor-sized
    temporaries), one device-to-host copy, one all-reduce; names are gathered only on failure.
    """
    named = [(n, t) for n, t in _checked_tensors(model_chunks, optimizer) if t.is_floating_point() and t.numel() > 0]
    bad: list[str] = []
    by_device: dict = {}
    for i, (_, t) in enumerate(named):
        by_device.setdefault(t.device, []).append(i)
    for idx in by_device.values():
        extremes = torch.stack([torch.stack(torch.aminmax(named[i][1].detach())).float() for i in idx])
        finite = torch.isfinite(extremes).all(dim=1).cpu()
        bad += [named[i][0] for i, ok in zip(idx, finite.tolist()) if not ok]
    if _rank_world()[1] > 1:
        flag = torch.tensor([float(len(bad))], device=named[0][1].device if named else "cpu")
        dist.all_reduce(flag, op=dist.ReduceOp.MAX)
        if flag.item() == 0:
            return [], 0
    elif not bad:
        return [], 0
    parts = _gather((bad, [n for n, _ in named]))
    return sorted({n for names, _ in parts for n in names}), len({n for _, names in parts for n in names})


def non_finite_message(step: int, bad: list[str], checked: int, root: Path, lr: float) -> str:
    params = [n for n in bad if "(" not in n]
    shown = ", ".join((params or bad)[:4]) + (", ..." if len(params or bad) > 4 else "")
    good = latest_complete(root)
    where = (
        f"The last good checkpoint is {good} (`latest`): run the same command again, with the lower "
        "learning rate, to resume from it"
        if good is not None
        else "No checkpoint of this run was saved: a relaunch starts again from model.mcore_path"
    )
    return (
        f"step {step}: {len(params)} parameter tensor(s) and {len(bad) - len(params)} fp32 main-parameter / "
        f"Adam state tensor(s) of {checked} hold NaN or Inf ({shown}), so this checkpoint is not saved and "
        f"the run stops: the update of a step whose loss and gradient norm were finite overflowed the "
        f"weights. Lower optimizer.lr (now {lr:g}). {where}"
    )


# ----------------------------------------------------------------------------- checksums


def _data_files(ckpt_dir: Path) -> list[Path]:
    """megatron's files, moe_sft_meta.json and the hf side files (hf/config.json is the model a
    resume builds: an edited rope_theta there would train silently on another model)."""
    top = [p for p in Path(ckpt_dir).iterdir() if p.is_file() and p.name != CHECKSUM_FILE]
    side = [p for p in (Path(ckpt_dir) / mcore_io.HF_SUBDIR).rglob("*") if p.is_file()]
    return sorted(top + side)


def write_checksums(ckpt_dir: Path) -> tuple[int, int, float]:
    """Collective, once every rank's files are written (rank 0's meta and hf side files too):
    `checksums.json` with each file's size and CRC-32. Rank r hashes `__r_*` (the shards it
    wrote), rank 0 every other file. Returns
    (files, bytes, seconds of the slowest rank)."""
    rank, world = _rank_world()
    started = time.perf_counter()
    files = _data_files(ckpt_dir)
    owned = [p for p in files if p.name.startswith(f"__{rank}_")]
    claimed = tuple(f"__{r}_" for r in range(world))
    if rank == 0:
        owned += [p for p in files if not p.name.startswith(claimed)]
    gathered = _gather((_hash_files(owned, root=Path(ckpt_dir)), time.perf_counter() - started))
    sums = {name: entry for part, _ in gathered for name, entry in part.items()}
    if rank == 0:  # then renames the directory: nothing below may read it
        tmp = Path(ckpt_dir) / (CHECKSUM_FILE + ".tmp")
        tmp.write_text(json.dumps({"algorithm": "crc32", "files": dict(sorted(sums.items()))}, indent=1))
        os.replace(tmp, Path(ckpt_dir) / CHECKSUM_FILE)
    return len(sums), sum(e["size"] for e in sums.values()), max(s for _, s in gathered)


def _share(sizes: dict[str, int], world: int) -> list[list[str]]:
    """Files per rank, largest first onto the least loaded rank (same answer on every rank)."""
    loads, shares = [0] * world, [[] for _ in range(world)]
    for name in sorted(sizes, key=lambda n: (-sizes[n], n)):
        r = loads.index(min(loads))
        loads[r] += sizes[name]
        shares[r].append(name)
    return shares


# ----------------------------------------------------------------------------- load: whole


def latest_complete(root: Path) -> Path | None:
    pointer = Path(root) / "latest"
    if pointer.is_file() and pointer.read_text().strip().isdigit():
        path = Path(root) / f"step_{int(pointer.read_text().strip()):07d}"
        if (path / mcore_io.META_FILE).is_file():
            return path
    return None


def _damage_message(path: Path, field: str, problems: dict[str, str], root: Path | None, edits: bool = True) -> str:
    listed = "; ".join(f"{name}: {why}" for name, why in sorted(problems.items()))
    head = f"{field} {path} is damaged ({listed})"
    edited = [n for n in sorted(problems) if n == mcore_io.META_FILE or n.startswith(f"{mcore_io.HF_SUBDIR}/")]
    if edits and edited and len(edited) == len(problems) and root is not None:
        head = (
            f"{field} {path}: {', '.join(edited)} changed after the save ({listed}); the weights were "
            f"trained with the saved {'files' if len(edited) > 1 else 'file'}, so the run does not resume on "
            f"an edited model. Restore {'them' if len(edited) > 1 else 'it'} (an earlier step's copy is "
            f"the same unless the run changed it), or resume from the previous step"
        )
    if root is None:
        return f"{head}; reconvert it with tools/convert_hf_to_mcore.py or point model.mcore_path at an intact copy"
    match = _STEP_DIR.match(path.name)
    earlier = complete_steps(root, before=int(match.group(1)) if match else None)
    if not earlier:
        return (
            f"{head}; no earlier complete checkpoint under {root}: start again from model.mcore_path with "
            "checkpoint.resume=never (or a new trainer.output_dir)"
        )
    step = earlier[-1]
    return (
        f"{head}. The previous complete checkpoint is step {step} ({root / f'step_{step:07d}'}; complete: "
        f"{', '.join(map(str, earlier))}): to resume from it, move {path.name} away and write {step} into "
        f"{root / 'latest'}; or set checkpoint.resume=never to start from model.mcore_path"
    )


def check_resume_meta(root: Path) -> None:
    """The meta of the step `latest` names parses (it is read before anything else): a garbled one
    names the file and the previous complete step (a training checkpoint is not reconverted)."""
    path = latest_complete(root)
    if path is None:
        return
    try:
        json.loads((path / mcore_io.META_FILE).read_text())
    except (OSError, ValueError) as err:
        why = f"not valid JSON ({' '.join(str(err).split())[:80]})"
        raise CheckpointIntegrityError(
            _damage_message(path, "resume checkpoint", {mcore_io.META_FILE: why}, root, edits=False)
        ) from None


def verify_loadable(path: Path, field: str, root: Path | None = None, say: Callable[[str], None] | None = None) -> None:
    """Collective, before dist_checkpointing.load: raise CheckpointIntegrityError naming the bad
    file(s) (and, for a resume checkpoint under `root`, the previous complete step). What it
    verified goes to `say` (default: the log)."""
    say = say or get_logger(__name__).info
    rank, world = _rank_world()
    path = Path(path)
    structural = storage_problems(path) if rank == 0 else {}
    problems = {}
    try:
        sums = read_checksums(path)
    except (OSError, ValueError) as err:
        sums, problems = None, {CHECKSUM_FILE: f"unreadable ({err}); delete it to load unverified"}
    started = time.perf_counter()
    if sums:
        mine = _share({n: int(e.get("size", 0)) for n, e in sums.items()}, world)[rank]
        problems = checksum_problems(path, sums, mine)
    parts = _gather((problems, structural))
    found = {k: v for part, _ in parts for k, v in part.items()}
    found.update({k: v for _, part in parts for k, v in part.items()})  # the structural finding wins
    if found:
        raise CheckpointIntegrityError(_damage_message(path, field, found, root))
    if sums:
        size = sum(int(e.get("size", 0)) for e in sums.values())
        say(
            f"{field} {path}: {len(sums)} files ({size / 1e9:.3f} GB) match {CHECKSUM_FILE} "
            f"(verified in {time.perf_counter() - started:.1f}s over {world} rank(s))"
        )
    elif root is not None and sums is None:
        say(
            f"{field} {path} has no {CHECKSUM_FILE} (saved before checksums were recorded): "
            "loading it without verifying its contents"
        )


# ----------------------------------------------------------------------------- resume: same model


def _hf_config(ckpt_dir: Path) -> dict:
    return json.loads((Path(ckpt_dir) / mcore_io.HF_SUBDIR / "config.json").read_text())


def check_same_model(run_ckpt: Path, mcore_path: Path) -> str | None:
    """The run's checkpoint wins a resume. Another architecture in model.mcore_path is an error;
    the same architecture converted from another source a warning (returned); None if it matches."""
    from moe_sft.plan.shapes import shape_from_hf_dict

    run_meta, base_meta = mcore_io.read_meta(run_ckpt), mcore_io.read_meta(mcore_path)
    run_shape = shape_from_hf_dict(_hf_config(run_ckpt), name="run")
    base_shape = shape_from_hf_dict(_hf_config(mcore_path), name="run")
    base_of_run = run_meta.get("base_mcore_path") or run_meta.get("source", "?")
    if run_shape != base_shape:
        diffs = [
            f"{f}={getattr(run_shape, f)} vs {getattr(base_shape, f)}"
            for f in run_shape.__dataclass_fields__
            if getattr(run_shape, f) != getattr(base_shape, f)
        ]
        raise CheckpointIntegrityError(
            f"resume checkpoint {run_ckpt} holds another model than model.mcore_path={str(mcore_path)!r} "
            f"({', '.join(diffs[:6])}; run checkpoint vs model.mcore_path). The run was trained from "
            f"{base_of_run} (HF source {run_meta.get('source', '?')}). To train the new model, use a new "
            f"trainer.output_dir (or checkpoint.resume=never: it moves this run's checkpoints into "
            f"{run_ckpt.parent / 'earlier_run_<time>'}); to resume this run, point model.mcore_path back "
            f"at {base_of_run}"
        )
    if run_meta.get("source") == base_meta.get("source"):
        return None
    return (
        f"warning: resuming from this run's own checkpoint {run_ckpt} (trained from {base_of_run}, HF source "
        f"{run_meta.get('source', '?')}); model.mcore_path={str(mcore_path)!r} (HF source "
        f"{base_meta.get('source', '?')}) has the same architecture and is not used"
    )
