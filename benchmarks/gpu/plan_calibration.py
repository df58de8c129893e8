"""Planner calibration: predicted vs measured peak GPU memory per pipeline stage, on 1-4 GPUs.

    python benchmarks/gpu/plan_calibration.py [--out DIR] [--only NAME,...] [--timeout 600] [--dry-run]

For each layout that fits the GPUs present, it trains a few steps of a reduced stack with the real
trainer (`torchrun -m moe_sft.train`, bf16, torch-native spec) and reads each rank's
torch.cuda.max_memory_allocated / max_memory_reserved (the trainer prints them after the last
step), runs the planner (`moe_sft.plan.make_plan`) for the same config, and writes a markdown table
of predicted vs measured per stage to DIR/calibration.md (DIR: --out, else $OUT, else
./plan_calibration). Models (synthetic weights, written without materialising them):
  qwen30b_4l   Qwen3-30B-A3B shapes (hidden 2048, 128 experts top-8 x 768, vocab 151936), 4 layers
  mixtral_2l   Mixtral-8x7B shapes (hidden 4096, 8 experts top-2 x 14336, vocab 32000), 2 layers
  dsv3_mini    DeepSeek-V3 MLA (q_lora 1536, kv_lora 512, 128+64 / 128 head dims), 32 experts top-8,
               1 dense + 3 MoE layers + 1 MTP layer, vocab 129280, hidden 2048
  qwen30b_shard, mixtral8x7b_shard, qwen235b_shard, mixtral8x22b_shard, dsv3_shard
               the five recipes' per-GPU shard shapes (Qwen3-30B-A3B, Mixtral-8x7B, Qwen3-235B-A22B,
               Mixtral-8x22B, DeepSeek-V3): the recipe's config.json with 2 layers and experts cut
               so that EP2 leaves each GPU the recipe's local experts and routed rows per token
               (layouts recipe_*, 2 GPUs)
Each layout runs in its own process group with a timeout; results are kept per layout (JSON), so
several invocations (--only ...) fill one table. Nothing is measured on CPU: --dry-run lists the
layouts, the commands and the planner's prediction only.
"""

from __future__ import annotations

import argparse
import json
import os
import re
import shutil
import signal
import statistics
import subprocess
import sys
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]
if str(REPO) not in sys.path:
    sys.path.insert(0, str(REPO))

PEAK_LINE = re.compile(r"peak memory per rank \(GiB allocated/reserved\): (.*)$")
STEP_LINE = re.compile(r"^step (\d+)/\d+ (.*)$")


def recipe_shard(recipe_model: str, **fewer) -> dict:
    """recipes/models/<recipe_model>/config.json (hidden, heads, expert FFN, MLA ranks, rope, router
    settings as the recipe trains them) with fewer layers and experts."""
    config = json.loads((REPO / "recipes" / "models" / recipe_model / "config.json").read_text())
    not_shape = (
        "architectures",
        "auto_map",
        "model_type",
        "quantization_config",
        "torch_dtype",
        "transformers_version",
    )
    return {k: v for k, v in config.items() if k not in not_shape} | fewer


