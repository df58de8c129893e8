#!/usr/bin/env bash
# LoRA / DoRA on the GPU (issue 28; results: docs/peft.md, docs/layouts.md). Usage:
#   bash benchmarks/gpu/peft_session.sh LOG_DIR single   # 4 GPUs, one job per GPU at once (~8 min):
#        GPU0: tests/gpu/test_gpu_peft.py, then the quickstart with LoRA in bf16 and its eval
#        GPU1: LoRA vs full SFT, tokens/s and peak memory (Qwen3-30B-A3B shape x 8 layers, one GPU)
#        GPU2: LoRA on an FP8 base vs a bf16 base at the 671B recipe's per-GPU shard shape
#        GPU3: the rest of tests/gpu (nothing else regressed)
#   bash benchmarks/gpu/peft_session.sh LOG_DIR matrix   # the LoRA layout matrix on 4 GPUs (bf16)
# The jobs of `single` share the host's CPUs (64 cores) but not a GPU; the benchmark's two arms run
# back to back on GPU1, so their ratio is measured side by side.
set -uo pipefail
log=${1:?LOG_DIR}; part=${2:-single}
mkdir -p "$log"
export PYTHONUNBUFFERED=1 NCCL_NVLS_ENABLE=0 HF_HUB_OFFLINE=1 TRANSFORMERS_OFFLINE=1
nvidia-smi --query-gpu=name,memory.total --format=csv > "$log/gpu.txt" 2>&1
timed() {  # name limit command...
  local name=$1 limit=$2 start; shift 2; start=$(date +%s)
  timeout --kill-after=20 "$limit" "$@" > "$log/$name.log" 2>&1
  echo "== $name: rc=$? in $(( $(date +%s) - start ))s" | tee -a "$log/summary.txt"
}
if [ "$part" = matrix ]; then
  timed matrix 560 bash benchmarks/gpu/peft_layout_matrix.sh "$log/matrix" 4
  exit 0
fi
qs=/tmp/qs_lora_gpu
(
  export CUDA_VISIBLE_DEVICES=0
  timed pytest_peft 300 python3 -m pytest tests/gpu/test_gpu_peft.py -q -s -p no:cacheprovider -p no:randomly
  rm -rf $qs
  timed quickstart_lora 240 torchrun --standalone --nproc_per_node=1 -m moe_sft.train --config-path recipes \
    --config-name quickstart_lora trainer.output_dir=$qs/run model.hf_path=$qs/tiny_hf model.mcore_path=$qs/tiny_mcore
  timed eval_lora 60 python3 tools/eval_demo.py --model $qs/run/hf
  timed eval_adapter 60 python3 -c "
import sys, torch, peft, transformers
base = transformers.AutoModelForCausalLM.from_pretrained('$qs/tiny_hf', dtype=torch.float32)
merged = transformers.AutoModelForCausalLM.from_pretrained('$qs/run/hf', dtype=torch.float32)
model = peft.PeftModel.from_pretrained(base, '$qs/run/hf_adapter')
ids = torch.randint(0, base.config.vocab_size, (1, 64), generator=torch.Generator().manual_seed(0))
with torch.no_grad():
    d = (model(ids).logits - merged(ids).logits).abs().max().item()
print('peft-loaded vs merged (bf16 export read in fp32): max |logit diff|', d)
"
) &
(
  export CUDA_VISIBLE_DEVICES=1
  timed bench_lora 420 python3 benchmarks/benchmark.py compare --model qwen3_30b --layers 8 \
    --arms moe-sft,moe-sft-lora --tokens-per-step 32768 --budgets 4096,8192 --warmup 3 --steps 8 \
    --profile-steps 0 --out "$log/bench"
  python3 benchmarks/benchmark.py report "$log/bench" > "$log/bench.md" 2>&1
) &
(
  export CUDA_VISIBLE_DEVICES=2
  timed fp8_bench 420 python3 -m benchmarks.gpu.peft_fp8_bench
) &
(
  export CUDA_VISIBLE_DEVICES=3
  timed pytest_gpu_rest 480 python3 -m pytest tests/gpu -q -p no:cacheprovider -p no:randomly \
    --ignore=tests/gpu/test_gpu_peft.py
) &
wait
cat "$log/summary.txt"
