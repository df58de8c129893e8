#!/usr/bin/env bash
# Expert parallelism on one host (issue 29; results: docs/benchmarks.md). Usage:
#   bash benchmarks/gpu/ep_session.sh LOG_DIR [parts]
# parts (default "ep4_alltoall ep4_allgather one"), each a full-step benchmark of the Qwen3-30B-A3B
# shape at 4096 and 8192 tokens per micro-batch, real routing, 32,768 tokens per GPU per step:
#   ep4_alltoall / ep4_allgather   4 GPUs, EP 4 (DP 4 for the dense part), megatron's alltoall or
#                                  allgather token dispatcher, EP4_LAYERS layers
#   ep2_alltoall / ep2_allgather   2 GPUs, EP 2, EP2_LAYERS layers (the allgather: static rows at 4096)
#   ep2_static / ep2_counted       the allgather with `--static-rows on` / `off` at every budget
#   ep2_graphs                     the allgather with trainer.cuda_graphs (arm moe-sft-graphs): the
#                                  MoE half captured with its collectives, static rows at every budget
#   ep4_graphs / ep4_counted       the same at EP4 (static rows capped at 2x the expected rows) / the
#                                  eager allgather with `--static-rows off`
#   dsv3_ep4_graphs                dsv3_ep4 with trainer.cuda_graphs and the allgather
#   dsv3_ep4_graphs_bf16           the same with the combine's reduce-scatter in bf16
#   ep4_graphs_c125 / _c150        ep4_graphs with static rows capped at 1.25x / 1.5x the expected rows
#   ep4_graphs_padded              ep4_graphs with the padding rows gathered and activated (the A/B of
#                                  moe_sft/kernels/bounded_rows.py, `--padding-rows compute`)
#   ep4_graphs_bf16                ep4_graphs with the combine's reduce-scatter in bf16
#   ep4_graphs_split / _split_bf16 ep4_graphs with each MoE layer's dispatch in 2 token chunks whose
#                                  collectives overlap the other chunk's experts (model.moe_dispatch_chunks)
#                                  / the same with the bf16 combine
#   ep2_graphs_split               ep2_graphs in 2 token chunks
#   dsv3_ep4_graphs_split_bf16     dsv3_ep4_graphs_bf16 in 2 token chunks
#   ep4_static                     the eager allgather with `--static-rows on` at every budget
#   one                            1 GPU, eager, ONE_LAYERS layers: the per-layer reference of scaling
#   one_graphs                     the same with CUDA graphs (arm moe-sft-graphs)
#   titan_ep4                      torchtitan's own EP4 recipe on the same data (benchmarks/titan.py:
#                                  its ExpertParallel + FSDP2; needs its wheels, docs/benchmarks.md#torchtitan)
#   dsv3_ep4                       4 GPUs, EP 4, the reduced DeepSeek-V3 stack (MLA, 256 experts, a
#                                  shared expert, MTP), DSV3_LAYERS layers, the auto dispatcher
#   gpu_tests                      tests/gpu/test_gpu_dispatch.py and test_gpu_bounded_rows.py (the
#                                  dispatch's numerics, host syncs, the kernels that skip padding)
#   graph_tests                    tests/gpu/test_gpu_cuda_graphs.py at EP2 / EP4 and the row-capacity
#                                  re-run (graphed vs eager; each skips without its GPU count);
#                                  GRAPH_K picks others (e.g. "chunks" for the split dispatch's)
# ATTN (default auto) is every moe-sft run's model.attention_kernel: auto | torch | fa4.
# Layer counts default to what fits the GPU (H200: 24 / 16 / 8 / 10; 80 GB H100: 16 / 10 / 5 / 6).
set -uo pipefail
log=${1:?LOG_DIR}; parts=${2:-"ep4_alltoall ep4_allgather one"}
mkdir -p "$log"
export PYTHONUNBUFFERED=1 NCCL_NVLS_ENABLE=0 HF_HUB_OFFLINE=1 TRANSFORMERS_OFFLINE=1
nvidia-smi --query-gpu=name,memory.total --format=csv > "$log/gpu.txt" 2>&1
mem_mib=$(nvidia-smi --query-gpu=memory.total --format=csv,noheader,nounits | head -1)
if [ "${mem_mib:-0}" -gt 100000 ]; then big=1; else big=0; fi
ep4_layers=${EP4_LAYERS:-$([ $big = 1 ] && echo 24 || echo 16)}
ep2_layers=${EP2_LAYERS:-$([ $big = 1 ] && echo 16 || echo 10)}
one_layers=${ONE_LAYERS:-$([ $big = 1 ] && echo 8 || echo 5)}
dsv3_layers=${DSV3_LAYERS:-$([ $big = 1 ] && echo 10 || echo 6)}
common="--budgets ${BUDGETS:-4096,8192} --warmup ${WARMUP:-2} --steps ${STEPS:-4} --profile-steps 1 --attention-kernel ${ATTN:-auto}"
run_part() {  # name limit command...
  local name=$1 limit=$2 start; shift 2; start=$(date +%s)
  timeout --kill-after=20 "$limit" "$@" --out "$log/$name" > "$log/$name.log" 2>&1
  echo "== $name: rc=$? in $(( $(date +%s) - start ))s" | tee -a "$log/summary.txt"
  python3 benchmarks/benchmark.py report "$log/$name" > "$log/$name.md" 2>&1
}
ep_run() {  # name gpus layers dispatcher [model [extra arguments...]]; ARM=moe-sft-graphs: CUDA graphs
  local name=$1 gpus=$2 layers=$3 dispatcher=$4 model=${5:-qwen3_30b}; shift $(( $# < 5 ? $# : 5 ))
  run_part "$name" "${LIMIT:-300}" torchrun --standalone --nproc_per_node="$gpus" benchmarks/benchmark.py train \
    --arm "${ARM:-moe-sft}" --model "$model" $common --layers "$layers" --ep "$gpus" --dispatcher "$dispatcher" \
    --tokens-per-step $((32768 * gpus)) "$@"
}
for part in $parts; do
  case $part in
    ep4_alltoall) ep_run "$part" 4 "$ep4_layers" alltoall ;;
    ep4_allgather) ep_run "$part" 4 "$ep4_layers" allgather ;;
    ep2_alltoall) ep_run "$part" 2 "$ep2_layers" alltoall ;;
    ep2_allgather) ep_run "$part" 2 "$ep2_layers" allgather ;;
    ep2_static) ep_run "$part" 2 "$ep2_layers" allgather qwen3_30b --static-rows on ;;
    ep2_counted) ep_run "$part" 2 "$ep2_layers" allgather qwen3_30b --static-rows off ;;
    ep2_graphs) ARM=moe-sft-graphs ep_run "$part" 2 "$ep2_layers" allgather ;;
    ep4_graphs) ARM=moe-sft-graphs ep_run "$part" 4 "$ep4_layers" allgather ;;
    ep4_graphs_c125) ARM=moe-sft-graphs ep_run "$part" 4 "$ep4_layers" allgather qwen3_30b --static-rows-capacity 1.25 ;;
    ep4_graphs_c150) ARM=moe-sft-graphs ep_run "$part" 4 "$ep4_layers" allgather qwen3_30b --static-rows-capacity 1.5 ;;
    ep4_graphs_padded) ARM=moe-sft-graphs ep_run "$part" 4 "$ep4_layers" allgather qwen3_30b --padding-rows compute ;;
    ep4_graphs_bf16) ARM=moe-sft-graphs ep_run "$part" 4 "$ep4_layers" allgather qwen3_30b --combine-dtype bf16 ;;
    ep4_graphs_split) ARM=moe-sft-graphs ep_run "$part" 4 "$ep4_layers" allgather qwen3_30b --dispatch-chunks 2 ;;
    ep4_graphs_split_bf16) ARM=moe-sft-graphs ep_run "$part" 4 "$ep4_layers" allgather qwen3_30b --dispatch-chunks 2 --combine-dtype bf16 ;;
    ep2_graphs_split) ARM=moe-sft-graphs ep_run "$part" 2 "$ep2_layers" allgather qwen3_30b --dispatch-chunks 2 ;;
    dsv3_ep4_graphs_split_bf16) ARM=moe-sft-graphs ep_run "$part" 4 "$dsv3_layers" allgather dsv3_reduced --dispatch-chunks 2 --combine-dtype bf16 ;;
    ep4_static) ep_run "$part" 4 "$ep4_layers" allgather qwen3_30b --static-rows on ;;
    ep4_counted) ep_run "$part" 4 "$ep4_layers" allgather qwen3_30b --static-rows off ;;
    dsv3_ep4_graphs_bf16) ARM=moe-sft-graphs ep_run "$part" 4 "$dsv3_layers" allgather dsv3_reduced --combine-dtype bf16 ;;
    dsv3_ep4_graphs) ARM=moe-sft-graphs ep_run "$part" 4 "$dsv3_layers" allgather dsv3_reduced ;;
    one|one_graphs) arm=$([ $part = one ] && echo moe-sft || echo moe-sft-graphs)
      run_part "$part" "${LIMIT:-300}" python3 benchmarks/benchmark.py train --arm "$arm" --model qwen3_30b \
        $common --layers "$one_layers" --tokens-per-step 32768 ;;
    dsv3_ep4) ep_run "$part" 4 "$dsv3_layers" auto dsv3_reduced ;;
    titan_ep4) ARM=torchtitan ep_run "$part" 4 "$ep4_layers" auto ;;
    gpu_tests|graph_tests)
      start=$(date +%s)
      if [ $part = gpu_tests ]; then args=(tests/gpu/test_gpu_dispatch.py tests/gpu/test_gpu_bounded_rows.py); else args=(tests/gpu/test_gpu_cuda_graphs.py -k "${GRAPH_K:-at_ep or row_capacity}"); fi
      timeout "${TEST_LIMIT:-300}" python3 -m pytest "${args[@]}" -q -s -p no:cacheprovider > "$log/$part.log" 2>&1
      echo "== $part: rc=$? in $(( $(date +%s) - start ))s" | tee -a "$log/summary.txt" ;;
    *) echo "unknown part $part" | tee -a "$log/summary.txt" ;;
  esac
done
cat "$log/summary.txt"
