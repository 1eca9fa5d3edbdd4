#!/usr/bin/env bash
# Does the input pipeline hide behind a GPU's compute? The resnet (3x32x32)
# on one GPU worker through 2 ps, fed once from synthetic data made in memory
# and once from TFRecord shards of JPEGs streamed through data::Pipeline
# (decode, random resized crop to 32x32, flip, --input_threads threads), in
# alternating rounds; prints each job's examples/s and the ratio. The JPEGs
# are Fashion-MNIST's training images (gray, 28x28: decoded to RGB and
# resized up), written by psflow-data. PS=0: the worker alone, without ps or
# chief, on its own replica on the GPU (a faster step to hide behind).
# Usage: bench/gpu_input.sh [build/bin] [cuda:0]   (STEPS, ROUNDS, INPUT_THREADS, PS to change)
set -euo pipefail
bin=${1:-build/bin}
device=${2:-cuda:0}
here=$(cd "$(dirname "$0")" && pwd)
source "$here/lib.sh"
steps=${STEPS:-400}
ps=${PS:-2}
cluster=(--ps="$ps")
[ "$ps" = 0 ] && cluster+=(--chief=false)
rounds=${ROUNDS:-2}
data_dir=${DATA_DIR:-/usr/share/datasets/fashion-mnist}
tmp=$(mktemp -d)
trap 'rm -rf "$tmp"' EXIT
for tool in psflow-launch psflow-data; do
  [ -x "$bin/$tool" ] || { echo "gpu_input.sh: no $bin/$tool" >&2; exit 1; }
done
nvidia-smi --query-gpu=name,driver_version --format=csv,noheader || true
echo "$(nproc) CPU cores"

"$bin/psflow-data" convert --from=idx --input="$data_dir" --split=train --image_format=jpeg \
  --jpeg_quality=90 --output="$tmp/jpeg" --shards=16 --threads="$(nproc)"

job() {  # name data-flags...
  local name=$1
  shift
  launch_job "$name" "${cluster[@]}" --workers=1 --worker_devices="$device" \
    --worker_args="${INPUT_THREADS:+--input_threads=$INPUT_THREADS}" -- \
    --model=resnet --batch_size=128 --train_steps="$steps" --log_every_steps=$((steps / 8)) \
    --optimizer=sgd --learning_rate=0.05 "$@"
  rate=$(ex_per_s "$tmp/$name.log")
  echo "$name: ${rate:-0} ex/s, step $(step_split "$tmp/$name.log") (ms: step pull compute push wait)"
}

declare -A sum
for round in $(seq 1 "$rounds"); do
  job "synthetic.r$round" --data_format=synthetic --synthetic_examples=60000
  sum[synthetic]=$(awk -v a="${sum[synthetic]:-0}" -v b="$rate" 'BEGIN { print a + b }')
  job "tfrecord.r$round" --train_files="$tmp/jpeg/train-*" --augment --shuffle_buffer=10000 \
    --prefetch_batches=4
  sum[tfrecord]=$(awk -v a="${sum[tfrecord]:-0}" -v b="$rate" 'BEGIN { print a + b }')
  grep -o 'worker0\] input: .*' "$tmp/tfrecord.r$round.log" | tail -1 || true
done
awk -v s="${sum[synthetic]}" -v t="${sum[tfrecord]}" -v r="$rounds" 'BEGIN {
  printf "mean over %d rounds: synthetic %.0f ex/s, tfrecord JPEGs %.0f ex/s, ratio %.3f (goal >= 0.9)\n",
         r, s / r, t / r, t / s }'
