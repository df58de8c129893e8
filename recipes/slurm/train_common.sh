#!/usr/bin/env bash
# Sourced by recipes/slurm/<model>.sbatch (one task per node): pre-flight, NCCL environment, a
# torchrun per node rendezvousing on the first node, and requeue on pre-emption / time limit.
#
# Set by the caller (the <model>.sbatch) or the environment (sbatch --export=ALL,VAR=...):
#   RECIPE       recipe name under recipes/ (e.g. qwen3_235b_a22b or qwen3_235b_a22b_h200)
#   MCORE_PATH   converted checkpoint (recipes/slurm/convert.sbatch wrote it)
#   DATA         training data, a .jsonl on shared storage (comma-separated for several)
#   RUN_DIR      run directory on shared storage: checkpoints/, tensorboard/, hf/ (the export)
#   REPO         moe-sft checkout on shared storage (default: the submit directory)
#   EXTRA        further key=value overrides for moe_sft.train (optional)
#   GPUS_PER_NODE (default 8)
set -euo pipefail

: "${RECIPE:?set RECIPE}" "${MCORE_PATH:?set MCORE_PATH}" "${DATA:?set DATA}" "${RUN_DIR:?set RUN_DIR}"
REPO=${REPO:-${SLURM_SUBMIT_DIR:-$PWD}}
GPUS_PER_NODE=${GPUS_PER_NODE:-8}
cd "$REPO"
mkdir -p "$RUN_DIR" logs

# ---------------------------------------------------------------- environment
# Defaults that most InfiniBand clusters need; anything already exported by the site wins.
export PYTHONUNBUFFERED=1
export OMP_NUM_THREADS=${OMP_NUM_THREADS:-8}             # CPU Adam (optimizer offload) uses these
export CUDA_DEVICE_MAX_CONNECTIONS=${CUDA_DEVICE_MAX_CONNECTIONS:-1}
# less allocator fragmentation under MoE's varying shapes (the trainer's default too; docs/planner.md)
export PYTORCH_CUDA_ALLOC_CONF=${PYTORCH_CUDA_ALLOC_CONF:-expandable_segments:True}
export TORCH_NCCL_ASYNC_ERROR_HANDLING=${TORCH_NCCL_ASYNC_ERROR_HANDLING:-1}  # fail, do not hang
export TORCH_NCCL_AVOID_RECORD_STREAMS=${TORCH_NCCL_AVOID_RECORD_STREAMS:-1}
export NCCL_DEBUG=${NCCL_DEBUG:-WARN}
export NCCL_NVLS_ENABLE=${NCCL_NVLS_ENABLE:-0}           # NVLink SHARP/multicast off (see KINDS notes)
export NCCL_IB_TIMEOUT=${NCCL_IB_TIMEOUT:-22}
export NCCL_IB_RETRY_CNT=${NCCL_IB_RETRY_CNT:-10}
export NCCL_SOCKET_IFNAME=${NCCL_SOCKET_IFNAME:-^lo,docker0}   # bootstrap over a real interface
# export NCCL_IB_HCA=mlx5_0,mlx5_1,...    # the compute HCAs if the site does not set them
# export NCCL_NET_GDR_LEVEL=PHB           # GPUDirect RDMA distance, site-specific
# UCX (used by PMIx/MPI launches on some clusters): stay on the IB devices, not TCP.
export UCX_TLS=${UCX_TLS:-rc,sm,self}
# export UCX_NET_DEVICES=mlx5_0:1

# ---------------------------------------------------------------- rendezvous
mapfile -t nodes < <(scontrol show hostnames "$SLURM_JOB_NODELIST")   # (no `| head`: SIGPIPE + pipefail)
MASTER_ADDR=${nodes[0]}
MASTER_PORT=${MASTER_PORT:-$((20000 + SLURM_JOB_ID % 20000))}
export MASTER_ADDR MASTER_PORT
WORLD=$((SLURM_NNODES * GPUS_PER_NODE))
IFS=, read -r -a data_files <<< "$DATA"
OVERRIDES=("model.mcore_path=$MCORE_PATH" "data.train_files=[$(IFS=,; echo "${data_files[*]}")]"
           "trainer.output_dir=$RUN_DIR" "hardware.nodes=$SLURM_NNODES" "hardware.gpus_per_node=$GPUS_PER_NODE")
