#!/usr/bin/env bash
# The 1-GPU moe-sft benchmark arm in an earlier tree and in this one, on the same GPU, same workload
# and data seed, alternating (old, new, old, new) so drift hits both. A restructuring that changes no
# behaviour shows tokens/s within noise and identical losses. Usage:
#   git archive OLD_COMMIT | tar -x -C old_tree          # plain files: a worktree's .git does not travel
#   bash benchmarks/gpu/compare_trees.sh old_tree LOG_DIR
# Environment: MODEL (qwen3_30b; tiny dry-runs it on CPU), LAYERS (8), BUDGETS (4096,8192), STEPS (8),
#   WARMUP (3), ROUNDS (2). An old tree before the benchmarks/ move has tools/benchmark.py instead.
# Results: LOG_DIR/{old,new}_ROUND/benchmark.json, one log each, and a summary printed at the end.
set -uo pipefail
old=$(cd "${1:?OLD_TREE}" && pwd); log=${2:?LOG_DIR}
mkdir -p "$log"; log=$(cd "$log" && pwd)
new=$(pwd)
export PYTHONUNBUFFERED=1 NCCL_NVLS_ENABLE=0 HF_HUB_OFFLINE=1 TRANSFORMERS_OFFLINE=1
site=${SITE:-/tmp/site}
args="train --arm moe-sft --model ${MODEL:-qwen3_30b} --layers ${LAYERS:-8} --tokens-per-step 32768
      --budgets ${BUDGETS:-4096,8192} --warmup ${WARMUP:-3} --steps ${STEPS:-8} --profile-steps 0 --seed 0"

run() {  # tree name
  local tree=$1 name=$2 entry=benchmarks/benchmark.py
  [ -f "$tree/$entry" ] || entry=tools/benchmark.py
  (cd "$tree" && PYTHONPATH="$site:$tree" timeout --kill-after=30 280 python3 $entry $args --out "$log/$name" \
    > "$log/$name.log" 2>&1)
  echo "== $name: rc=$? ($tree/$entry)"
}

for round in $(seq 1 "${ROUNDS:-2}"); do
  run "$old" "old_$round"
  run "$new" "new_$round"
done
python3 - "$log" <<'PY'
import json, sys
from pathlib import Path
log = Path(sys.argv[1])
rows = {}
for f in sorted(log.glob("*_*/benchmark.json")):
    for r in json.loads(f.read_text())["runs"]:
        rows.setdefault(r["budget"], []).append((f.parent.name, r["tokens_per_s_per_gpu"], r["losses"]))
for budget, runs in sorted(rows.items()):
    for name, tps, losses in runs:
        print(f"budget {budget} {name}: {tps:,.0f} tokens/s/GPU; losses {' '.join(f'{x:.6f}' for x in losses)}")
    same = len({tuple(losses) for _, _, losses in runs}) == 1
    old = [t for n, t, _ in runs if n.startswith("old")]
    new = [t for n, t, _ in runs if n.startswith("new")]
    if old and new:
        print(f"budget {budget}: new/old tokens/s {sum(new) / len(new) / (sum(old) / len(old)):.4f}; "
              f"losses identical across all runs: {same}")
PY
