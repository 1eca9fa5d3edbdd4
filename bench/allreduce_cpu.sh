#!/usr/bin/env bash
# psflow's workers-only all-reduce on the CPU, beside PyTorch DDP over gloo and
# beside psflow's ps mode, in one run on this machine's cores: the cnn, batch
# 64 per worker, 2 workers with one compute thread each, SGD (0.05), fp32 math:
#   1. psflow all-reduce: psflow-launch --ps=0 --chief=false --workers=2
#      (worker 0 runs the chief's duties; the gradients averaged in a ring over
#      gRPC, each 1 MiB bucket sent as soon as the backward pass completes
#      it), fp32 and bf16 on the wire (--wire_dtype), and fp32 with one
#      bucket of everything (--allreduce_bucket_mb=64: sent once the whole
#      backward pass is done), which shows what the overlap gives;
#   2. psflow ps mode, for reference: psflow-launch --ps=2 --workers=2 (and a
#      chief), the same job flags, fp32 on the wire;
#   3. PyTorch DDP over gloo, 2 processes on the CPU, torch.set_num_threads(1)
#      each (bench/pytorch_ddp.py --device=cpu), the same model layer for layer
#      and the same batch, SGD and learning rate.
# psflow's jobs read Fashion-MNIST (DATA_DIR) through their input pipeline;
# DDP trains on a synthetic batch per process, made once (pytorch_ddp.py's
# inputs), so it spends no CPU on data. psflow's workers run --compute_threads=1
# (their gRPC and exchange threads besides); ps mode's 2 ps and chief share the
# same cores.
# Every contender trains WARMUP + STEPS steps and counts the STEPS after the
# warm-up: psflow's chief logs every WARMUP steps and its "ex/s after the first
# interval" leaves the first interval (start-up and warm-up) out; DDP times its
# STEPS after WARMUP untimed steps (the slowest process's time). Each runs
# ROUNDS times, every other round in the reverse order. Prints each job's
# examples/s and psflow's step split (pull, compute, push, wait in ms, of its
# last progress line), then the means over the rounds and the ratios
# all-reduce / DDP (the goal: at least 1.2) and all-reduce / ps mode.
# PyTorch: PYTHON if set (it must import torch), else python3 if it imports
# torch, else the venv TORCH_VENV (default: <bin>/../venv-torch, e.g.
# build/venv-torch), made once with torch from PyPI when it lacks it and kept
# (PyPI's Linux wheel brings its CUDA libraries: a few GB to download once).
# Usage: bench/allreduce_cpu.sh [build/bin]
#   STEPS (600), WARMUP (100; STEPS must be a multiple), ROUNDS (2), DATA_DIR
#   (the Fashion-MNIST IDX files, default Debian's package's path), PYTHON,
#   TORCH_VENV. About 3 to 8 minutes on 2 cores at the defaults (the venv's
#   first install aside).
set -euo pipefail
me=allreduce_cpu.sh
bin=${1:-build/bin}
here=$(cd "$(dirname "$0")" && pwd)
steps=${STEPS:-600}
warmup=${WARMUP:-100}
rounds=${ROUNDS:-2}
data_dir=${DATA_DIR:-/usr/share/datasets/fashion-mnist}
venv=${TORCH_VENV:-$(dirname "$bin")/venv-torch}
batch=64
workers=2

[ -d "$bin" ] || { echo "$me: no $bin: build psflow first (scripts/build.sh), or give the binaries' directory" >&2; exit 1; }
for tool in psflow-launch psflow-worker psflow-ps psflow-chief; do
  [ -x "$bin/$tool" ] || { echo "$me: no $bin/$tool: build psflow first (scripts/build.sh), or give the binaries' directory" >&2; exit 1; }
done
[ -d "$data_dir" ] || { echo "$me: no Fashion-MNIST at $data_dir (set DATA_DIR)" >&2; exit 1; }
for n in "$steps" "$warmup" "$rounds"; do
  [[ $n =~ ^[1-9][0-9]*$ ]] || { echo "$me: STEPS, WARMUP and ROUNDS must be positive integers" >&2; exit 1; }
