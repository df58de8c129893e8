#!/usr/bin/env bash
# Parallel layouts on the GPUs of one host (bf16): each layout trains the same 4-layer tiny
# Qwen3-MoE for 5 steps on the same global batch; the table compares loss and grad norm with
# the one-GPU run and reports tokens/s. Usage: bash benchmarks/gpu/layout_matrix.sh LOG_DIR NUM_GPUS
set -uo pipefail
log=${1:-gpu_logs}; gpus=${2:-2}
mkdir -p "$log"; work=/tmp/layout_matrix; rm -rf "$work"
export PYTHONUNBUFFERED=1 NCCL_NVLS_ENABLE=0
python3 -m moe_sft.quickstart_model --hf-path $work/hf --mcore-path $work/mcore \
  --tokenizer recipes/demo/tokenizer --num-layers 4 > "$log/create.log" 2>&1
run_one() {  # name nproc overrides...
  local name=$1 n=$2; shift 2
  torchrun --standalone --nproc_per_node=$n -m moe_sft.train --config-path recipes --config-name quickstart \
    trainer.max_steps=5 trainer.log_interval=1 trainer.global_batch_size=8 trainer.export_hf_at_end=false \
    checkpoint.save_interval=0 trainer.output_dir=$work/$name model.hf_path=$work/hf \
    model.mcore_path=$work/mcore model.create_tiny_if_missing=false data.pack_length=4096 \
    data.max_seq_len=1024 "$@" > "$log/$name.log" 2>&1
  echo "$name rc=$?"; echo "$n" > "$log/$name.gpus"
}
SP="parallel.sequence_parallel=true"
only=${LAYOUTS:-}  # space-separated subset to (re)run; the table covers every log in LOG_DIR
want() { [ -z "$only" ] || [[ " $only " == *" $1 "* ]]; }
run() {
  want "$1" || return 0
  run_one "$@"
}
run one 1
run dp2 2
run tp2_sp 2 parallel.tensor_model_parallel_size=2 $SP
run ep2 2 parallel.expert_model_parallel_size=2
run pp2 2 parallel.pipeline_model_parallel_size=2
run pp2_vpp2 2 parallel.pipeline_model_parallel_size=2 parallel.virtual_pipeline_model_parallel_size=2
run tp2_ep2_etp1 2 parallel.tensor_model_parallel_size=2 $SP parallel.expert_model_parallel_size=2 parallel.expert_tensor_parallel_size=1
# Options that must not change the math (same table): overlap + selective recompute, full
# recompute, fractional optimizer offload, offload between steps. (Activation offload needs TE.)
run opt_overlap_recompute 2 parallel.overlap_grad_reduce=true parallel.overlap_param_gather=true \
  model.recompute_granularity=selective "model.recompute_modules=[core_attn,moe,layernorm]"
run opt_full_recompute 1 model.recompute_granularity=full model.recompute_method=uniform model.recompute_num_layers=1
run opt_optimizer_offload_half 1 optimizer.optimizer_cpu_offload=true optimizer.optimizer_offload_fraction=0.5
run opt_offload_between_steps 1 trainer.offload_between_steps=true
CP="parallel.context_parallel_size=2"
run cp2 2 $CP
run cp2_ep2 2 $CP parallel.expert_model_parallel_size=2
if [ "$gpus" -ge 4 ]; then
  run tp2_pp2 4 parallel.tensor_model_parallel_size=2 $SP parallel.pipeline_model_parallel_size=2
  run ep4 4 parallel.expert_model_parallel_size=4
  run tp2_ep2_pp2_vpp2 4 parallel.tensor_model_parallel_size=2 $SP parallel.expert_model_parallel_size=2 \
    parallel.expert_tensor_parallel_size=1 parallel.pipeline_model_parallel_size=2 parallel.virtual_pipeline_model_parallel_size=2
  run tp2_etp2_ep2 4 parallel.tensor_model_parallel_size=2 $SP parallel.expert_model_parallel_size=2 parallel.expert_tensor_parallel_size=2
  run cp2_tp2 4 $CP parallel.tensor_model_parallel_size=2 $SP
  run cp2_pp2 4 $CP parallel.pipeline_model_parallel_size=2
  run cp4 4 parallel.context_parallel_size=4
fi
python3 - "$log" <<'PY'
import re, sys, statistics
from pathlib import Path
log = Path(sys.argv[1])
def metrics(name):
    out = {}
    for line in (log / f"{name}.log").read_text().splitlines():
        if m := re.match(r"^step (\d+)/\d+ (.*)$", line):
            out[int(m.group(1))] = {k: float(v) for k, v in (kv.split("=", 1) for kv in m.group(2).split())}
    return out
ref = metrics("one")
rows = ["| layout | GPUs | max rel loss diff | max rel grad-norm diff | tokens/s (steps 2-5, median) | GiB allocated while offloaded |", "|---|---|---|---|---|---|"]
for f in sorted(log.glob("*.log")):
    name = f.stem
    if name in ("create",) or not (m := metrics(name)) or set(m) != set(ref):
        if name != "create": rows.append(f"| {name} | | failed (see {name}.log) | | |")
        continue
    dl = max(abs(m[s]["loss"] - ref[s]["loss"]) / ref[s]["loss"] for s in ref)
    dg = max(abs(m[s]["grad_norm"] - ref[s]["grad_norm"]) / ref[s]["grad_norm"] for s in ref)
    tps = statistics.median(m[s]["tokens_per_s"] for s in ref if s > 1)
    gpus_file = log / f"{name}.gpus"
    n = gpus_file.read_text().strip() if gpus_file.exists() else "?"
    off = [m[s]["gpu_allocated_offloaded_gib"] for s in ref if "gpu_allocated_offloaded_gib" in m[s]]
    off = f"{max(off):.3f}" if off else ""
    rows.append(f"| {name} | {n} | {dl:.2e} | {dg:.2e} | {tps:,.0f} | {off} |")
(log / "layout_table.md").write_text("\n".join(rows) + "\n")
print("\n".join(rows))
PY
