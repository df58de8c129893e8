#!/usr/bin/env bash
# gpt-oss on the GPU (issue 30; results: docs/parity.md, docs/benchmarks.md). Usage:
#   bash benchmarks/gpu/gpt_oss_session.sh LOG_DIR [parts]
# parts (default "tests train bench"):
#   tests  the bf16 GPU tests that cover gpt-oss: the flash kernel with the window and the folded
#          sink, plain and under simulated CP (test_gpu_attention_sinks.py); HF parity, 20 training
#          steps and the weight-gradient path (test_gpu_parity.py); LoRA/DoRA (test_gpu_peft.py)
#   train  the product path on every GPU of the host: a tiny random gpt-oss with the demo tokenizer,
#          converted, the quickstart recipe trained at EP = GPUs (200 steps), exported and evaluated
#          before/after with transformers, then resumed at CP = GPUs to step 220 (a layout change)
#   bench  gpt-oss-20b's shape (GPT_OSS_LAYERS layers, default 2), moe-sft vs transformers
#          (flex_attention: transformers has no SDPA path with sinks) on one GPU, 32,768 tokens/step
set -uo pipefail
log=${1:?LOG_DIR}; parts=${2:-"tests train bench"}
mkdir -p "$log"
export PYTHONUNBUFFERED=1 NCCL_NVLS_ENABLE=0 HF_HUB_OFFLINE=1 TRANSFORMERS_OFFLINE=1
nvidia-smi --query-gpu=name,memory.total --format=csv > "$log/gpu.txt" 2>&1
gpus=$(nvidia-smi --query-gpu=name --format=csv,noheader | wc -l)
note() { echo "== $1: rc=$2 in $(( $(date +%s) - $3 ))s" | tee -a "$log/summary.txt"; }
for part in $parts; do
  start=$(date +%s)
  case $part in
    tests)
      MOE_SFT_GPU_REPORT="$log/parity.json" timeout 400 python3 -m pytest -q -s -p no:cacheprovider \
        tests/gpu/test_gpu_attention_sinks.py tests/gpu/test_gpu_parity.py tests/gpu/test_gpu_peft.py \
        -k "gpt_oss or sink" > "$log/tests.log" 2>&1
      note tests $? "$start" ;;
    train)
      run=/tmp/gpt_oss_qs; rm -rf $run
      # documents padded to 2·GPUs tokens from the start: CP needs it, and a resume keeps the padding
      qs=(--config-path recipes --config-name quickstart trainer.output_dir=$run/run model.hf_path=$run/hf
          model.mcore_path=$run/mcore data.cache_dir=$run/cache data.pad_documents_to=$((2 * gpus)))
      {
        python3 -m moe_sft.quickstart_model --family gpt_oss --hf-path $run/hf --mcore-path $run/mcore \
          --tokenizer recipes/demo/tokenizer &&
        timeout 300 torchrun --standalone --nproc_per_node="$gpus" -m moe_sft.train "${qs[@]}" \
          parallel.expert_model_parallel_size="$gpus" &&
        python3 tools/eval_demo.py --model $run/hf | tail -1 &&
        python3 tools/eval_demo.py --model $run/run/hf | tail -1 &&
        timeout 200 torchrun --standalone --nproc_per_node="$gpus" -m moe_sft.train "${qs[@]}" \
          parallel.context_parallel_size="$gpus" trainer.max_steps=220
      } > "$log/train.log" 2>&1
      note train $? "$start" ;;
    bench)
      timeout 420 python3 benchmarks/benchmark.py compare --model gpt_oss_20b --layers "${GPT_OSS_LAYERS:-2}" \
        --arms moe-sft,transformers --hf-attn flex_attention --tokens-per-step 32768 --budgets 4096,8192 \
        --warmup 2 --steps 4 --profile-steps 1 --out "$log/bench" > "$log/bench.log" 2>&1
      note bench $? "$start" ;;
    *) echo "unknown part $part" | tee -a "$log/summary.txt" ;;
  esac
done
cat "$log/summary.txt"