# shellcheck disable=SC2206
[ -n "${EXTRA:-}" ] && OVERRIDES+=($EXTRA)

echo "[$(date -Is)] job $SLURM_JOB_ID (restart ${SLURM_RESTART_COUNT:-0}): $RECIPE on $SLURM_NNODES nodes x $GPUS_PER_NODE GPUs, rendezvous $MASTER_ADDR:$MASTER_PORT"

# ---------------------------------------------------------------- pre-flight (no GPU work)
# Layout vs world size, memory per stage, checkpoint complete and of the recipe's model. A failure
# here costs seconds, not a queue wait plus a crash on 64 GPUs.
python -m moe_sft.plan "recipes/$RECIPE.yaml" --strict --gpus "$WORLD" "${OVERRIDES[@]}" | tee "$RUN_DIR/plan-$SLURM_JOB_ID.txt"

# ---------------------------------------------------------------- pre-emption / time limit
# sbatch --signal=B:USR1@<s> sends USR1 to this script before the time limit. The trap creates
# RUN_DIR/STOP: every rank finishes its current step, the trainer saves a checkpoint, removes the
# file and exits 0; then this script requeues the job (same id, same RUN_DIR). Leave the signal
# enough seconds for one step plus one checkpoint save (the log prints the save time). Pre-emption
# (PreemptMode=REQUEUE) requeues the job by itself thanks to --requeue; TERM alone (scancel, the
# time limit, pre-emption) reaches every process of the job (torchrun forwards it too): the trainer
# ends after the current step with a checkpoint (its helper processes ignore TERM), without a
# requeue, but only if that step plus the save fit in torchrun's grace period (30 s by default;
# TORCH_ELASTIC_SHUTDOWN_TIMEOUT / --shutdown-timeout in recent torch) and slurm's KillWait (or
# GraceTime on pre-emption); otherwise everything is killed and the run resumes from the last
# periodic checkpoint (checkpoint.save_interval). torchrun exits 1 after forwarding TERM.
# The requeued job resumes from RUN_DIR/checkpoints/latest (checkpoint.resume=auto) with model,
# optimizer, scheduler, RNG and data position.
stop_requested=0
request_stop() {
  [ "$stop_requested" = 1 ] && return
  stop_requested=1
  echo "[$(date -Is)] USR1: asking the trainer to checkpoint and stop ($RUN_DIR/STOP)"
  touch "$RUN_DIR/STOP"
}
trap request_stop USR1

# ---------------------------------------------------------------- train
# One srun task per node; each runs torchrun with GPUS_PER_NODE processes. c10d rendezvous on the
# first node assigns node ranks; --max-restarts=0: a crashed rank ends the job (no silent retries).
srun --ntasks-per-node=1 --kill-on-bad-exit=1 --cpu-bind=none \
  bash -c "exec torchrun --nnodes=$SLURM_NNODES --nproc_per_node=$GPUS_PER_NODE \
    --rdzv_id=$SLURM_JOB_ID --rdzv_backend=c10d --rdzv_endpoint=$MASTER_ADDR:$MASTER_PORT \
    --max-restarts=0 -m moe_sft.train --config-path recipes --config-name $RECIPE $(printf '%q ' "${OVERRIDES[@]}")" &
srun_pid=$!
# `wait` returns early when a trapped signal arrives; keep waiting for srun to end.
status=0
while true; do
  wait "$srun_pid" && status=0 || status=$?
  kill -0 "$srun_pid" 2>/dev/null || break
done
echo "[$(date -Is)] training step ended with status $status (stop requested: $stop_requested)"
if [ "$stop_requested" = 1 ] && [ "$status" = 0 ]; then
  echo "[$(date -Is)] requeueing job $SLURM_JOB_ID; it resumes from $RUN_DIR/checkpoints/latest"
  scontrol requeue "$SLURM_JOB_ID" || echo "scontrol requeue failed (is --requeue allowed on this partition?)"
fi
exit "$status"
