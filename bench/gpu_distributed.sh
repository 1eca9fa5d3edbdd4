#!/usr/bin/env bash
# psflow jobs with GPU workers and parameter servers on the host's CPUs, on
# loopback, showing where a synchronous step's time goes when the weights
# cross the network every step: the chief's progress lines give, per step,
# pull, compute, push and wait (for the other workers and the ps's update)
# and the examples/s.
#   1. cnn on Fashion-MNIST, 1 GPU worker, 2 ps, batch 64 and 512;
#   2. resnet on synthetic 32x32x3 data, 1 GPU worker, 2 ps, batch 128;
#   3. the main job's recipe (cnn, 2 workers, 2 ps, 5 epochs, Adam) with both
#      workers on the GPU, then psflow-eval's test accuracy of the result.
# Usage: bench/gpu_distributed.sh [build/bin] [cuda:0]
#   DATA_DIR: the Fashion-MNIST IDX files (default Debian's package's path).
set -euo pipefail
bin=${1:-build/bin}
device=${2:-cuda:0}
data_dir=${DATA_DIR:-/usr/share/datasets/fashion-mnist}
tmp=$(mktemp -d)
trap 'rm -rf "$tmp"' EXIT
source "$(dirname "${BASH_SOURCE[0]}")/lib.sh"

job() {  # name workers -- chief flags...
  local name=$1 workers=$2
  shift 3
  echo "== $name: $workers worker(s) on $device, 2 ps"
  # A failure is reported on stdout, among the progress lines.
  launch_job "$name" --ps=2 --workers="$workers" --worker_devices="$device" -- --data_dir="$data_dir" "$@" 2>&1
  grep -E '^\[chief\].*(step [0-9]+/|done:)' "$tmp/$name.log"
}

job cnn_b64 1 -- --model=cnn --batch_size=64 --train_steps=3000 --log_every_steps=500 \
    --optimizer=sgd --learning_rate=0.05
job cnn_b512 1 -- --model=cnn --batch_size=512 --train_steps=600 --log_every_steps=100 \
    --optimizer=sgd --learning_rate=0.05
job resnet_b128 1 -- --model=resnet --data_format=synthetic --synthetic_examples=20000 --batch_size=128 \
    --train_steps=300 --log_every_steps=50 --optimizer=sgd --learning_rate=0.05
"$bin/psflow-eval" --saved_model="$tmp/resnet_b128/saved_model" --data_format=synthetic --device="$device"
job cnn_main 2 -- --model=cnn --epochs=5 --optimizer=adam --learning_rate=0.001 --batch_size=64 \
    --log_every_steps=1000
"$bin/psflow-eval" --saved_model="$tmp/cnn_main/saved_model" --data_dir="$data_dir" --device="$device"
