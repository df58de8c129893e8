#!/usr/bin/env bash
# Hybrid (Gated DeltaNet) families on one GPU (issue 44; results: docs/benchmarks.md#hybrid-gated-deltanet).
# Usage, after the install line of ../shared/gpu/README.md:
#   bash benchmarks/gpu/gdn_session.sh LOG_DIR tests     # GPU tests (fla vs torch, fwd+bwd; bf16 parity; 20 steps)
#                                                        # + the GDN layer against fla's kernel alone
#   bash benchmarks/gpu/gdn_session.sh LOG_DIR qwen3_5   # moe-sft vs transformers (+ fla), Qwen3.5-35B-A3B x 5 layers
#                                                        # (ARMS=moe-sft-graphs,moe-sft,transformers: other arms)
#   bash benchmarks/gpu/gdn_session.sh LOG_DIR qwen3_next  # the same, Qwen3-Next-80B-A3B x 4 layers
# fla's gated backward needs Triton >= 3.7.1 on Hopper (fla issue #640); an image with an older Triton
# can put a newer one first on PYTHONPATH (docs/benchmarks.md says how it was carried).
set -uo pipefail
log=${1:?LOG_DIR}; mode=${2:-tests}
mkdir -p "$log"
export PYTHONUNBUFFERED=1 NCCL_NVLS_ENABLE=0 HF_HUB_OFFLINE=1 TRANSFORMERS_OFFLINE=1
python3 -c "import torch, triton, transformers, fla; print('torch', torch.__version__, 'triton', triton.__version__,
'transformers', transformers.__version__, 'fla', fla.__version__, torch.cuda.get_device_name())" >> "$log/gpu.txt" 2>&1

part() {  # name time-limit-seconds command...
  local name=$1 limit=$2 start rc; shift 2
  start=$(date +%s)
  timeout --kill-after=20 "$limit" "$@" > "$log/$name.log" 2>&1; rc=$?
  echo "== $name: rc=$rc in $(( $(date +%s) - start ))s"
  grep -E "^\[benchmark\]|passed|failed|Error|error:|^\{" "$log/$name.log" | tail -14
}

compare() {  # preset limit
  part "$1" "$2" python3 benchmarks/benchmark.py compare --model "$1" --arms "${ARMS:-moe-sft,transformers}" \
    --tokens-per-step 32768 --budgets 4096,8192 --warmup "${WARMUP:-3}" --steps "${STEPS:-8}" --profile-steps 1 --out "$log/results"
}

case $mode in
  tests)
    part gpu_tests "${TESTS_LIMIT:-400}" python3 -m pytest -q -s -p no:randomly tests/gpu/test_gpu_gated_delta_net.py \
      tests/gpu/test_gpu_parity.py -k "${TESTS_K:-qwen3_next or qwen3_5 or fla}"
    part gdn_bench 150 python3 -m benchmarks.gpu.gdn_bench ;;
  qwen3_5) compare qwen3_5_35b "${COMPARE_LIMIT:-560}" ;;
  qwen3_next) compare qwen3_next_80b "${COMPARE_LIMIT:-560}" ;;
esac
