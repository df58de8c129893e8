#!/usr/bin/env bash
# LoRA / DoRA at the parallel layouts of one host (bf16): each layout trains the same 4-layer tiny
# GLM-4.5 (dense first layer, 8 routed experts top-2 + a shared expert, GQA with q/k/v biases)
# with adapters on every linear (peft.target_modules=[all_linear]) for 5 steps on the same global
# batch at a constant lr; the table compares loss and grad norm with the one-GPU run of the same
# adapters (DoRA and the shared expert A factor against their own one-GPU runs; resumed runs on
# the steps they ran). The GPU twin of tests/dist/test_peft_layouts.py.
# Usage: bash benchmarks/gpu/peft_layout_matrix.sh LOG_DIR NUM_GPUS   (LAYOUTS="a b" reruns a subset)
set -uo pipefail
log=${1:-gpu_logs_peft}; gpus=${2:-4}
steps=${STEPS:-5}; save_at=$((steps / 2 + 1))  # the one save before the end: resumed runs do the steps after it
mkdir -p "$log"; work=${WORK:-/tmp/peft_layout_matrix}
export PYTHONUNBUFFERED=1 NCCL_NVLS_ENABLE=0
if [ ! -f "$work/mcore/moe_sft_meta.json" ]; then
  rm -rf "$work"
  python3 - "$work" > "$log/create.log" 2>&1 <<'PY'
import sys
from pathlib import Path

import torch
from transformers import AutoTokenizer

from moe_sft.conversion.convert import convert
from moe_sft.models import registry
from moe_sft.runtime import cpu_compat

work = Path(sys.argv[1])
family = registry.family_by_name("glm4_moe")
vocab = len(AutoTokenizer.from_pretrained("recipes/demo/tokenizer"))
with cpu_compat.suspended():
    torch.manual_seed(0)
    model = family.hf_model_class(family.tiny_hf_config(vocab_size=vocab, num_hidden_layers=4)).eval()
    for name, buf in model.named_buffers():
        if name.endswith("e_score_correction_bias"):  # zeros at init: make it steer routing
            buf.copy_(torch.randn_like(buf) * 0.5)
    model.save_pretrained(str(work / "hf"))
convert(work / "hf", work / "mcore")
PY
fi
LORA="peft.method=lora peft.rank=8 peft.target_modules=[all_linear]"
DORA="peft.method=dora peft.rank=8 peft.target_modules=[attention,dense_mlp,shared_experts]"
run_one() {  # name nproc max_steps output_name overrides...
  local name=$1 n=$2 max=$3 out=$4; shift 4
  torchrun --standalone --nproc_per_node=$n -m moe_sft.train --config-path recipes --config-name quickstart \
    trainer.max_steps=$max trainer.log_interval=1 trainer.global_batch_size=8 trainer.export_hf_at_end=false \
    trainer.output_dir=$work/$out model.hf_path=$work/hf model.mcore_path=$work/mcore \
    model.create_tiny_if_missing=false data.pack_length=4096 data.max_seq_len=1024 data.pad_documents_to=4 \
    optimizer.lr=3.0e-3 optimizer.lr_warmup_steps=0 optimizer.lr_decay_style=constant "$@" > "$log/$name.log" 2>&1
  echo "$name rc=$?"; echo "$n" > "$log/$name.gpus"
}
only=${LAYOUTS:-}  # space-separated subset to (re)run; the table covers every log in LOG_DIR
want() { [ -z "$only" ] || [[ " $only " == *" $1 "* ]]; }
run() {  # name nproc overrides...: a fresh run of every step
  want "$1" || return 0
  rm -rf "$work/$1"
  run_one "$1" "$2" "$steps" "$1" checkpoint.save_interval=0 checkpoint.save_at_end=false "${@:3}"
}
resharded() {  # name nproc "overrides" resume_nproc "resume overrides": save after step save_at, resume elsewhere
  want "$1" || return 0
  rm -rf "$work/$1"
  run_one "$1" "$2" "$steps" "$1" checkpoint.save_interval=$save_at checkpoint.save_at_end=false $LORA $3
  run_one "$1.resumed" "$4" "$steps" "$1" checkpoint.save_at_end=false $LORA $5
}
SP="parallel.tensor_model_parallel_size=2 parallel.sequence_parallel=true"
EP2="parallel.expert_model_parallel_size=2"
PP2="parallel.pipeline_model_parallel_size=2"
run one 1 $LORA
run dp2_distopt 2 $LORA parallel.use_distributed_optimizer=true
run tp2_sp 2 $LORA $SP
run ep2 2 $LORA $EP2
run tp2_etp2 2 $LORA $SP parallel.expert_tensor_parallel_size=2
run pp2_vpp2 2 $LORA $PP2 parallel.virtual_pipeline_model_parallel_size=2
run cp2 2 $LORA parallel.context_parallel_size=2
run tp2_ep2_etp1 2 $LORA $SP $EP2 parallel.expert_tensor_parallel_size=1
resharded tp2_sp_to_ep2 2 "$SP" 2 "$EP2"
resharded pp2_vpp2_to_one 2 "$PP2 parallel.virtual_pipeline_model_parallel_size=2" 1 ""
run dora.one 1 $DORA
run dora.tp2_sp 2 $DORA $SP
run share_a.one 1 $LORA peft.share_expert_factor=a
run share_a.ep2 2 $LORA peft.share_expert_factor=a $EP2
if [ "$gpus" -ge 4 ]; then
  run tp2_pp2 4 $LORA $SP $PP2
  run ep4 4 $LORA parallel.expert_model_parallel_size=4
  run tp2_etp2_ep2 4 $LORA $SP $EP2 parallel.expert_tensor_parallel_size=2
  run tp2_ep2_etp1_pp2 4 $LORA $SP $EP2 parallel.expert_tensor_parallel_size=1 $PP2
  run dora.tp2_pp2 4 $DORA $SP $PP2
fi
python3 benchmarks/gpu/peft_layout_summary.py "$log"