done
[ $((steps % warmup)) = 0 ] || { echo "$me: STEPS ($steps) must be a multiple of WARMUP ($warmup)" >&2; exit 1; }

# A python3 that imports torch, in $py.
if [ -n "${PYTHON:-}" ]; then
  "$PYTHON" -c 'import torch' 2>/dev/null || { echo "$me: PYTHON=$PYTHON cannot import torch" >&2; exit 1; }
  py=$PYTHON
elif python3 -c 'import torch' 2>/dev/null; then
  py=python3
elif "$venv/bin/python" -c 'import torch' 2>/dev/null; then
  py=$venv/bin/python
else
  echo "$me: python3 has no torch; making $venv with torch from PyPI (once, kept; a few GB)" >&2
  { /usr/bin/python3 -m venv --clear "$venv" \
      && "$venv/bin/pip" install --quiet --disable-pip-version-check torch \
      && "$venv/bin/python" -c 'import torch'; } >&2 \
    || { echo "$me: could not install torch into $venv (set PYTHON to a python3 with torch)" >&2; exit 1; }
  py=$venv/bin/python
fi

tmp=$(mktemp -d)
trap 'rm -rf "$tmp"' EXIT
source "$here/lib.sh"
job_log_tail=20

# psflow NAME WIRE LAUNCHER_FLAGS... [-- JOB_FLAGS...]: one job of WARMUP +
# STEPS steps with WIRE on the wire; sets $rate (ex/s after the first
# interval) and $split ("step pull compute push wait", ms).
psflow() {
  local name=$1 wire=$2 launcher=() extra=()
  shift 2
  while [ $# -gt 0 ] && [ "$1" != -- ]; do launcher+=("$1"); shift; done
  [ $# -gt 0 ] && shift
  extra=("$@")
  launch_job "$name" "${launcher[@]}" -- --model=cnn --data_dir="$data_dir" --batch_size="$batch" \
    --train_steps=$((warmup + steps)) --log_every_steps="$warmup" --optimizer=sgd \
    --learning_rate=0.05 --compute_threads=1 --wire_dtype="$wire" "${extra[@]}"
  rate=$(ex_per_s "$tmp/$name.log")
  [ -n "$rate" ] || { echo "$me: job $name printed no examples/s:" >&2; tail -20 "$tmp/$name.log" >&2; exit 1; }
  split=$(step_split "$tmp/$name.log")
}

# ddp NAME: PyTorch DDP over gloo, 2 processes of one thread; sets $rate and
# $split (DDP's mean step in ms, the rest "-").
ddp() {
  local name=$1 ms
  "$py" "$here/pytorch_ddp.py" --device=cpu --procs="$workers" --threads=1 --model=cnn \
      --batch_size="$batch" --warmup="$warmup" --steps="$steps" --learning_rate=0.05 \
      > "$tmp/$name.log" 2>&1 \
    || { echo "$me: $name failed:" >&2; tail -30 "$tmp/$name.log" >&2; exit 1; }
  rate=$(sed -n 's/^ddp .* examples\/s=\([0-9.]*\).*/\1/p' "$tmp/$name.log")
  ms=$(sed -n 's/^ddp .* step_ms=\([0-9.]*\).*/\1/p' "$tmp/$name.log")
  [ -n "$rate" ] || { echo "$me: $name printed no examples/s:" >&2; tail -30 "$tmp/$name.log" >&2; exit 1; }
  split="${ms:--} - - - -"
}

# run CONTENDER ROUND: one job; records its figures and prints a line.
declare -A rate_of split_of
run() {
  local c=$1 r=$2
  case $c in
    ddp_gloo) ddp "${c}_r$r" ;;
    ar_fp32) psflow "${c}_r$r" fp32 --ps=0 --chief=false --workers="$workers" ;;
    ar_bf16) psflow "${c}_r$r" bf16 --ps=0 --chief=false --workers="$workers" ;;
    ar_whole) psflow "${c}_r$r" fp32 --ps=0 --chief=false --workers="$workers" -- --allreduce_bucket_mb=64 ;;
    ps_fp32) psflow "${c}_r$r" fp32 --ps=2 --workers="$workers" ;;
  esac
  rate_of[$c,$r]=$rate
  split_of[$c,$r]=$split
  printf '  %-8s %8.0f ex/s  (ms: step pull compute push wait: %s)\n' "$c" "$rate" "$split"
}