MODELS = {
    "qwen30b_4l": (
        "qwen3_moe",
        dict(
            vocab_size=151936,
            hidden_size=2048,
            intermediate_size=6144,
            moe_intermediate_size=768,
            num_hidden_layers=4,
            num_attention_heads=32,
            num_key_value_heads=4,
            head_dim=128,
            num_experts=128,
            num_experts_per_tok=8,
            max_position_embeddings=40960,
            router_aux_loss_coef=0.001,
        ),
    ),
    "mixtral_2l": (
        "mixtral",
        dict(
            vocab_size=32000,
            hidden_size=4096,
            intermediate_size=14336,
            num_hidden_layers=2,
            num_attention_heads=32,
            num_key_value_heads=8,
            head_dim=128,
            num_local_experts=8,
            num_experts_per_tok=2,
            max_position_embeddings=32768,
        ),
    ),
    "dsv3_mini": (
        "deepseek_v3",
        dict(
            vocab_size=129280,
            hidden_size=2048,
            intermediate_size=5632,
            moe_intermediate_size=1024,
            num_hidden_layers=4,
            num_attention_heads=16,
            num_key_value_heads=16,
            n_routed_experts=32,
            n_shared_experts=1,
            num_experts_per_tok=8,
            n_group=8,
            topk_group=4,
            first_k_dense_replace=1,
            q_lora_rank=1536,
            kv_lora_rank=512,
            qk_rope_head_dim=64,
            qk_nope_head_dim=128,
            v_head_dim=128,
            num_nextn_predict_layers=1,
            max_position_embeddings=16384,
        ),
    ),
    # Per-recipe shard shapes (issue 8): the recipe's model with 2 layers and fewer experts, so that
    # EP2 gives each GPU the recipe's local experts. Balanced routing sends every GPU top_k rows per
    # local token whatever the EP size, so the routed activations match the recipe's too.
    # Qwen3-235B, recipe EP32: 128 experts = 4 local experts.
    "qwen235b_shard": ("qwen3_moe", recipe_shard("qwen3_235b_a22b", num_hidden_layers=2, num_experts=8)),
    # Mixtral-8x22B, recipe EP8: 8 experts = 1 local expert.
    "mixtral8x22b_shard": ("mixtral", recipe_shard("mixtral_8x22b", num_hidden_layers=2, num_local_experts=2)),
    # Qwen3-30B-A3B, recipe EP8: 128 experts = 16 local experts.
    "qwen30b_shard": ("qwen3_moe", recipe_shard("qwen3_30b_a3b", num_hidden_layers=2, num_experts=32)),
    # Mixtral-8x7B, recipe EP8: 8 experts = 1 local expert.
    "mixtral8x7b_shard": ("mixtral", recipe_shard("mixtral_8x7b", num_hidden_layers=2, num_local_experts=2)),
    # DeepSeek-V3, recipe EP32: 256 experts = 8 local experts (8 groups of 2, top-4 groups); 1 dense +
    # 1 MoE layer + MTP.
    "dsv3_shard": (
        "deepseek_v3",
        recipe_shard("deepseek_v3", num_hidden_layers=2, first_k_dense_replace=1, n_routed_experts=16),
    ),
}

