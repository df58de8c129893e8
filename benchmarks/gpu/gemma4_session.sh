#!/usr/bin/env bash
# Gemma 4 MoE on one GPU (issue 45; results: docs/benchmarks.md).
# Usage, after the install line of ../shared/gpu/README.md:
#   bash benchmarks/gpu/gemma4_session.sh LOG_DIR tests    # bf16 parity vs transformers, 20 steps, LoRA, norms
#   bash benchmarks/gpu/gemma4_session.sh LOG_DIR compare  # moe-sft (graphed and eager) vs transformers, 26B-A4B x 6 layers
set -uo pipefail
log=${1:?LOG_DIR}; mode=${2:-tests}
mkdir -p "$log"
export PYTHONUNBUFFERED=1 NCCL_NVLS_ENABLE=0 HF_HUB_OFFLINE=1 TRANSFORMERS_OFFLINE=1
python3 -c "import torch, transformers; print('torch', torch.__version__, 'transformers', transformers.__version__,
torch.cuda.get_device_name())" >> "$log/gpu.txt" 2>&1

part() {  # name time-limit-seconds command...
  local name=$1 limit=$2 start rc; shift 2
  start=$(date +%s)
  timeout --kill-after=20 "$limit" "$@" > "$log/$name.log" 2>&1; rc=$?
  echo "== $name: rc=$rc in $(( $(date +%s) - start ))s"
  grep -E "^\[benchmark\]|passed|failed|Error|error:|^\{" "$log/$name.log" | tail -14
}

case $mode in
  tests)
    MOE_SFT_GPU_REPORT="$log/parity.json" part gpu_tests "${TESTS_LIMIT:-300}" python3 -m pytest -q -s -p no:randomly \
      tests/gpu/test_gpu_parity.py tests/gpu/test_gpu_peft.py tests/gpu/test_gpu_norm.py -k "${TESTS_K:-gemma4 or norm}" ;;
  compare)
    part gemma4_26b "${COMPARE_LIMIT:-560}" python3 benchmarks/benchmark.py compare --model gemma4_26b \
      --arms "${ARMS:-moe-sft-graphs,moe-sft,transformers}" --tokens-per-step 32768 --budgets 4096,8192 --warmup "${WARMUP:-3}" \
      --steps "${STEPS:-8}" --profile-steps 1 --out "$log/results" ;;
esac
