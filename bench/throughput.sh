#!/usr/bin/env bash
# Examples/s of the cnn on Fashion-MNIST (batch 64 per worker, Adam):
#   - one worker training alone in one process (no ps), all cores;
#   - two alone workers at the same time, cores/2 threads each (their sum);
#   - synchronous psflow jobs with 1 and 2 workers against 1 and 2 ps, on
#     loopback, workers with cores/workers threads each;
# and each job's ratio to the alone figure with as many workers, the context
# switches of all its processes per step, and the CPU its workers (each) and
# its ps (all together) used per step (from the lines each process logs at
# exit, start and end of the job included: every hand-off between threads
# costs a switch or two, and the ps' CPU and the workers' beyond an alone
# step's are what the exchange takes from the cores).
# Usage: bench/throughput.sh [build/bin]   (STEPS=400 by default; WORKER_ARGS:
# more flags for the jobs' workers, e.g. "--push_during_backward=false";
# PS_ARGS: for their ps, e.g. "--apply_threads=1"; CHIEF_ARGS: more job flags,
# e.g. "--wire_dtype=bf16"; ROUNDS=n: the whole table n times, one after the
# other, then each job's ratios of every round and their median: on a
# machine whose load moves, one round's ratio can be a tenth off)
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
  rm -rf "${tmp:?}/$1x$2"  # an earlier round's checkpoints would end the job at once
  launch_job "$1x$2" --workers="$1" --ps="$2" --worker_args="${WORKER_ARGS:-}" \
      --ps_args="${PS_ARGS:-}" -- \
      --model=cnn --data_dir="$data_dir" \
      --train_steps="$job_steps" --log_every_steps=50 --batch_size=64 --optimizer=adam \
      --learning_rate=0.001 ${CHIEF_ARGS:-}
  ex_per_s "$tmp/$1x$2.log"
}

rounds=${ROUNDS:-1}
[[ "$rounds" =~ ^[1-9][0-9]*$ ]] || { echo "ROUNDS must be a positive integer, not '$rounds'" >&2; exit 1; }
fmt='%-34s %10s %8s %15s %13s %10s\n'

one_round() {  # round: prints its table; appends "configuration<TAB>ratio" lines to $tmp/ratios
  local alone1 alone2 p0 p1 w p rate base ratio name
  alone1=$(alone "$cores")
  alone "$half" > "$tmp/a0" & p0=$!
  alone "$half" > "$tmp/a1" & p1=$!
  wait $p0 $p1
  alone2=$(awk '{s += $1} END {printf "%.1f", s}' "$tmp/a0" "$tmp/a1")
  [ "$rounds" = 1 ] || echo "round $1 of $rounds"
  printf "$fmt" "configuration" "ex/s" "ratio" "switches/step" "worker CPU ms" "ps CPU ms"
  # Each of two alone workers' CPU per step: its step's time on its threads
  # (busy throughout).
  printf "$fmt" "1 worker alone (in-process)" "$(printf %.0f "$alone1")" "1.00" "-" "-" "-"
  printf "$fmt" "2 workers alone, concurrently (sum)" "$(printf %.0f "$alone2")" "1.00" "-" \
    "$(awk -v r="$alone2" -v t="$half" 'BEGIN {printf "%.1f", 1000 * 64 * 2 * t / r}')" "-"
  for w in 1 2; do
    for p in 1 2; do
      rate=$(job "$w" "$p")
      base=$([ "$w" = 1 ] && echo "$alone1" || echo "$alone2")
      ratio=$(awk -v r="$rate" -v b="$base" 'BEGIN {printf "%.2f", r / b}')
      name="$w worker(s), $p ps, synchronous"
      printf "$fmt" "$name" "$(printf %.0f "$rate")" "$ratio" \
        "$(switches_per_step "$tmp/${w}x$p.log" "$job_steps")" \
        "$(cpu_per_step "$tmp/${w}x$p.log" "$job_steps" worker 1)" \
        "$(cpu_per_step "$tmp/${w}x$p.log" "$job_steps" ps 0)"
      printf '%s\t%s\n' "$name" "$ratio" >> "$tmp/ratios"
    done
  done
}

echo "cnn, batch 64 per worker, $steps measured steps, $cores cores"
for r in $(seq "$rounds"); do one_round "$r"; done
if [ "$rounds" -gt 1 ]; then
  echo "ratios to the alone workers, round by round, and their median"
  awk -F '\t' '{if (!($1 in seen)) {seen[$1] = 1; order[++n] = $1}; v[$1] = v[$1] " " $2}
    END {for (i = 1; i <= n; i++) {
      k = split(substr(v[order[i]], 2), a, " ")
      for (x = 1; x <= k; x++) for (y = x + 1; y <= k; y++) if (a[y] < a[x]) {t = a[x]; a[x] = a[y]; a[y] = t}
      m = k % 2 ? a[(k + 1) / 2] : (a[k / 2] + a[k / 2 + 1]) / 2
      printf "%-34s %s   median %.2f\n", order[i], substr(v[order[i]], 2), m}}' "$tmp/ratios"
fi