SP = "parallel.sequence_parallel=true"
FULL = ["model.recompute_granularity=full", "model.recompute_method=uniform", "model.recompute_num_layers=1"]
# name: (model, GPUs, overrides). Global batch 8 micro-batches unless set.
LAYOUTS = {
    "qwen_1gpu": ("qwen30b_4l", 1, ["data.pack_length=4096"]),
    "qwen_1gpu_16k": ("qwen30b_4l", 1, ["data.pack_length=16384", "trainer.global_batch_size=4"]),
    "qwen_1gpu_full8k": ("qwen30b_4l", 1, ["data.pack_length=8192"] + FULL),
    "qwen_1gpu_selective": ("qwen30b_4l", 1, ["data.pack_length=4096", "model.recompute_granularity=selective"]),
    "qwen_1gpu_offload": (
        "qwen30b_4l",
        1,
        ["data.pack_length=4096", "optimizer.optimizer_cpu_offload=true", "optimizer.optimizer_offload_fraction=1.0"],
    ),
    "qwen_ep2": ("qwen30b_4l", 2, ["data.pack_length=4096", "parallel.expert_model_parallel_size=2"]),
    "qwen_pp2": ("qwen30b_4l", 2, ["data.pack_length=4096", "parallel.pipeline_model_parallel_size=2"]),
    "qwen_tp2_ep2": (
        "qwen30b_4l",
        2,
        [
            "data.pack_length=4096",
            "parallel.tensor_model_parallel_size=2",
            SP,
            "parallel.expert_model_parallel_size=2",
            "parallel.expert_tensor_parallel_size=1",
        ],
    ),
    "qwen_ep4": ("qwen30b_4l", 4, ["data.pack_length=8192", "parallel.expert_model_parallel_size=4"] + FULL),
    "qwen_pp2_vpp2_ep2": (
        "qwen30b_4l",
        4,
        [
            "data.pack_length=4096",
            "parallel.pipeline_model_parallel_size=2",
            "parallel.virtual_pipeline_model_parallel_size=2",
            "parallel.expert_model_parallel_size=2",
        ],
    ),
    "mixtral_1gpu": ("mixtral_2l", 1, ["data.pack_length=4096"]),
    "mixtral_1gpu_32k": ("mixtral_2l", 1, ["data.pack_length=32768", "trainer.global_batch_size=2"]),
    "mixtral_ep2_full": ("mixtral_2l", 2, ["data.pack_length=8192", "parallel.expert_model_parallel_size=2"] + FULL),
    "mixtral_tp2_ep2": (
        "mixtral_2l",
        4,
        [
            "data.pack_length=4096",
            "parallel.tensor_model_parallel_size=2",
            SP,
            "parallel.expert_model_parallel_size=2",
            "parallel.expert_tensor_parallel_size=1",
        ],
    ),
    "dsv3_1gpu": ("dsv3_mini", 1, ["data.pack_length=4096"]),
    "dsv3_1gpu_16k": ("dsv3_mini", 1, ["data.pack_length=16384", "trainer.global_batch_size=4"]),
    "dsv3_pp2_ep2": (
        "dsv3_mini",
        4,
        ["data.pack_length=4096", "parallel.pipeline_model_parallel_size=2", "parallel.expert_model_parallel_size=2"],
    ),
    # the recipes' per-GPU shard shapes with their pack length and recompute (recipes/*.yaml)
    "recipe_qwen3_235b": (
        "qwen235b_shard",
        2,
        ["data.pack_length=8192", "parallel.expert_model_parallel_size=2"] + FULL,
    ),
    "recipe_mixtral_8x22b": (
        "mixtral8x22b_shard",
        2,
        ["data.pack_length=8192", "parallel.expert_model_parallel_size=2"] + FULL,
    ),
    "recipe_qwen3_30b": ("qwen30b_shard", 2, ["data.pack_length=8192", "parallel.expert_model_parallel_size=2"] + FULL),
    "recipe_mixtral_8x7b": (
        "mixtral8x7b_shard",
        2,
        ["data.pack_length=8192", "parallel.expert_model_parallel_size=2"] + FULL,
    ),
    "recipe_deepseek_v3": ("dsv3_shard", 2, ["data.pack_length=4096", "parallel.expert_model_parallel_size=2"] + FULL),
}
# the recipe (recipes/<name>.yaml) whose per-GPU shard each recipe_* layout reproduces
RECIPE_OF_LAYOUT = {
    "recipe_qwen3_30b": "qwen3_30b_a3b",
    "recipe_mixtral_8x7b": "mixtral_8x7b",
    "recipe_qwen3_235b": "qwen3_235b_a22b",
    "recipe_mixtral_8x22b": "mixtral_8x22b",
    "recipe_deepseek_v3": "deepseek_v3",
}


# ----------------------------------------------------------------------------- pure helpers (CPU-tested)


def parse_peaks(log: str) -> list[tuple[float, float]]:
    """[(allocated GiB, reserved GiB) per rank] from the trainer's last 'peak memory per rank' line."""
    found = [m.group(1) for line in log.splitlines() if (m := PEAK_LINE.search(line))]
    if not found:
        return []
    out = []
    for item in found[-1].split():
        rank, values = item.split(":", 1)
        alloc, reserved = values.split("/")
        out.append((float(alloc), float(reserved)))
    return out


