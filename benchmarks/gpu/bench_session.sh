#!/usr/bin/env bash
# Throughput benchmark session (issue 7; method and results: docs/benchmarks.md). Usage:
#   bash benchmarks/gpu/bench_session.sh LOG_DIR        # one H200, ~6 min (parts capped at 90+330+170 s): ceilings;
#                                                  # moe-sft vs transformers,
#                                                  # Qwen3-30B-A3B shape x 8 layers, 4096 and 8192 tokens;
#                                                  # DeepSeek-V3 reduced stack (moe-sft)
#   bash benchmarks/gpu/bench_session.sh LOG_DIR ep4    # 4 GPUs: moe-sft EP4, Qwen3-30B-A3B shape x 24 layers
#   bash benchmarks/gpu/bench_session.sh LOG_DIR ep2    # 2 GPUs: moe-sft EP2, 16 layers (4096)
# Environment: LAYERS (8), EP4_LAYERS (24), EP2_LAYERS (16), DSV3_LAYERS (5), STEPS (10), WARMUP (3); QWEN_MODEL
#   (qwen3_30b), DSV3_MODEL (dsv3_reduced): tiny / tiny_dsv3 dry-run the script on CPU;
#   TITAN=1 adds the experimental torchtitan arm (needs its wheels: docs/benchmarks.md#torchtitan);
#   HF_FLEX=1 adds transformers with attn_implementation=flex_attention at 8192 (compiles: +1-2 min).
# Results: LOG_DIR/results/benchmark.json and benchmark.md (merged across runs), one log per part.
set -uo pipefail
log=${1:?LOG_DIR}; mode=${2:-single}
mkdir -p "$log"
out="$log/results"
export PYTHONUNBUFFERED=1 NCCL_NVLS_ENABLE=0 HF_HUB_OFFLINE=1 TRANSFORMERS_OFFLINE=1
steps=${STEPS:-10}; warmup=${WARMUP:-3}; qwen=${QWEN_MODEL:-qwen3_30b}; dsv3=${DSV3_MODEL:-dsv3_reduced}
bench="python3 benchmarks/benchmark.py"
nvidia-smi --query-gpu=name,memory.total --format=csv > "$log/gpu.txt" 2>&1
python3 -c "import torch, transformers; print('torch', torch.__version__, 'transformers', transformers.__version__)" \
  >> "$log/gpu.txt" 2>&1

part() {  # name time-limit-seconds command...
  local name=$1 limit=$2 start rc; shift 2
  start=$(date +%s)
  timeout --kill-after=30 "$limit" "$@" > "$log/$name.log" 2>&1; rc=$?
  echo "== $name: rc=$rc in $(( $(date +%s) - start ))s"
  grep -E "^\[benchmark\]|^\[ceiling\]|Error|error:" "$log/$name.log" | tail -14
}

common="--warmup $warmup --steps $steps --profile-steps 1 --out $out"
if [ "$mode" = ep2 ]; then  # 2 GPUs: twice the one-GPU stack, the same tokens per GPU
  part ep2 300 torchrun --standalone --nproc_per_node=2 benchmarks/benchmark.py train --arm moe-sft --model $qwen \
    --layers "${EP2_LAYERS:-16}" --ep 2 --tokens-per-step 65536 --budgets 4096 $common
elif [ "$mode" = ep4 ]; then
  part ep4 590 torchrun --standalone --nproc_per_node=4 benchmarks/benchmark.py train --arm moe-sft --model $qwen \
    --layers "${EP4_LAYERS:-24}" --ep 4 --tokens-per-step 131072 --budgets 4096,8192 $common
else
  arms=moe-sft,moe-sft-graphs,transformers; [ "${TITAN:-0}" = 1 ] && arms=$arms,torchtitan
  part ceilings 90 $bench ceilings --model $qwen,$dsv3 --budget 8192 --out "$out"
  part qwen3_30b 420 $bench compare --model $qwen --layers "${LAYERS:-8}" --arms $arms \
    --tokens-per-step 32768 --budgets 4096,8192 $common
  part dsv3_reduced 170 $bench train --arm moe-sft --model $dsv3 --layers "${DSV3_LAYERS:-5}" \
    --tokens-per-step 32768 --budgets 4096,8192 $common
  if [ "${HF_FLEX:-0}" = 1 ]; then  # recorded as arm "transformers" too: use a separate --out to keep both
    part hf_flex 300 $bench train --arm transformers --model $qwen --layers "${LAYERS:-8}" --hf-attn flex_attention \
      --tokens-per-step 32768 --budgets 8192 --warmup "$warmup" --steps "$steps" --profile-steps 1 --out "$log/results_flex"
  fi
fi
$bench report "$out" | tee "$log/benchmark.md"
