#!/usr/bin/env bash
# The weights and gradients of a synchronous step in fp32, bf16 and fp16 on
# the wire, side by side in one run on one machine: for each job, the chief's
# examples/s after the first interval, the ratio to fp32, and the step split
# of the last progress line. Then the ps's apply with 1, 2, 4 and 8 threads
# (psflow-bench-apply, the resnet's 11.2M parameters on one ps).
# Usage: bench/wire_dtype.sh [build/bin] [device]
#   device: cpu (default; the cnn only) or cuda:N (the cnn and the resnet).
#   DATA_DIR: the Fashion-MNIST IDX files (default Debian's package's path).
set -euo pipefail
bin=${1:-build/bin}
device=${2:-cpu}
data_dir=${DATA_DIR:-/usr/share/datasets/fashion-mnist}
tmp=$(mktemp -d)
trap 'rm -rf "$tmp"' EXIT
source "$(dirname "${BASH_SOURCE[0]}")/lib.sh"

compare() {  # title steps -- chief flags...
  local title=$1 steps=$2 base=""
  shift 3
  echo "== $title: 1 worker on $device, 2 ps, $steps steps"
  printf '%-6s %10s %8s  %s\n' wire "ex/s" "x fp32" "last progress line's step split"
  for wire in fp32 bf16 fp16; do
    local name="${title// /_}_$wire"
    launch_job "$name" --ps=2 --workers=1 --worker_devices="$device" -- --data_dir="$data_dir" \
      --train_steps="$steps" --log_every_steps=$((steps / 6)) --wire_dtype="$wire" "$@"
    local rate split
    rate=$(ex_per_s "$tmp/$name.log")
    split=$(grep -E '^\[chief\].* step [0-9]+/' "$tmp/$name.log" | tail -1 | sed 's/.*| \(step [^|]*\)|.*/\1/')
    [ -n "$base" ] || base=$rate
    printf '%-6s %10s %8s  %s\n' "$wire" "$rate" "$(awk -v a="$rate" -v b="$base" 'BEGIN{printf "%.2f", a/b}')" "$split"
  done
}

compare "cnn b64" 1200 -- --model=cnn --batch_size=64 --optimizer=sgd --learning_rate=0.05
if [ "$device" != cpu ]; then
  compare "resnet b128" 300 -- --model=resnet --data_format=synthetic --synthetic_examples=20000 \
    --batch_size=128 --optimizer=sgd --learning_rate=0.05
fi
echo "== ps apply of 11.2M floats (adam), 2 workers' pushes"
"$bin/psflow-bench-apply" --threads=1,2,4,8 --floats=11200000 --optimizer=adam --iterations=10