def parse_steps(log: str) -> dict[int, dict[str, float]]:
    steps = {}
    for line in log.splitlines():
        if m := STEP_LINE.match(line.strip()):
            steps[int(m.group(1))] = {k: float(v) for k, v in (kv.split("=", 1) for kv in m.group(2).split())}
    return steps


def stage_peaks(peaks: list[tuple[float, float]], stage_of_rank: list[int]) -> dict[int, tuple[float, float]]:
    """Max over the ranks of each pipeline stage."""
    out: dict[int, tuple[float, float]] = {}
    for (alloc, reserved), stage in zip(peaks, stage_of_rank):
        a, r = out.get(stage, (0.0, 0.0))
        out[stage] = (max(a, alloc), max(r, reserved))
    return out


def markdown(results: list[dict], gpu_name: str) -> str:
    head = (
        "| layout | GPUs | stage | predicted allocated GiB | measured max allocated GiB | error | "
        "measured reserved GiB | predicted reserved GiB (x fragmentation) | prediction: weights / grads / optim / "
        "activ / work / logits | tokens/s (median, steps >= 2) |"
    )
    rows = [
        f"Planner calibration on {gpu_name} (bf16, torch-native spec; `python benchmarks/gpu/plan_calibration.py`).",
        "Error = predicted / measured - 1 on torch.cuda.max_memory_allocated (target: within 10%).",
        "",
        head,
        "|" + "---|" * 10,
    ]
    errors = []
    for res in results:
        if res.get("status") != "ok":
            rows.append(f"| {res['name']} | {res.get('gpus', '')} | | | {res.get('status')} | | | | | |")
            continue
        for st in res["stages"]:
            err = st["predicted_gib"] / st["measured_gib"] - 1 if st["measured_gib"] else float("nan")
            errors.append(abs(err))
            parts = " / ".join(
                f"{st['breakdown'][k]:.1f}"
                for k in ("weights", "grads", "optimizer", "activations", "working", "logits")
            )
            rows.append(
                f"| {res['name']} | {res['gpus']} | {st['stage']} | {st['predicted_gib']:.2f} | "
                f"{st['measured_gib']:.2f} | {err:+.1%} | {st['reserved_gib']:.2f} | "
                f"{st['predicted_gib'] * (1 + st.get('fragmentation', 0.10)):.2f} | {parts} | {res.get('tokens_per_s', 0):,.0f} |"
            )
    if errors:
        rows += [
            "",
            f"Stages within 10%: {sum(e <= 0.10 for e in errors)}/{len(errors)}; "
            f"max |error| {max(errors):.1%}; median {statistics.median(errors):.1%}.",
        ]
    return "\n".join(rows) + "\n"


# ----------------------------------------------------------------------------- model and plan


def hf_config(model: str):
    from moe_sft.models import registry

    family_name, kwargs = MODELS[model]
    family = registry.family_by_name(family_name)
    return family, family.tiny_hf_config(**kwargs)


def train_argv(name: str, work: Path, steps: int) -> list[str]:
    model, gpus, overrides = LAYOUTS[name]
    return [
        "--config-path",
        str(REPO / "recipes"),
        "--config-name",
        "quickstart",
        f"model.hf_path={work / model / 'hf'}",
        f"model.mcore_path={work / model / 'mcore'}",
        "model.create_tiny_if_missing=false",
        "model.backend=torch",
        f"model.hf_config={work / model / 'config.json'}",
        f"data.tokenizer_path={REPO / 'recipes/demo/tokenizer'}",
        f"data.train_files=[{REPO / 'recipes/demo/data/train.jsonl'}]",
        "data.max_seq_len=256",
        f"trainer.output_dir={work / 'runs' / name}",
        f"trainer.max_steps={steps}",
        "trainer.log_interval=1",
        "trainer.global_batch_size=8",
        "trainer.export_hf_at_end=false",
        "checkpoint.resume=never",
        "trainer.precision=bf16",
        *overrides,
    ]


