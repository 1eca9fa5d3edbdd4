#!/usr/bin/env bash
# Two or more settings of one CPU job, alternating round by round on one
# machine: where its load moves (the 2-core development VM's cluster jobs
# moved by a fifth from one day to the next), only settings run in turn say
# which is faster. Each round runs every setting once, in the order given:
# a job of the cnn on Fashion-MNIST (batch 64 per worker, Adam), WORKERS
# workers and PS ps on loopback. For each job: the chief's examples/s after
# the first interval, the context switches of all its processes per step,
# the CPU its workers (each) and its ps (all together) used per step, and the
# step split of its last progress line; at the end, each setting's mean
# examples/s, its range, the rounds it won against the first setting, and the
# ratio of its mean to the first's.
# Usage: bench/cpu_ab.sh ROUNDS SETTING SETTING...
#   SETTING: "name|bin_dir|worker flags|ps flags" (bin_dir empty: build/bin),
#   e.g. "during|||" "after||--push_during_backward=false|", or two builds:
#   "old|/tmp/old/bin||" "new|build/bin||".
#   STEPS (default 1000), WORKERS (2), PS (2), CHIEF_ARGS (more job flags),
#   DATA_DIR (Debian's package's path).
set -euo pipefail
[ $# -ge 3 ] || { sed -n '2,/^set /p' "$0" | sed '$d; s/^# \{0,1\}//' >&2; exit 1; }
rounds=$1
shift
[[ "$rounds" =~ ^[1-9][0-9]*$ ]] || { echo "ROUNDS must be a positive integer, not '$rounds'" >&2; exit 1; }
steps=${STEPS:-1000}
workers=${WORKERS:-2}
ps=${PS:-2}
data_dir=${DATA_DIR:-/usr/share/datasets/fashion-mnist}
tmp=$(mktemp -d)
trap 'rm -rf "$tmp"' EXIT
source "$(dirname "${BASH_SOURCE[0]}")/lib.sh"
job_log_tail=20
job_steps=$((steps + 50))  # the first interval (50 steps) is not measured

names=()
for setting in "$@"; do
  IFS='|' read -r name dir wargs pargs <<< "$setting"
  [[ "$name" =~ ^[A-Za-z0-9_.-]+$ ]] || { echo "setting '$setting': the name must be a word" >&2; exit 1; }
  [ -x "${dir:-build/bin}/psflow-launch" ] || { echo "setting '$name': no ${dir:-build/bin}/psflow-launch" >&2; exit 1; }
  names+=("$name")
done

describe_cpu_host
echo "cnn, batch 64 per worker, $workers worker(s), $ps ps, $steps measured steps, $rounds round(s)"
fmt='%-6s %-16s %9s %14s %13s %10s  %s\n'
printf "$fmt" round setting "ex/s" "switches/step" "worker CPU ms" "ps CPU ms" "step (pull compute push wait) ms"
for r in $(seq "$rounds"); do
  for setting in "$@"; do
    IFS='|' read -r name dir wargs pargs <<< "$setting"
    bin=${dir:-build/bin}
    rm -rf "${tmp:?}/$name"
    launch_job "$name" --workers="$workers" --ps="$ps" --worker_args="$wargs" --ps_args="$pargs" -- \
      --model=cnn --data_dir="$data_dir" --train_steps="$job_steps" --log_every_steps=50 \
      --batch_size=64 --optimizer=adam --learning_rate=0.001 ${CHIEF_ARGS:-}
    log="$tmp/$name.log"
    rate=$(ex_per_s "$log")
    read -r step pull compute push wait <<< "$(step_split "$log")"
    printf "$fmt" "$r" "$name" "$(printf %.0f "${rate:-0}")" "$(switches_per_step "$log" "$job_steps")" \
      "$(cpu_per_step "$log" "$job_steps" worker 1)" "$(cpu_per_step "$log" "$job_steps" ps 0)" "$step ($pull $compute $push $wait)"
    printf '%s %s %s\n' "$r" "$name" "${rate:-0}" >> "$tmp/rates"
  done
done
echo "setting           mean ex/s  range            rounds ahead of ${names[0]}  mean ÷ ${names[0]}'s"
awk -v first="${names[0]}" -v order="${names[*]}" '
  {rate[$1, $2] = $3; sum[$2] += $3; n[$2]++
   if (!($2 in lo) || $3 < lo[$2]) lo[$2] = $3
   if (!($2 in hi) || $3 > hi[$2]) hi[$2] = $3
   rounds[$1] = 1}
  END {
    k = split(order, names, " ")
    for (i = 1; i <= k; i++) {
      s = names[i]; ahead = 0; total = 0
      for (r in rounds) if (s != first) {total++; if (rate[r, s] > rate[r, first]) ahead++}
      printf "%-17s %9.0f  %6.0f-%-8.0f %s %14.3f\n", s, sum[s] / n[s], lo[s], hi[s],
        (s == first ? "      -" : sprintf("%3d of %-3d", ahead, total)), (sum[s] / n[s]) / (sum[first] / n[first])
    }
  }' "$tmp/rates"
