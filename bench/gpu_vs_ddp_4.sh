#!/usr/bin/env bash
# psflow against PyTorch DistributedDataParallel on one host of 4 GPUs, in
# one run, with scaling:
#   1. PyTorch DDP over NCCL on 1, 2 and 4 GPUs (bench/pytorch_ddp.py), the
#      resnet at batch 128 per GPU and the cnn at 64, fp32, SGD;
#   2. psflow on the same GPUs with PS parameter servers on the host's CPUs
#      (8 by default: the count that served best on 2 GPUs), fp32 and bf16 on
#      the wire: 1 worker x 1 GPU, 1 worker x 2 GPUs, and on all 4 GPUs as
#      4 workers x 1 GPU, 2 workers x 2 GPUs and 1 worker x 4 GPUs; each job's
#      examples/s, scaling efficiency (examples/s / (GPUs x the 1 x 1 job's)),
#      its ratio to DDP on as many GPUs, and its step split;
#   3. the main job's recipe (cnn, 5 epochs, Adam 0.001, Fashion-MNIST) on 4
#      GPU workers at batch 32 each (the main job's global batch of 128), its
#      saved model evaluated by psflow-eval on cuda:0.
# Usage: bench/gpu_vs_ddp_4.sh [build/bin]
#   PS (8), WIRES ("fp32 bf16"), MODELS ("resnet cnn"), RESNET_STEPS (400),
#   CNN_STEPS (3000), RECIPE (1; 0 leaves part 3 out), DATA_DIR.
set -euo pipefail
bin=${1:-build/bin}
here=$(cd "$(dirname "$0")" && pwd)
ps=${PS:-8}
wires=${WIRES:-fp32 bf16}
models=${MODELS:-resnet cnn}
resnet_steps=${RESNET_STEPS:-400}
cnn_steps=${CNN_STEPS:-3000}
recipe=${RECIPE:-1}
data_dir=${DATA_DIR:-/usr/share/datasets/fashion-mnist}
export NCCL_NVLS_ENABLE=0  # NCCL's NVLink multicast stays off

source "$(dirname "${BASH_SOURCE[0]}")/lib.sh"
source "$(dirname "${BASH_SOURCE[0]}")/gpu_lib.sh"
require_gpus gpu_vs_ddp_4.sh 4 psflow-launch psflow-eval
[ -d "$data_dir" ] || { echo "gpu_vs_ddp_4.sh: no Fashion-MNIST at $data_dir (set DATA_DIR)" >&2; exit 1; }
tmp=$(mktemp -d)
trap 'rm -rf "$tmp"' EXIT

describe_machine gpu_vs_ddp_4.sh
echo "== PyTorch DDP on 1, 2 and 4 GPUs"
declare -A ddp_of
for model in $models; do
  for n in 1 2 4; do
    ddp "ddp_${model}_$n" "$n" "$model" "$(steps_of "$model")"
    ddp_of[$model,$n]=$ddp_rate
  done
done

# name|workers|--worker_devices|GPUs
shapes=("1x1|1|cuda:0|1" "1x2|1|cuda:0,cuda:1|2" "4x1|4|cuda:0,cuda:1,cuda:2,cuda:3|4"
        "2x2|2|cuda:0,cuda:1;cuda:2,cuda:3|4" "1x4|1|cuda:0,cuda:1,cuda:2,cuda:3|4")
echo "== psflow, $ps ps on $(nproc) CPU cores"
rows=()
for model in $models; do
  for wire in $wires; do
    one=0
    for shape in "${shapes[@]}"; do
      IFS='|' read -r name workers devices n <<< "$shape"
      psflow "${model}_${wire}_$name" "$workers" "$devices" "$ps" "$wire" "$model" "$(steps_of "$model")"
      [ "$name" = 1x1 ] && one=$rate
      eff=$(awk -v r="$rate" -v o="$one" -v n="$n" 'BEGIN { if (o > 0) printf "%.2f", r / (n * o); else printf "-" }')
      rows+=("$model $wire $name $n $rate $eff ${ddp_of[$model,$n]} $(ratio "$rate" "${ddp_of[$model,$n]}") $split")
    done
  done
done

if [ "$recipe" = 1 ]; then
  echo "== the main job's recipe on 4 GPU workers, batch 32 each"
  launch_job recipe --ps=2 --workers=4 --worker_devices=cuda:0,cuda:1,cuda:2,cuda:3 -- \
    --model=cnn --epochs=5 --optimizer=adam --learning_rate=0.001 --batch_size=32 \
    --data_dir="$data_dir" --log_every_steps=500
  grep -E '^\[chief\].*(done|ex/s after)' "$tmp/recipe.log" | tail -2 || true
  "$bin/psflow-eval" --saved_model="$tmp/recipe/saved_model" --device=cuda:0 \
    --data_dir="$data_dir" > "$tmp/recipe_eval.log" 2>&1 \
    || { echo "psflow-eval failed:" >&2; tail -20 "$tmp/recipe_eval.log" >&2; exit 1; }
  recipe_acc=$(sed -n 's/^accuracy: \([0-9.]*\).*/\1/p' "$tmp/recipe_eval.log")
  recipe_rate=$(ex_per_s "$tmp/recipe.log")
fi

echo
echo "psflow ($ps ps on the CPUs) against PyTorch DDP on as many GPUs; shape = workers x GPUs each;" \
  "batch per GPU: resnet 128, cnn 64; eff = ex/s / (GPUs x psflow's 1x1)"
printf '%-7s %-5s %-5s %4s %11s %5s %9s %6s %8s %6s %8s %6s %6s\n' \
  model wire shape gpus "psflow_ex/s" eff "ddp_ex/s" "÷ddp" step_ms pull compute push wait
for row in "${rows[@]}"; do
  # shellcheck disable=SC2086  # the row's fields, one argument each
  printf '%-7s %-5s %-5s %4s %11.0f %5s %9.0f %6s %8s %6s %8s %6s %6s\n' $row
done
echo
for model in $models; do
  echo "DDP $model: 1 GPU $(printf '%.0f' "${ddp_of[$model,1]}"), 2 GPUs $(printf '%.0f' "${ddp_of[$model,2]}")" \
    "($(awk -v a="${ddp_of[$model,2]}" -v b="${ddp_of[$model,1]}" 'BEGIN { printf "%.2f", a / (2 * b) }') eff)," \
    "4 GPUs $(printf '%.0f' "${ddp_of[$model,4]}")" \
    "($(awk -v a="${ddp_of[$model,4]}" -v b="${ddp_of[$model,1]}" 'BEGIN { printf "%.2f", a / (4 * b) }') eff) ex/s"
done
if [ "$recipe" = 1 ]; then
  echo "main recipe on 4 GPU workers (batch 32 each, 2 ps): test accuracy ${recipe_acc:-?}," \
    "${recipe_rate:-?} ex/s"
fi
echo "whole run: ${SECONDS} s"
