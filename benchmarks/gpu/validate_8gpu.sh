#!/usr/bin/env bash
# Issue 9 on one host of 8 GPUs (bf16, torch-native spec). Usage:
#   bash benchmarks/gpu/validate_8gpu.sh LOG_DIR PART
# PART = qwen30b : the real Qwen3-30B-A3B shape (48 layers) from a synthetic HF checkpoint written
#                  and converted here (--workers 16), EP8 + distributed optimizer, packed demo SFT
#                  data at 4096 tokens per micro-batch, 100 steps (no checkpoint: ~430 GB with the
#                  optimizer state); tokens/s/GPU, peak memory.
#        reshard : the same shapes with 8 layers: 3 steps at EP8 (checkpoint after 2), then steps
#                  3 at TP2·EP4 (resumed) vs the straight EP8 step 3.
set -uo pipefail
log=${1:?LOG_DIR}; part=${2:?PART}; layers=48; [ "$part" = reshard ] && layers=8
work=${WORK:-/tmp/v8_$part}; mkdir -p "$log" "$work"
export PYTHONUNBUFFERED=1 NCCL_NVLS_ENABLE=0
if [ ! -f "$work/mcore/moe_sft_meta.json" ]; then
  python3 - "$work/hf" "$layers" <<'PY' > "$log/${part}_write.log" 2>&1
import json, shutil, sys, time
from pathlib import Path
from transformers import AutoConfig
from moe_sft.conversion.synthetic import write_synthetic_checkpoint
out, layers = Path(sys.argv[1]), int(sys.argv[2])
cfg = AutoConfig.from_pretrained("recipes/models/qwen3_30b_a3b")
cfg.num_hidden_layers = layers
t = time.time(); n = write_synthetic_checkpoint(out, cfg)
for f in Path("recipes/demo/tokenizer").iterdir():
    shutil.copy(f, out / f.name)
print(f"synthetic {layers}-layer Qwen3-30B-A3B: {n/1e9:.2f} GB in {time.time()-t:.0f}s")
PY
  python3 tools/convert_hf_to_mcore.py --hf-path "$work/hf" --output "$work/mcore" --workers 16 \
    > "$log/${part}_convert.log" 2>&1 || { echo "convert failed"; tail -20 "$log/${part}_convert.log"; exit 1; }
  tail -2 "$log/${part}_convert.log"
fi
train() {  # log-name run-dir nproc overrides...
  local name=$1 dir=$2 n=$3; shift 3
  torchrun --standalone --nproc_per_node=$n -m moe_sft.train --config-path recipes --config-name quickstart \
    trainer.log_interval=1 trainer.export_hf_at_end=false trainer.output_dir=$work/$dir \
    model.hf_path=$work/hf model.mcore_path=$work/mcore model.create_tiny_if_missing=false \
    data.pack_length=4096 data.max_seq_len=4096 trainer.global_batch_size=16 optimizer.lr=1e-5 optimizer.min_lr=0 \
    "$@" > "$log/${part}_$name.log" 2>&1
  echo "$name rc=$?"; grep -E "^step|peak memory" "$log/${part}_$name.log" | tail -4
}
EP8="parallel.expert_model_parallel_size=8"
if [ "$part" = qwen30b ]; then
  train ep8 ep8 8 $EP8 trainer.max_steps=100 checkpoint.save_interval=0 checkpoint.save_at_end=false
else
  train straight straight 8 $EP8 trainer.max_steps=3 checkpoint.save_at_end=false
  rm -rf "$work/resumed"
  train first resumed 8 $EP8 trainer.max_steps=2
  train second resumed 8 parallel.tensor_model_parallel_size=2 parallel.sequence_parallel=true \
    parallel.expert_model_parallel_size=4 parallel.expert_tensor_parallel_size=1 trainer.max_steps=3 \
    checkpoint.save_at_end=false
fi
