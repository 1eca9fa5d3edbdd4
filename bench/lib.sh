# Shared by the bench scripts that run psflow-launch jobs (sourced, not run).
# They set $bin (the directory of the psflow binaries) and $tmp (a scratch
# directory) before calling these.

# launch_job NAME LAUNCHER_FLAGS... -- CHIEF_FLAGS...
#   Runs "$bin/psflow-launch" LAUNCHER_FLAGS -- --model_dir="$tmp/NAME"
#   CHIEF_FLAGS, its whole output in "$tmp/NAME.log". If the job fails, prints
#   "job NAME failed:" and the log's last $job_log_tail (default 30) lines on
#   stderr and exits 1.
launch_job() {
  local name=$1 launcher=()
  shift
  while [ $# -gt 0 ] && [ "$1" != -- ]; do launcher+=("$1"); shift; done
  shift
  "$bin/psflow-launch" "${launcher[@]}" -- --model_dir="$tmp/$name" "$@" > "$tmp/$name.log" 2>&1 \
    || { echo "job $name failed:" >&2; tail -"${job_log_tail:-30}" "$tmp/$name.log" >&2; exit 1; }
}

# ex_per_s LOG: the examples/s of the chief's closing line in a job's log
# ("... <rate> ex/s after the first interval ...").
ex_per_s() {
  sed -n 's/.* \([0-9.]*\) ex\/s after the first interval.*/\1/p' "$1"
}

# switches_per_step LOG STEPS: the context switches of all the job's
# processes per step (from the lines each logs at exit).
switches_per_step() {
  sed -n 's/.*context switches: \([0-9]*\) voluntary, \([0-9]*\) involuntary.*/\1 \2/p' "$1" |
    awk -v steps="$2" '{s += $1 + $2} END {printf "%.0f", s / steps}'
}

# cpu_per_step LOG STEPS ROLE EACH: ms of CPU per step of the job's ROLE
# processes (worker or ps), each on average (EACH=1) or all together (0);
# "-" if none logged it.
cpu_per_step() {
  sed -n "s/^\[$3[0-9]*\] .* used \([0-9.]*\) s of CPU.*/\1/p" "$1" |
    awk -v steps="$2" -v each="$4" '{s += $1; n++}
      END {if (n == 0) printf "-"; else printf "%.1f", 1000 * s / steps / (each ? n : 1)}'
}

# step_split LOG: "step pull compute push wait" (ms) of the last progress line
# of the process running the chief's duties ("[chief]", or "[worker0]" in a
# job without a chief); "- - - - -" if the log has none.
step_split() {
  local split
  split=$( (grep -E '^\[(chief|worker0)\] .*\| step [0-9.]+ ms \(pull ' "$1" || true) | tail -1 | sed -n \
    's/.*| step \([0-9.]*\) ms (pull \([0-9.]*\) compute \([0-9.]*\) push \([0-9.]*\) wait \([0-9.]*\)).*/\1 \2 \3 \4 \5/p')
  echo "${split:-- - - - -}"
}

# describe_cpu_host: one line on the CPU, cores, memory and load of this host.
describe_cpu_host() {
  local cpu mem load
  cpu=$(sed -n 's/^model name[[:space:]]*: //p' /proc/cpuinfo 2>/dev/null | head -1)
  mem=$(awk '/^MemTotal:/ {printf "%.0f GiB", $2 / 1048576}' /proc/meminfo 2>/dev/null)
  load=$(cut -d' ' -f1-3 /proc/loadavg 2>/dev/null)
  echo "host: ${cpu:-unknown CPU}; $(nproc) cores; ${mem:-? GiB} memory; load average ${load:-?};" \
    "$(uname -sr)"
}
