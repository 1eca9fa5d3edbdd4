#!/usr/bin/env bash
# Synchronous scaling with GPU workers, in one call:
#   1. resnet on synthetic 32x32x3 data with 1, 2 and 4 workers (the same
#      batch per worker), worker i on cuda:(i mod GPUS), PS parameter servers
#      on the host's CPUs: examples/s of each and the scaling efficiency
#      against one worker (examples/s / (workers x one worker's));
#   2. the same for the cnn on Fashion-MNIST, and the test accuracy of the
#      4-worker cnn (5 epochs, Adam), against the main job's bar.
# With GPUS=1 every worker shares one GPU: that measures the parameter
# servers and the network path, not GPU scaling.
# Usage: bench/gpu_scaling.sh [build/bin]
#   GPUS (default: nvidia-smi's count), PS (default 4), DATA_DIR, RESNET_BATCH
#   (128), RESNET_STEPS (200), CNN_BATCH (64), CNN_STEPS (2000)
set -euo pipefail
bin=${1:-build/bin}
gpus=${GPUS:-$(nvidia-smi --list-gpus | wc -l)}
ps=${PS:-4}
data_dir=${DATA_DIR:-/usr/share/datasets/fashion-mnist}
tmp=$(mktemp -d)
trap 'rm -rf "$tmp"' EXIT
source "$(dirname "${BASH_SOURCE[0]}")/lib.sh"
[ "$gpus" -ge 1 ] || { echo "no GPU" >&2; exit 1; }

devices() {  # workers -> cuda:0,cuda:1,...
  local list=() i
  for ((i = 0; i < $1; ++i)); do list+=("cuda:$((i % gpus))"); done
  (IFS=,; echo "${list[*]}")
}

job() {  # name workers chief-flags... -> ex/s after the first interval
  local name=$1 workers=$2
  shift 2
  launch_job "$name" --ps="$ps" --workers="$workers" --worker_devices="$(devices "$workers")" -- "$@"
  grep -E '^\[chief\].*step [0-9]+/' "$tmp/$name.log" | tail -1 | sed 's/^.*chief\] //' >&2
  ex_per_s "$tmp/$name.log"
}

table() {  # model rates...
  local model=$1 one=$2
  shift
  local w=1
  for rate in "$@"; do
    awk -v m="$model" -v w="$w" -v r="$rate" -v one="$one" \
      'BEGIN {printf "%-7s %8d %12.0f %11.2f\n", m, w, r, r / (w * one)}'
    w=$((w * 2))
  done
}

echo "GPUs: $gpus, ps: $ps on $(nproc) CPU cores"
rb=${RESNET_BATCH:-128} rs=${RESNET_STEPS:-200} cb=${CNN_BATCH:-64} cs=${CNN_STEPS:-2000}
declare -a resnet cnn
for w in 1 2 4; do
  resnet+=("$(job "resnet_$w" "$w" --model=resnet --data_format=synthetic --synthetic_examples=20000 \
      --batch_size="$rb" --train_steps="$rs" --log_every_steps=$((rs / 4)) --optimizer=sgd \
      --learning_rate=0.05)")
done
for w in 1 2 4; do
  # The 4-worker job trains the main job's 5 epochs, for the accuracy below.
  if [ "$w" = 4 ]; then length=(--epochs=5); else length=(--train_steps="$cs"); fi
  cnn+=("$(job "cnn_$w" "$w" --model=cnn --data_dir="$data_dir" --batch_size="$cb" "${length[@]}" \
      --log_every_steps=500 --optimizer=adam --learning_rate=0.001)")
done
echo
printf '%-7s %8s %12s %11s\n' model workers "examples/s" efficiency
table resnet "${resnet[@]}"
table cnn "${cnn[@]}"
echo "cnn, 4 workers, 5 epochs:"
"$bin/psflow-eval" --saved_model="$tmp/cnn_4/saved_model" --data_dir="$data_dir" --device=cuda:0 | grep accuracy
