#!/usr/bin/env bash
# LoRA at full speed on one GPU (issue 46; results: docs/benchmarks.md#lora-at-full-speed-issue-46).
# Usage, after the install line of ../shared/gpu/README.md (with the peft wheels, docs/benchmarks.md):
#   bash benchmarks/gpu/lora_session.sh LOG_DIR tests    # graphs + LoRA (bf16 and FP8 base) train as eager
#   bash benchmarks/gpu/lora_session.sh LOG_DIR compare  # full SFT, LoRA eager / graphed, transformers + peft,
#                                                        # Qwen3-30B-A3B x 8 layers, side by side
#   bash benchmarks/gpu/lora_session.sh LOG_DIR whole    # all 48 layers: LoRA on a bf16 and an FP8 base,
#                                                        # transformers + peft at the same size
set -uo pipefail
log=${1:?LOG_DIR}; mode=${2:-tests}
mkdir -p "$log"
export PYTHONUNBUFFERED=1 NCCL_NVLS_ENABLE=0 HF_HUB_OFFLINE=1 TRANSFORMERS_OFFLINE=1
python3 -c "import torch, transformers, peft; print('torch', torch.__version__, 'transformers', transformers.__version__,
'peft', peft.__version__, torch.cuda.get_device_name())" >> "$log/gpu.txt" 2>&1

part() {  # name time-limit-seconds command...
  local name=$1 limit=$2 start rc; shift 2
  start=$(date +%s)
  timeout --kill-after=20 "$limit" "$@" > "$log/$name.log" 2>&1; rc=$?
  echo "== $name: rc=$rc in $(( $(date +%s) - start ))s"
  grep -E "^\[benchmark\]|passed|failed|Error|error:|tokens/s =|^\{" "$log/$name.log" | tail -20
}

compare() {  # name limit arms [extra benchmark arguments...]
  local name=$1 limit=$2 arms=$3; shift 3
  part "$name" "$limit" python3 benchmarks/benchmark.py compare --model qwen3_30b --arms "$arms" \
    --tokens-per-step 32768 --budgets 4096,8192 --warmup "${WARMUP:-3}" --steps "${STEPS:-8}" --profile-steps 0 \
    --out "$log/$name" "$@"
}

case $mode in
  tests)
    part gpu_tests "${TESTS_LIMIT:-300}" python3 -m pytest -q -s -p no:randomly tests/gpu/test_gpu_cuda_graphs.py \
      -k "${TESTS_K:-adapters}" ;;
  compare)
    compare lora8 "${COMPARE_LIMIT:-560}" moe-sft-graphs,moe-sft-lora,moe-sft-lora-graphs,transformers-peft ;;
  whole)
    compare lora48 "${COMPARE_LIMIT:-560}" moe-sft-lora-graphs,moe-sft-lora-fp8-graphs,transformers-peft \
      --layers 48 --attention-kernel torch ;;
esac
