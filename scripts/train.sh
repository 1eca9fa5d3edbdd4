#!/usr/bin/env bash
# The main job: set-up, build, then a local cluster (1 chief, 2 ps, 2 workers)
# trains the cnn on Fashion-MNIST synchronously, and psflow-eval prints the
# saved model's test accuracy. Extra arguments go to the chief, e.g.
#   scripts/train.sh --epochs=1
set -euo pipefail
cd "$(dirname "$0")/.."
bash scripts/setup.sh
bash scripts/build.sh
model_dir=${MODEL_DIR:-$(mktemp -d /tmp/psflow-run.XXXXXX)}
echo "training; the model directory is $model_dir"
build/bin/psflow-launch --ps=2 --workers=2 -- \
  --model=cnn --epochs=5 --optimizer=adam --learning_rate=0.001 --batch_size=64 \
  --log_every_steps=100 --model_dir="$model_dir" "$@"
echo "evaluating $model_dir/saved_model on the test split"
build/bin/psflow-eval --saved_model="$model_dir/saved_model"
