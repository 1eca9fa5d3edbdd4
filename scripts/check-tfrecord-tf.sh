#!/usr/bin/env bash
# Checks that psflow's TFRecord files and TensorFlow's are the same format,
# both ways, against tensorflow-cpu from PyPI (scripts/tfrecord_tf_check.py
# says what is compared): TensorFlow's tf.Example records, plain and GZIP,
# read by psflow-data inspect and psflow-check-tfrecord value for value and
# pixel for pixel; psflow-data's Fashion-MNIST shards, plain and gzip, read
# by tf.data with every pixel and label equal to the IDX files'.
# Not a ctest (it needs PyPI): run it by hand after building.
# Usage: scripts/check-tfrecord-tf.sh [build]   (IDX_DIR: the Fashion-MNIST
# folder, /usr/share/datasets/fashion-mnist by default)
# Makes (or reuses) the venv <build>/venv-tf; builds psflow-data and
# psflow-check-tfrecord if missing. Exits 1 on any mismatch.
set -euo pipefail
cd "$(dirname "$0")/.."
build=${1:-build}
venv=$build/venv-tf
idx_dir=${IDX_DIR:-/usr/share/datasets/fashion-mnist}

if ! "$venv/bin/python" -c "import tensorflow" 2>/dev/null; then
  python3 -m venv "$venv"
  "$venv/bin/pip" install -q --upgrade pip
  "$venv/bin/pip" install -q tensorflow-cpu
fi
for target in psflow-data psflow-check-tfrecord; do
  [ -x "$build/bin/$target" ] ||
    flock /tmp/psflow-build.lock cmake --build "$build" -j2 --target "$target" >/dev/null
done

work=$(mktemp -d)
trap 'rm -rf "$work"' EXIT
TF_CPP_MIN_LOG_LEVEL=2 "$venv/bin/python" scripts/tfrecord_tf_check.py \
  --bin="$build/bin" --work="$work" --idx="$idx_dir"