mean() {  # contender -> mean ex/s over the rounds
  local r sum=0
  for ((r = 1; r <= rounds; ++r)); do sum=$(awk -v s="$sum" -v x="${rate_of[$1,$r]}" 'BEGIN {print s + x}'); done
  awk -v s="$sum" -v n="$rounds" 'BEGIN {printf "%.1f", s / n}'
}
ratio() { awk -v a="$1" -v b="$2" 'BEGIN { if (b > 0) printf "%.2f", a / b; else printf "-" }'; }

echo "$me: cnn, batch $batch per worker, $workers workers x 1 compute thread, SGD 0.05;" \
  "$steps timed steps after $warmup, $rounds round(s)"
describe_cpu_host
echo "psflow $(git -C "$here" describe --always --dirty 2>/dev/null || echo '(no git)') ($bin);" \
  "$("$py" -c 'import torch; print("torch", torch.__version__)' 2>/dev/null || echo "torch ?") ($py)"
echo "data: psflow Fashion-MNIST ($data_dir); DDP a synthetic batch per process, made once"

order=(ddp_gloo ar_fp32 ar_bf16 ar_whole ps_fp32)
for ((r = 1; r <= rounds; ++r)); do
  echo "== round $r"
  if ((r % 2)); then
    for c in "${order[@]}"; do run "$c" "$r"; done
  else
    for ((i = ${#order[@]} - 1; i >= 0; --i)); do run "${order[i]}" "$r"; done
  fi
done

declare -A label=([ddp_gloo]="PyTorch DDP, gloo" [ar_fp32]="psflow all-reduce, fp32"
                  [ar_bf16]="psflow all-reduce, bf16" [ar_whole]="... fp32, after backward"
                  [ps_fp32]="psflow 2 ps, fp32")
echo
echo "examples/s of both workers together (mean of $rounds round(s)); step split of each round's" \
  "last progress line (DDP: its mean step)"
printf '%-24s %9s  %s\n' contender "mean_ex/s" "round: ex/s [step pull compute push wait ms]"
declare -A mean_of
for c in "${order[@]}"; do
  mean_of[$c]=$(mean "$c")
  rows=""
  for ((r = 1; r <= rounds; ++r)); do
    rows+=$(printf '  %d: %.0f [%s]' "$r" "${rate_of[$c,$r]}" "${split_of[$c,$r]}")
  done
  printf '%-24s %9.0f %s\n' "${label[$c]}" "${mean_of[$c]}" "$rows"
done

echo
echo "ratios of the means (each round's in brackets)"
for pair in "ar_fp32 ddp_gloo" "ar_bf16 ddp_gloo" "ar_fp32 ar_whole" "ar_fp32 ps_fp32" \
  "ar_bf16 ps_fp32"; do
  read -r a b <<< "$pair"
  per=""
  for ((r = 1; r <= rounds; ++r)); do per+="${per:+ }$(ratio "${rate_of[$a,$r]}" "${rate_of[$b,$r]}")"; done
  value=$(ratio "${mean_of[$a]}" "${mean_of[$b]}")
  goal=""
  if [ "$b" = ddp_gloo ]; then
    goal=$(awk -v v="$value" 'BEGIN { print (v >= 1.2 ? "  (goal >= 1.2: met)" : "  (goal >= 1.2: missed)") }')
  fi
  printf '%-26s / %-20s %5s  [%s]%s\n' "${label[$a]}" "${label[$b]}" "$value" "$per" "$goal"
done
echo "whole run: ${SECONDS} s"
