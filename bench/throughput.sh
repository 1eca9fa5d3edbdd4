#!/usr/bin/env bash
# Examples/s of the cnn on Fashion-MNIST (batch 64 per worker, Adam):
#   - one worker training alone in one process (no ps), all cores;
#   - two alone workers at the same time, cores/2 threads each (their sum);
#   - synchronous psflow jobs with 1 and 2 workers against 1 and 2 ps, on
#     loopback, workers with cores/workers threads each;
# and each job's ratio to the alone figure with as many workers, and the
# context switches of all its processes per step (from the lines each logs
# at exit: every hand-off between threads costs one or two).
# Usage: bench/throughput.sh [build/bin]   (STEPS=400 by default; WORKER_ARGS:
# more flags for the jobs' workers, e.g. "--push_during_backward=false";
# PS_ARGS: for their ps, e.g. "--apply_threads=1"; CHIEF_ARGS: more job flags,
# e.g. "--wire_dtype=bf16")
set -euo pipefail
bin=${1:-build/bin}
steps=${STEPS:-400}
data_dir=${DATA_DIR:-/usr/share/datasets/fashion-mnist}
cores=$(nproc)
half=$(( cores / 2 > 0 ? cores / 2 : 1 ))
tmp=$(mktemp -d)
trap 'rm -rf "$tmp"' EXIT
source "$(dirname "${BASH_SOURCE[0]}")/lib.sh"
job_log_tail=20

alone() {  # threads -> ex/s
  "$bin/psflow-bench-alone" --data_dir="$data_dir" --threads="$1" --steps="$steps" | awk '/^alone/ {print $2}'
}

job_steps=$(( steps + 50 ))  # the first interval (50 steps) is not measured

job() {  # workers ps -> ex/s (from the chief's closing line)
  launch_job "$1x$2" --workers="$1" --ps="$2" --worker_args="${WORKER_ARGS:-}" \
      --ps_args="${PS_ARGS:-}" -- \
      --model=cnn --data_dir="$data_dir" \
      --train_steps="$job_steps" --log_every_steps=50 --batch_size=64 --optimizer=adam \
      --learning_rate=0.001 ${CHIEF_ARGS:-}
  ex_per_s "$tmp/$1x$2.log"
}

switches_per_step() {  # workers ps -> context switches per step, all processes of the job
  sed -n 's/.*context switches: \([0-9]*\) voluntary, \([0-9]*\) involuntary.*/\1 \2/p' \
    "$tmp/$1x$2.log" | awk -v steps="$job_steps" '{s += $1 + $2} END {printf "%.0f", s / steps}'
}

echo "cnn, batch 64 per worker, $steps measured steps, $cores cores"
alone1=$(alone "$cores")
alone "$half" > "$tmp/a0" & p0=$!
alone "$half" > "$tmp/a1" & p1=$!
wait $p0 $p1
alone2=$(awk '{s += $1} END {printf "%.1f", s}' "$tmp/a0" "$tmp/a1")

printf '%-34s %10s %8s %15s\n' "configuration" "ex/s" "ratio" "switches/step"
printf '%-34s %10.0f %8s %15s\n' "1 worker alone (in-process)" "$alone1" "1.00" "-"
printf '%-34s %10.0f %8s %15s\n' "2 workers alone, concurrently (sum)" "$alone2" "1.00" "-"
for w in 1 2; do
  for p in 1 2; do
    rate=$(job "$w" "$p")
    base=$([ "$w" = 1 ] && echo "$alone1" || echo "$alone2")
    ratio=$(awk -v r="$rate" -v b="$base" 'BEGIN {printf "%.2f", r / b}')
    printf '%-34s %10.0f %8s %15s\n' "$w worker(s), $p ps, synchronous" "$rate" "$ratio" \
      "$(switches_per_step "$w" "$p")"
  done
done