def predict(name: str, work: Path, steps: int, gpu_kind: str) -> dict:
    """The planner's per-stage prediction and each rank's stage, for layout `name`."""
    from moe_sft.config import load_config
    from moe_sft.plan import make_plan
    from moe_sft.plan.layout import rank_coords
    from moe_sft.plan.memory import GIB

    _, gpus, _ = LAYOUTS[name]
    cfg = load_config(train_argv(name, work, steps) + [f"hardware.gpu={gpu_kind}"])
    plan = make_plan(cfg, gpus=gpus)
    env_checks = ("[data_files]", "[model_paths]", "[checkpoint]")
    errors = [e for e in plan.errors if not e.startswith(env_checks)]
    stages = {
        st.pp_rank: dict(
            predicted_gib=st.allocated / GIB,
            fragmentation=st.fragmentation,
            breakdown=dict(
                weights=st.weights / GIB,
                grads=st.grads / GIB,
                optimizer=st.optimizer / GIB,
                activations=st.activations / GIB,
                working=st.working / GIB,
                logits=st.logits / GIB,
            ),
        )
        for st in plan.stages
    }
    return dict(
        errors=errors,
        stages=stages,
        layout=plan.layout.short(),
        stage_of_rank=[rank_coords(r, plan.layout)["pp"] for r in range(gpus)],
    )


def make_checkpoint(model: str, work: Path) -> None:
    """Synthetic HF checkpoint (bounded memory), converted, HF copy deleted. Runs in a child process
    without GPUs (conversion builds a meta model under a process group of one)."""
    from moe_sft.conversion.convert import convert
    from moe_sft.conversion.synthetic import write_synthetic_checkpoint

    base = work / model
    family, cfg = hf_config(model)
    shutil.rmtree(base / "hf", ignore_errors=True)
    write_synthetic_checkpoint(base / "hf", cfg, family)
    for f in (REPO / "recipes/demo/tokenizer").iterdir():
        shutil.copy2(f, base / "hf" / f.name)
    convert(base / "hf", base / "mcore", workers=min(8, os.cpu_count() or 1))
    shutil.rmtree(base / "hf", ignore_errors=True)


def ensure_checkpoint(model: str, work: Path, log) -> None:
    base = work / model
    base.mkdir(parents=True, exist_ok=True)
    hf_config(model)[1].to_json_file(str(base / "config.json"))
    if (base / "mcore" / "moe_sft_meta.json").is_file():
        return
    started = time.time()
    env = dict(os.environ, CUDA_VISIBLE_DEVICES="", PYTHONUNBUFFERED="1")
    subprocess.run(
        [sys.executable, __file__, "--make-checkpoint", model, "--work", str(work)], cwd=REPO, env=env, check=True
    )
    log(f"{model}: synthetic checkpoint written and converted in {time.time() - started:.0f}s")


def gpu_inventory() -> tuple[int, str, float]:
    """(count, name, GiB) from nvidia-smi, so this parent process never creates a CUDA context."""
    try:
        out = (
            subprocess.run(
                ["nvidia-smi", "--query-gpu=name,memory.total", "--format=csv,noheader,nounits"],
                capture_output=True,
                text=True,
                timeout=60,
            )
            .stdout.strip()
            .splitlines()
        )
    except (OSError, subprocess.TimeoutExpired):
        out = []
    visible = os.environ.get("CUDA_VISIBLE_DEVICES")
    if visible is not None and visible.strip() != "":
        out = [out[int(i)] for i in visible.split(",") if i.strip().isdigit() and int(i) < len(out)]
    elif visible is not None:
        out = []
    if not out:
        return 0, "no GPU", 0.0
    name, mib = out[0].rsplit(",", 1)
    return len(out), name.strip(), float(mib) / 1024


# ----------------------------------------------------------------------------- run


