#!/usr/bin/env bash
# The chief's --slice_mb on GPU workers: resnet (batch 128 per worker,
# synthetic data, SGD), WORKERS workers (worker i on cuda:i), through PS
# parameter servers with each --slice_mb of MBS, the
# first (0: one slice per ps, the baseline) against the others, in ROUNDS
# rounds that alternate them on the same warm machine; then each setting's
# mean examples/s and its ratio to the baseline, and the GPU's own step.
# Usage: bench/gpu_slices.sh [build/bin]
#   WORKERS (1), PS (default "2": several, e.g. "2 4 8"), MBS ("0 1"),
#   WIRE ("fp32"), ROUNDS (3), STEPS (400)
set -euo pipefail
bin=${1:-build/bin}
here=$(cd "$(dirname "${BASH_SOURCE[0]}")" && pwd)
tmp=$(mktemp -d)
trap 'rm -rf "$tmp"' EXIT
data_dir=${DATA_DIR:-/usr/share/datasets/fashion-mnist}
resnet_steps=${STEPS:-400} cnn_steps=0
source "$here/lib.sh"
source "$here/gpu_lib.sh"
pses=${PS:-2} mbs=${MBS:-0 1} wire=${WIRE:-fp32} rounds=${ROUNDS:-3} workers=${WORKERS:-1}
devices=$(seq -s, -f 'cuda:%g' 0 $((workers - 1)))
gpus=$(nvidia-smi --list-gpus 2>/dev/null | wc -l) || gpus=0
[ "$gpus" -ge "$workers" ] \
  || { echo "gpu_slices.sh: WORKERS=$workers needs $workers GPUs, $gpus visible" >&2; exit 1; }
base_mb=${mbs%% *}

echo "GPUs: $(nvidia-smi --query-gpu=name --format=csv,noheader | paste -sd, - | sed 's/,/, /g'); $(nproc) CPU cores"
"$bin/psflow-bench-step" --model=resnet --batch_sizes=128 --device=cuda:0 --modes=graph \
    --steps=200 --repeats=3 2>&1 | grep '^step ' || true
for ((round = 1; round <= rounds; ++round)); do
  for ps in $pses; do
    for mb in $mbs; do
      CHIEF_ARGS="--slice_mb=$mb" psflow "r${round}_${ps}ps_mb$mb" "$workers" "$devices" "$ps" \
        "$wire" resnet "$resnet_steps"
      echo "$ps $mb $rate" >> "$tmp/rates"
    done
  done
done
echo
printf '%-6s %-10s %12s %8s\n' "ps" "slice_mb" "mean ex/s" "ratio"
for ps in $pses; do
  base=$(awk -v p="$ps" -v m="$base_mb" '$1 == p && $2 == m {s += $3; n++} END {print s / n}' \
    "$tmp/rates")
  for mb in $mbs; do
    mean=$(awk -v p="$ps" -v m="$mb" '$1 == p && $2 == m {s += $3; n++} END {print s / n}' \
      "$tmp/rates")
    printf '%-6s %-10s %12.0f %8s\n' "$ps" "$mb" "$mean" "$(ratio "$mean" "$base")"
  done
done
