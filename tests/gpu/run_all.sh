#!/usr/bin/env bash
# Every GPU check in one go (one GPU): bf16 parity test, then the quickstart in bf16 with its
# throughput. Usage: bash tests/gpu/run_all.sh LOG_DIR  (PYTEST_ARGS=--ignore=tests/gpu/FILE: a subset)
set -uo pipefail
log=${1:-gpu_logs}
mkdir -p "$log"
export PYTHONUNBUFFERED=1 NCCL_NVLS_ENABLE=0 MOE_SFT_GPU_REPORT="$log/parity.json"
nvidia-smi --query-gpu=name,memory.total --format=csv > "$log/gpu.txt" 2>&1
python3 -m pytest tests/gpu -q -s -p no:cacheprovider ${PYTEST_ARGS:-} 2>&1 | tee "$log/pytest_gpu.log"
rm -rf /tmp/qs_gpu
torchrun --nproc_per_node=1 -m moe_sft.train --config-path recipes --config-name quickstart \
  trainer.output_dir=/tmp/qs_gpu/run model.hf_path=/tmp/qs_gpu/tiny_hf model.mcore_path=/tmp/qs_gpu/tiny_mcore \
  2>&1 | grep -v -i warn | tee "$log/quickstart_gpu.log"
python3 tools/eval_demo.py --model /tmp/qs_gpu/tiny_hf 2>&1 | tail -1 | tee "$log/eval_before.log"
python3 tools/eval_demo.py --model /tmp/qs_gpu/run/hf 2>&1 | tail -1 | tee "$log/eval_after.log"
# Resume on the GPU: the same command with a larger max_steps continues from step 200.
torchrun --nproc_per_node=1 -m moe_sft.train --config-path recipes --config-name quickstart \
  trainer.output_dir=/tmp/qs_gpu/run model.hf_path=/tmp/qs_gpu/tiny_hf model.mcore_path=/tmp/qs_gpu/tiny_mcore \
  trainer.max_steps=220 2>&1 | grep -v -i warn | tee "$log/resume_gpu.log"