def wait_for_free_gpus(log, limit_s: float = 20.0) -> None:
    """Wait until no process holds GPU memory; then kill what is left. A layout's processes can
    outlive the SIGTERM of its launcher (a checkpoint writer, a worker mid-save): the next layout
    then ran out of memory next to them (100 GiB still held on the first H200 run)."""

    def holders() -> list[int]:
        try:
            out = subprocess.run(
                ["nvidia-smi", "--query-compute-apps=pid", "--format=csv,noheader"],
                capture_output=True,
                text=True,
                timeout=60,
            ).stdout
        except (OSError, subprocess.TimeoutExpired):
            return []
        return [int(p) for p in out.split() if p.strip().isdigit()]

    deadline = time.time() + limit_s
    while (pids := holders()) and time.time() < deadline:
        time.sleep(2)
    for pid in pids:
        log(f"killing process {pid}, still holding GPU memory {limit_s:.0f}s after its layout ended")
        try:
            os.kill(pid, signal.SIGKILL)
        except OSError:
            pass
    while holders() and time.time() < deadline + 30:
        time.sleep(1)


def run_layout(name: str, work: Path, out: Path, steps: int, timeout: int, gpu_kind: str, log) -> dict:
    model, gpus, _ = LAYOUTS[name]
    result = dict(name=name, gpus=gpus, model=model)
    ensure_checkpoint(model, work, log)
    pred = predict(name, work, steps, gpu_kind)
    if pred["errors"]:
        return dict(result, status="planner rejected: " + "; ".join(pred["errors"]))
    shutil.rmtree(work / "runs" / name, ignore_errors=True)
    cmd = [
        sys.executable,
        "-m",
        "torch.distributed.run",
        "--standalone",
        f"--nproc_per_node={gpus}",
        "-m",
        "moe_sft.train",
        *train_argv(name, work, steps),
    ]
    env = {
        k: v
        for k, v in os.environ.items()
        if k not in ("RANK", "WORLD_SIZE", "LOCAL_RANK", "MASTER_ADDR", "MASTER_PORT")
    }
    env.update(PYTHONUNBUFFERED="1", NCCL_NVLS_ENABLE="0")
    log_path = out / f"{name}.log"
    status, started = "timeout", time.time()
    with open(log_path, "w") as fh:
        proc = subprocess.Popen(cmd, cwd=REPO, env=env, stdout=fh, stderr=subprocess.STDOUT, start_new_session=True)
        while time.time() - started < timeout:
            if proc.poll() is not None:
                status = "ok" if proc.returncode == 0 else f"failed (rc {proc.returncode}, see {log_path.name})"
                break
            if parse_peaks(log_path.read_text(errors="replace")):
                status = "ok"  # measured: the final checkpoint save that follows is not needed
                break
            time.sleep(2)
        if status == "timeout" and parse_peaks(log_path.read_text(errors="replace")):
            status = "ok"  # the peak line came in the last poll interval
        if proc.poll() is None:
            # SIGTERM is the trainer's pre-emption signal: it would save a checkpoint first, which
            # a calibration run does not need, and hold the GPUs meanwhile.
            os.killpg(proc.pid, signal.SIGKILL if status == "ok" else signal.SIGTERM)
            try:
                proc.wait(30)
            except subprocess.TimeoutExpired:
                os.killpg(proc.pid, signal.SIGKILL)
                proc.wait()
    wait_for_free_gpus(log)
    shutil.rmtree(work / "runs" / name, ignore_errors=True)  # the partial final save
    text = log_path.read_text(errors="replace")
    peaks = parse_peaks(text)
    if status == "ok" and not peaks:
        status = f"no peak-memory line in {log_path.name}"
    if status != "ok":
        return dict(result, status=status)
    measured = stage_peaks(peaks, pred["stage_of_rank"])
    steps_seen = parse_steps(text)
    tps = [m["tokens_per_s"] for s, m in steps_seen.items() if s >= 2 and "tokens_per_s" in m]
    stages = [
        dict(stage=s, measured_gib=measured[s][0], reserved_gib=measured[s][1], **pred["stages"][s])
        for s in sorted(measured)
    ]
    return dict(
        result,
        status="ok",
        layout=pred["layout"],
        stages=stages,
        seconds=time.time() - started,
        tokens_per_s=statistics.median(tps) if tps else 0.0,
        peaks_per_rank=peaks,
    )


