"""The field's reference SFT loop: a plain `transformers` model trained by a plain torch loop.

It mirrors what `moe_sft`'s trainer does for one data-parallel rank, from the trainer's own
resolved `config.yaml`, but with nothing of megatron in the training path:

* data: the same train loader (`moe_sft.data.pipeline.build_pipeline` on the run's data section,
  pad_to as `Trainer._data` computes it for one rank);
  each DOCUMENT of each packed micro-batch (split at `cu_seqlens`) is its own causal sequence,
  one row of a right-padded batch (the same as one forward per document: see `as_padded_rows`),
  so attention never crosses documents;
* loss: Σ over the global batch of assistant-token CE / the global assistant-token count;
* optimizer: `torch.optim.AdamW` with megatron's param groups (weight decay off for 1-D params
  and biases: megatron-core 0.16 `get_standard_config_overrides`, `apply_wd_to_qk_layernorm` off),
  `clip_grad_norm_` (the same `max_norm / (norm + 1e-6)` coefficient as megatron's
  `clip_grad_by_total_norm_fp32`);
* LR: megatron's `OptimizerParamScheduler.get_lr` re-implemented below; the optimizer step of
  0-based step s runs with `get_lr(num_steps=s)` (the scheduler's constructor calls `step(0)` and
  the trainer calls `scheduler.step(1)` only after `optimizer.step()`), so with warmup the first
  step runs with lr = init_lr = 0 (Adam's moments and step count still advance).
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from pathlib import Path

import pytest
import torch
import torch.nn.functional as F

REPO = Path(__file__).resolve().parents[1]


def megatron_lr(
    num_steps: int, *, init_lr: float, max_lr: float, min_lr: float, warmup: int, decay_steps: int, style: str
) -> float:
    """megatron.core.optimizer_param_scheduler.OptimizerParamScheduler.get_lr (0.16.1), for
    the styles the schema allows (cosine | linear | constant)."""
    if warmup > 0 and num_steps <= warmup:
        return init_lr + (max_lr - init_lr) * float(num_steps) / float(warmup)
    if style == "constant":
        return max_lr
    if num_steps > decay_steps:
        return min_lr
    ratio = float(num_steps - warmup) / float(decay_steps - warmup)
    if style == "linear":
        coeff = 1.0 - ratio
    elif style == "cosine":
        coeff = 0.5 * (math.cos(math.pi * ratio) + 1.0)
    else:
        raise ValueError(f"lr_decay_style={style!r}")
    return min_lr + coeff * (max_lr - min_lr)


def trainer_lr_schedule(cfg: dict, shift: int = 0) -> list[float]:
    """The lr each optimizer step of the run uses, as `Trainer._optimizer` builds the scheduler.

    `shift=1` is the plausible off-by-one (step s using the lr of s + 1); only for negative
    controls.
    """
    o, steps = cfg["optimizer"], cfg["trainer"]["max_steps"]
    warmup = o["lr_warmup_steps"]
    kwargs = dict(
        init_lr=0.0 if warmup else o["lr"],
        max_lr=o["lr"],
        min_lr=o["min_lr"],
        warmup=warmup,
        decay_steps=max(steps, warmup + 1),
        style=o["lr_decay_style"],
    )
    return [megatron_lr(s + shift, **kwargs) for s in range(steps)]


def trainer_plan(cfg: dict):
    """The train loader and tokenizer `Trainer._data` builds for a one-rank run of `cfg` (the same
    cache, packing and order: moe_sft.data.pipeline.build_pipeline with the run's data section)."""
    from transformers import AutoTokenizer

    from moe_sft.config.schema import DataConfig
    from moe_sft.data.pipeline import build_pipeline

    d, p = cfg["data"], cfg["parallel"]
    assert p["tensor_model_parallel_size"] == p["pipeline_model_parallel_size"] == 1, p
    assert p["expert_model_parallel_size"] == p["context_parallel_size"] == 1, p

    def in_repo(path):  # the trainer runs with cwd = the repo
        return None if path is None else str(REPO / path)

    tokenizer_path = in_repo(d["tokenizer_path"]) or str(Path(cfg["model"]["mcore_path"]) / "hf")
    tokenizer = AutoTokenizer.from_pretrained(tokenizer_path)
    data = DataConfig(
        **{
            **d,
            "train_files": [in_repo(f) for f in d["train_files"]],
            "eval_files": [in_repo(f) for f in d["eval_files"]],
            "cache_dir": in_repo(d["cache_dir"]),
            "chat_template": in_repo(d["chat_template"]),
        }
    )
    pipeline = build_pipeline(
        data,
        tokenizer_path=tokenizer_path,
        global_batch_size=cfg["trainer"]["global_batch_size"],
        pad_to=1,
        pad_token_id=tokenizer.pad_token_id or 0,
        log=lambda message: None,
    )
    return pipeline.train, tokenizer


def documents(mb):
    """(tokens, labels, loss_mask) of each segment of a packed micro-batch that has loss tokens
    (a segment without any — e.g. trailing padding — adds nothing to the loss or the gradients)."""
    cu = mb.cu_seqlens.tolist()
    for start, end in zip(cu[:-1], cu[1:]):
        mask = mb.loss_mask[start:end]
        if mask.any():
            yield mb.tokens[start:end], mb.labels[start:end], mask


def megatron_param_groups(model, weight_decay: float, decay_all: bool = False) -> list[dict]:
    """megatron's default weight-decay rule: wd_mult 0 for 1-D params and biases.

    `decay_all=True` decays every parameter (the naive AdamW setup); only for negative controls.
    """
    decay, no_decay = [], []
    for name, param in model.named_parameters():
        if param.requires_grad:
            skip = (param.ndim == 1 or name.endswith(".bias")) and not decay_all
            (no_decay if skip else decay).append(param)
    return [{"params": decay, "weight_decay": weight_decay}, {"params": no_decay, "weight_decay": 0.0}]


def as_padded_rows(rows, pad_id: int):
    """Documents as the rows of one right-padded batch.

    Equivalent to one forward per document: attention is causal, so a row's real tokens never
    see its trailing padding, and MoE routing is per token (dropless, no aux loss here), so
    padding tokens change no real token's output. Padded positions have mask 0.
    """
    width = max(len(t) for t, _, _ in rows)
    tokens = torch.full((len(rows), width), pad_id, dtype=torch.long)
    labels = torch.zeros((len(rows), width), dtype=torch.long)
    mask = torch.zeros((len(rows), width), dtype=torch.float32)
    for i, (t, lab, m) in enumerate(rows):
        tokens[i, : len(t)], labels[i, : len(t)], mask[i, : len(t)] = t, lab, m
    return tokens, labels, mask


@dataclass
class StepResult:
    loss: float
    grad_norm: float
    lr: float
    loss_tokens: int


def load_hf_model(hf_path):
    """The HF checkpoint in fp32, training mode, router aux loss off (megatron's differs)."""
    from transformers import AutoModelForCausalLM

    from moe_sft.runtime import cpu_compat

    with cpu_compat.suspended():  # a no-op unless megatron's CPU patches are active in this process
        model = AutoModelForCausalLM.from_pretrained(str(hf_path), dtype=torch.float32)
    model.config.output_router_logits = False
    model.config.use_cache = False
    return model.train()


def train_reference(
    hf_path, cfg: dict, steps: int | None = None, plan=None, *, lr_shift: int = 0, decay_all: bool = False
) -> list[StepResult]:
    """Train the HF model at `hf_path` for `steps` steps of `cfg` (the trainer's resolved
    config.yaml as a dict); per step: the loss before the update, the pre-clip global grad L2
    norm, and the lr the update used. `lr_shift` / `decay_all`: see `trainer_lr_schedule` /
    `megatron_param_groups` (negative controls only)."""
    from moe_sft.runtime import cpu_compat

    o = cfg["optimizer"]
    steps = cfg["trainer"]["max_steps"] if steps is None else steps
    if plan is None:
        plan, _ = trainer_plan(cfg)
    lrs = trainer_lr_schedule(cfg, shift=lr_shift)
    model = load_hf_model(hf_path)
    params = [p for p in model.parameters() if p.requires_grad]
    optimizer = torch.optim.AdamW(
        megatron_param_groups(model, o["weight_decay"], decay_all),
        lr=0.0,
        betas=(o["adam_beta1"], o["adam_beta2"]),
        eps=o["adam_eps"],
    )
    results = []
    threads = torch.get_num_threads()
    torch.set_num_threads(1)  # a 1M-parameter model: one thread is as fast, and immune to oversubscription
    try:
        with cpu_compat.suspended():  # a no-op unless megatron's CPU patches are active in this process
            for step in range(steps):
                batches, global_tokens = plan.batches_for_step(step, 0, 1)
                optimizer.zero_grad(set_to_none=True)
                tokens, labels, mask = as_padded_rows(
                    [doc for mb in batches for doc in documents(mb)], plan.pad_token_id
                )
                logits = model(input_ids=tokens, use_cache=False, output_router_logits=False).logits
                keep = mask.bool()  # assistant-token positions only (row padding never enters the loss)
                total = F.cross_entropy(logits[keep].float(), labels[keep], reduction="sum")
                (total / global_tokens).backward()
                assert int(keep.sum()) == global_tokens, (int(keep.sum()), global_tokens)
                if o["clip_grad"] > 0:  # returns the pre-clip norm; coefficient max_norm / (norm + 1e-6)
                    grad_norm = float(torch.nn.utils.clip_grad_norm_(params, o["clip_grad"]))
                else:
                    grad_norm = float(torch.nn.utils.get_total_norm([p.grad for p in params if p.grad is not None]))
                for group in optimizer.param_groups:
                    group["lr"] = lrs[step]
                optimizer.step()
                results.append(StepResult(total.item() / global_tokens, grad_norm, lrs[step], global_tokens))
    finally:
        torch.set_num_threads(threads)
    return results


def rel(a: float, b: float) -> float:
    return abs(a - b) / abs(b)


def assert_curves_match(
    ours: dict, tb: dict, ref: list, lrs: list[float], label: str, printed_rel: float, tb_rel: float, gn_tb_rel: float
) -> dict:
    """Per step: the reference's lr is the trainer's schedule, the same assistant-token count
    normalises both losses (identical global batches), and the loss and pre-clip grad norm agree:
    printed values (4 significant digits) within `printed_rel`, float32 TensorBoard values within
    `tb_rel` (loss) and `gn_tb_rel` (grad norm). Prints the table; returns the worst differences."""
    print(
        f"{'step':>4} {'lr':>10} {'ours loss':>10} {'HF loss':>10} {'rel(tb)':>8} {'ours gn':>10} {'HF gn':>10} {'rel(tb)':>8}"
    )
    worst = dict(loss=0.0, loss_tb=0.0, gn=0.0, gn_tb=0.0)
    for step, (r, lr) in enumerate(zip(ref, lrs), start=1):
        o = ours[step]
        assert r.lr == pytest.approx(lr), (step, r.lr, lr)
        assert o["loss_tokens"] == r.loss_tokens == tb["train/loss_tokens"][step], step
        d = dict(
            loss=rel(o["loss"], r.loss),
            loss_tb=rel(tb["train/loss"][step], r.loss),
            gn=rel(o["grad_norm"], r.grad_norm),
            gn_tb=rel(tb["train/grad_norm"][step], r.grad_norm),
        )
        worst = {k: max(worst[k], v) for k, v in d.items()}
        print(
            f"{step:>4} {r.lr:>10.4g} {o['loss']:>10.4g} {r.loss:>10.6g} {d['loss_tb']:>8.1e} "
            f"{o['grad_norm']:>10.4g} {r.grad_norm:>10.6g} {d['gn_tb']:>8.1e}"
        )
    print(
        f"[{label}] max rel diff: loss {worst['loss']:.1e} (printed) {worst['loss_tb']:.1e} (tensorboard); "
        f"grad norm {worst['gn']:.1e} (printed) {worst['gn_tb']:.1e} (tensorboard)"
    )
    for key, bound in (("loss", printed_rel), ("gn", printed_rel), ("loss_tb", tb_rel), ("gn_tb", gn_tb_rel)):
        assert worst[key] <= bound, (label, key, worst[key], bound)
    return worst


def tensorboard_scalars(run: Path) -> dict[str, dict[int, float]]:
    """Every scalar the trainer wrote to run/tensorboard: tag -> {step: value} (float32)."""
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    acc = EventAccumulator(str(run / "tensorboard"))
    acc.Reload()
    return {tag: {e.step: e.value for e in acc.Scalars(tag)} for tag in acc.Tags()["scalars"]}
