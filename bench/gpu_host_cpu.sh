#!/usr/bin/env bash
# Where the host's CPU goes while one GPU worker trains through the ps: a
# psflow-launch job (one worker on DEVICE, PS ps, the resnet at batch 128 on
# synthetic data, SGD, WIRE on the wire) and, after WARMUP seconds, over
# SECONDS_MEASURED seconds of its steady state:
#   - the cores each process used (user + system time of all its threads,
#     from /proc/PID/task/*/stat) and its context switches a second;
#   - its busiest threads;
#   - with perf on PATH (and allowed to attach), the hottest symbols of one ps
#     and of the worker (perf record -F 999; stripped binaries show
#     addresses: look them up with addr2line in the same build's unstripped
#     binaries).
# The chief's last progress lines (examples/s, step split) close the output.
# Usage: bench/gpu_host_cpu.sh [build/bin]
#   PS (2), WIRE (fp32), STEPS (4000), WARMUP (20), SECONDS_MEASURED (5),
#   WORKER_ARGS (more worker flags, e.g. --ps_lanes=4), PS_ARGS (more ps
#   flags, e.g. --apply_threads=4), DEVICE (cuda:0; cpu
#   works too, slowly: set fewer STEPS)
set -euo pipefail
bin=${1:-build/bin}
ps=${PS:-2}
wire=${WIRE:-fp32}
steps=${STEPS:-4000}
warmup=${WARMUP:-20}
measured=${SECONDS_MEASURED:-5}
device=${DEVICE:-cuda:0}
[ -x "$bin/psflow-launch" ] || { echo "gpu_host_cpu.sh: no $bin/psflow-launch (give the binaries' directory)" >&2; exit 1; }
if [ "$device" != cpu ]; then
  nvidia-smi --list-gpus >/dev/null 2>&1 || { echo "gpu_host_cpu.sh: no GPU visible (DEVICE=cpu for a CPU worker)" >&2; exit 1; }
fi
tmp=$(mktemp -d)
launcher=
cleanup() {
  local code=$?
  if [ -n "$launcher" ]; then
    kill "$launcher" 2>/dev/null || true
    wait "$launcher" 2>/dev/null || true
  fi
  rm -rf "$tmp"
  exit "$code"
}
trap cleanup EXIT

gpu=$( [ "$device" = cpu ] || nvidia-smi --query-gpu=name --format=csv,noheader | head -1)
echo "worker on $device${gpu:+ ($gpu)}; $(nproc) CPU cores; $ps ps, wire $wire," \
  "${WORKER_ARGS:+worker args $WORKER_ARGS, }${PS_ARGS:+ps args $PS_ARGS, }resnet b128"
"$bin/psflow-launch" --ps="$ps" --workers=1 --worker_devices="$device" \
  --worker_args="${WORKER_ARGS:-}" --ps_args="${PS_ARGS:-}" -- --model_dir="$tmp/model" \
  --model=resnet --data_format=synthetic --synthetic_examples=20000 --batch_size=128 \
  --train_steps="$steps" --log_every_steps=$((steps / 8)) --optimizer=sgd --learning_rate=0.05 \
  --wire_dtype="$wire" > "$tmp/job.log" 2>&1 &
