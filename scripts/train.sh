#!/usr/bin/env bash
# The main job: set-up, build, then a local cluster (1 chief, 2 ps, 2 workers)
# trains the cnn on Fashion-MNIST synchronously, and psflow-eval prints the
# saved model's test accuracy. Extra arguments go to the chief, e.g.
#   scripts/train.sh --epochs=1
# DATA=tfrecord reads the same images from TFRecord shards of PNGs that
# psflow-data writes first (into $DATA_OUT, default build/data/fashion-mnist):
#   DATA=tfrecord scripts/train.sh
set -euo pipefail
cd "$(dirname "$0")/.."
bash scripts/setup.sh
bash scripts/build.sh
data_flags=()
eval_flags=()
if [ "${DATA:-idx}" = tfrecord ]; then
  out=${DATA_OUT:-build/data/fashion-mnist}
  echo "writing Fashion-MNIST as TFRecord shards of PNGs into $out"
  for split in train test; do
    build/bin/psflow-data convert --from=idx --input=/usr/share/datasets/fashion-mnist \
      --split="$split" --output="$out" --shards=4 --threads=2
  done
  data_flags=(--train_files="$out/train-*" --eval_files="$out/test-*")
  eval_flags=(--data_format=tfrecord --eval_files="$out/test-*")
elif [ "${DATA:-idx}" != idx ]; then
  echo "DATA must be idx or tfrecord, not '$DATA'" >&2
  exit 1
fi
model_dir=${MODEL_DIR:-$(mktemp -d /tmp/psflow-run.XXXXXX)}
echo "training; the model directory is $model_dir"
build/bin/psflow-launch --ps=2 --workers=2 -- \
  --model=cnn --epochs=5 --optimizer=adam --learning_rate=0.001 --batch_size=64 \
  --log_every_steps=100 --model_dir="$model_dir" ${data_flags[@]+"${data_flags[@]}"} "$@"
echo "evaluating $model_dir/saved_model on the test split"
build/bin/psflow-eval --saved_model="$model_dir/saved_model" ${eval_flags[@]+"${eval_flags[@]}"}