def main(argv: list[str]) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--out", type=Path, default=Path(os.environ.get("OUT") or "plan_calibration"))
    parser.add_argument(
        "--work", type=Path, default=Path(os.environ.get("TMPDIR", "/tmp")) / "moe_sft_plan_calibration"
    )
    parser.add_argument("--only", default="", help="comma-separated layout names (default: all that fit)")
    parser.add_argument("--timeout", type=int, default=600, help="seconds per layout")
    parser.add_argument("--steps", type=int, default=4)
    parser.add_argument("--gpus", type=int, help="GPUs to use (default: all visible)")
    parser.add_argument("--dry-run", action="store_true", help="list layouts, commands and predictions; run nothing")
    parser.add_argument("--make-checkpoint", help=argparse.SUPPRESS)  # internal: the child that converts
    args = parser.parse_args(argv)
    if args.make_checkpoint:
        make_checkpoint(args.make_checkpoint, args.work)
        return 0
    args.out.mkdir(parents=True, exist_ok=True)
    log = lambda msg: print(f"[calibration] {msg}", flush=True)  # noqa: E731
    count, gpu_name, gib = gpu_inventory()
    have = args.gpus or count
    gpu_kind = "h100_80gb" if 0 < gib < 100 else "h200_141gb"
    names = [n for n in (args.only.split(",") if args.only else LAYOUTS) if n]
    unknown = [n for n in names if n not in LAYOUTS]
    if unknown:
        print(f"unknown layouts {unknown}; known: {', '.join(LAYOUTS)}", file=sys.stderr)
        return 2
    if args.dry_run:
        for name in names:
            model, gpus, _ = LAYOUTS[name]
            base = args.work / model
            base.mkdir(parents=True, exist_ok=True)
            hf_config(model)[1].to_json_file(str(base / "config.json"))
            pred = predict(name, args.work, args.steps, gpu_kind)
            total = " ".join(f"{s}:{v['predicted_gib']:.2f}" for s, v in pred["stages"].items())
            log(
                f"{name}: {gpus} GPU(s), {pred['layout']}, predicted GiB per stage {total or '-'} "
                f"{'ERRORS ' + str(pred['errors']) if pred['errors'] else ''}"
            )
        return 0
    if not have:
        print("no GPU visible (nvidia-smi): nothing to measure (use --dry-run on CPU)", file=sys.stderr)
        return 2
    for name in names:
        model, gpus, _ = LAYOUTS[name]
        if gpus > have:
            log(f"{name}: skipped, needs {gpus} GPUs ({have} visible)")
            continue
        log(f"{name}: running on {gpus} GPU(s), timeout {args.timeout}s")
        try:
            res = run_layout(name, args.work, args.out, args.steps, args.timeout, gpu_kind, log)
        except Exception as err:  # one broken layout must not lose the others' results
            res = dict(name=name, gpus=gpus, model=model, status=f"error: {type(err).__name__}: {err}")
        (args.out / f"{name}.json").write_text(json.dumps(res, indent=1))
        log(f"{name}: {res['status']}")
        write_table(args.out, gpu_name)  # after every layout: a killed session keeps its rows
    print(write_table(args.out, gpu_name))
    return 0


def write_table(out: Path, gpu_name: str) -> str:
    results = [json.loads(p.read_text()) for p in sorted(out.glob("*.json"))]
    table = markdown([r for r in results if r.get("name") in LAYOUTS], gpu_name)
    (out / "calibration.md").write_text(table)
    return table


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