launcher=$!
sleep "$warmup"
kill -0 "$launcher" 2>/dev/null || { echo "the job ended before the measurement:" >&2; tail -20 "$tmp/job.log" >&2; exit 1; }
# This job's members have its chief's address on their command lines.
marker=$(sed -n 's/^\[launch\] cluster: chief \([^,]*\),.*/--chief_hosts=\1/p' "$tmp/job.log" | head -1)
# The job's processes, by role: "role index pid" lines (this job's alone: its chief address).
members() {
  local pid cmd
  for pid in $(pgrep -f -- "--job_name=(ps|worker) "); do
    cmd=$(tr '\0' ' ' 2>/dev/null < /proc/"$pid"/cmdline) || continue
    [ -z "$marker" ] || [[ "$cmd " == *"$marker "* ]] || continue
    if [[ $cmd =~ --job_name=([a-z]+)\ --task_id=([0-9]+) ]]; then
      echo "${BASH_REMATCH[1]} ${BASH_REMATCH[2]} $pid"
    fi
  done
  return 0
}
members > "$tmp/members"
[ -s "$tmp/members" ] || { echo "gpu_host_cpu.sh: found none of the job's ps and workers" >&2; exit 1; }
# utime + stime (clock ticks) in a /proc stat file; fails if it is gone.
ticks_of() {
  local stat
  stat=$(cat "$1" 2>/dev/null) || return 1
  stat=${stat##*) }  # the fields after the command name: state is the first
  # shellcheck disable=SC2086  # one field each
  set -- $stat
  echo $(( ${12} + ${13} ))
}
# "P pid ticks" for each process (its threads that exited included), and
# "T pid tid ticks switches comm" for each of its threads alive now.
snapshot() {
  local role index pid t ticks switches comm
  while read -r role index pid; do
    ticks=$(ticks_of /proc/"$pid"/stat) && echo "P $pid $ticks"
    for t in /proc/"$pid"/task/*; do
      ticks=$(ticks_of "$t"/stat) || continue
      switches=$(awk '/^(non)?voluntary_ctxt_switches/ {s += $2} END {print s + 0}' "$t"/status 2>/dev/null) || continue
      comm=$(cat "$t"/comm 2>/dev/null) || continue
      echo "T $pid ${t##*/} $ticks $switches ${comm// /_}"
    done
  done < "$tmp/members"
}
snapshot > "$tmp/before"
t0=$(date +%s%N)
sleep "$measured"
snapshot > "$tmp/after"
t1=$(date +%s%N)
hz=$(getconf CLK_TCK)
awk -v hz="$hz" -v secs="$(( (t1 - t0) / 1000000 ))" -v members="$tmp/members" '
  BEGIN { secs /= 1000; while ((getline line < members) > 0) { split(line, m, " "); name[m[3]] = m[1] m[2] } }
  FNR == NR && $1 == "P" { proc[$2] = $3; next }
  FNR == NR { ticks[$2 " " $3] = $4; sw[$2 " " $3] = $5; next }
  $1 == "P" && ($2 in proc) { cores[$2] = ($3 - proc[$2]) / hz / secs; next }
  $1 == "T" && !(($2 " " $3) in ticks) { started[$2]++; next }
  $1 == "T" {
    c = ($4 - ticks[$2 " " $3]) / hz / secs; s = ($5 - sw[$2 " " $3]) / secs
    switches[$2] += s
    if (c >= 0.05) printf "thread %s %s %s %.2f cores %.0f switches/s\n", name[$2], $3, $6, c, s > "/dev/stderr"
  }
  END {
    printf "over %.1f s (context switches: of the threads alive at both ends):\n", secs
    for (p in cores) {
      printf "  %-8s %5.2f cores, %7.0f context switches/s, %d threads started\n", name[p], cores[p], switches[p], started[p]
      total += cores[p]
    }
    printf "  all      %5.2f cores\n", total
  }' "$tmp/before" "$tmp/after" 2> "$tmp/threads"
echo "busiest threads:"
sort -k5 -nr "$tmp/threads" | head -12 | sed 's/^thread /  /'
if command -v perf >/dev/null 2>&1; then
  for role in "ps 0" "worker 0"; do
    pid=$(awk -v r="${role% *}" -v i="${role#* }" '$1 == r && $2 == i {print $3}' "$tmp/members")
    [ -n "$pid" ] || continue
    echo "perf, ${role/ /}:"
    if perf record -F 999 -p "$pid" -o "$tmp/perf.data" -- sleep 3 > /dev/null 2>&1; then
      report=$(perf report -i "$tmp/perf.data" --no-children --sort dso,sym --stdio 2> /dev/null \
        | grep -E '^ +[0-9]' | head -15 || true)
      echo "${report:-  no samples}"
    else
      echo "  perf could not attach (perf_event_paranoid?)"
    fi
  done
fi
wait "$launcher" || { echo "the job failed:" >&2; tail -20 "$tmp/job.log" >&2; exit 1; }
launcher=
grep -E 'chief\] (step|done)' "$tmp/job.log" | tail -3 || true
