#!/usr/bin/env bash
# psflow with two GPU workers against PyTorch DistributedDataParallel on the
# same two GPUs of one host, in one run:
#   1. PyTorch DDP over NCCL on cuda:0 and cuda:1 (bench/pytorch_ddp.py), the
#      resnet at batch 128 per GPU and the cnn at 64, fp32, SGD, synthetic
#      inputs that stay on the GPUs: the baseline;
#   2. psflow jobs with 2 GPU workers (cuda:0, cuda:1) and 2, 4 and 8 ps on
#      the host's CPUs (tensors through shared memory, the workers' default;
#      WORKER_ARGS=--shared_memory=false sends them over TCP on loopback), the
#      same models and batches per worker
#      (the resnet on synthetic 32x32x3 data, the cnn on Fashion-MNIST), SGD,
#      fp32 and bf16 on the wire: the chief's examples/s after the first
#      interval, its ratio to DDP's, and the step split (pull, compute, push,
#      wait) of the last progress line;
#   3. with the resnet among MODELS: one GPU worker through 2 ps (resnet b128,
#      each wire) against the same model trained alone on cuda:0
#      (psflow-bench-step's CUDA graph step, the kind of step a worker runs),
#      with PyTorch on one GPU beside it;
#   4. one worker driving both GPUs (--device=cuda:0,cuda:1: a replica per GPU,
#      gradients averaged over NCCL, one push) against one worker on one GPU
#      and two workers on one GPU each, through MULTI_PS ps, each model and
#      wire, with the DDP figure of part 1.
# Usage: bench/gpu_vs_ddp.sh [build/bin]
#   PS_COUNTS ("2 4 8"), WIRES ("fp32 bf16"), MODELS ("resnet cnn"),
#   RESNET_STEPS (400), CNN_STEPS (6000), ONE_WORKER_STEPS (320: the resnet
#   jobs of part 3), MULTI_PS (2: the ps of part 4; "none" leaves part 4 out), DATA_DIR (the Fashion-MNIST IDX files, default Debian's
#   package's path), WORKER_ARGS (more flags for every psflow worker, e.g.
#   "--push_during_backward=false" for the pushes after the step). The chief logs every eighth of a job's steps, so step
#   counts that are multiples of 8 keep the last progress line a full
#   interval. DDP runs as many timed steps as the psflow jobs, after 20 more.
set -euo pipefail
bin=${1:-build/bin}
here=$(cd "$(dirname "$0")" && pwd)
ps_counts=${PS_COUNTS:-2 4 8}
wires=${WIRES:-fp32 bf16}
models=${MODELS:-resnet cnn}
resnet_steps=${RESNET_STEPS:-400}
cnn_steps=${CNN_STEPS:-6000}
one_steps=${ONE_WORKER_STEPS:-320}
multi_ps=${MULTI_PS:-2}
data_dir=${DATA_DIR:-/usr/share/datasets/fashion-mnist}
export NCCL_NVLS_ENABLE=0  # NCCL's NVLink multicast stays off

source "$(dirname "${BASH_SOURCE[0]}")/lib.sh"
source "$(dirname "${BASH_SOURCE[0]}")/gpu_lib.sh"
require_gpus gpu_vs_ddp.sh 2 psflow-launch psflow-bench-step
for model in $models; do
  case $model in
    resnet) ;;
    cnn) [ -d "$data_dir" ] || { echo "gpu_vs_ddp.sh: no Fashion-MNIST at $data_dir (set DATA_DIR)" >&2; exit 1; } ;;
    *) echo "gpu_vs_ddp.sh: unknown model '$model' in MODELS (resnet, cnn)" >&2; exit 1 ;;
  esac
done
tmp=$(mktemp -d)
trap 'rm -rf "$tmp"' EXIT

describe_machine gpu_vs_ddp.sh
echo "== PyTorch DDP, 2 GPUs"
declare -A ddp_of
for model in $models; do
  ddp "ddp_$model" 2 "$model" "$(steps_of "$model")"
  ddp_of[$model]=$ddp_rate
done

echo "== psflow, 2 GPU workers (cuda:0, cuda:1), ps on $(nproc) CPU cores"
rows=()
for model in $models; do
  for wire in $wires; do
    for ps in $ps_counts; do
      psflow "${model}_${wire}_${ps}ps" 2 cuda:0,cuda:1 "$ps" "$wire" "$model" "$(steps_of "$model")"
      rows+=("$model $wire $ps $rate ${ddp_of[$model]} $(ratio "$rate" "${ddp_of[$model]}") $split")
    done
  done
done

one_rows=()
if [[ " $models " == *" resnet "* ]]; then
  echo "== one GPU (cuda:0), resnet b128: alone, and one worker through 2 ps"
  "$bin/psflow-bench-step" --model=resnet --batch_sizes=128 --device=cuda:0 --modes=eager,graph \
    --steps=200 --repeats=3 > "$tmp/alone.log" 2>&1 \
    || { echo "psflow-bench-step failed:" >&2; tail -30 "$tmp/alone.log" >&2; exit 1; }
  grep '^step ' "$tmp/alone.log" || true
  alone=$(sed -n 's/.* mode=graph ms=[0-9.]* examples_per_s=\([0-9]*\).*/\1/p' "$tmp/alone.log")
  alone_mode=graph
  if [ -z "$alone" ]; then  # no graph for this model and batch: workers run eager steps then
    alone=$(sed -n 's/.* mode=eager ms=[0-9.]* examples_per_s=\([0-9]*\).*/\1/p' "$tmp/alone.log")
    alone_mode=eager
  fi
  ddp torch_1gpu 1 resnet "$resnet_steps"
  torch_one=$ddp_rate
  for wire in $wires; do
    psflow "one_${wire}" 1 cuda:0 2 "$wire" resnet "$one_steps"
    one_rows+=("$wire 2 $rate ${alone:-0} $(ratio "$rate" "${alone:-0}") $split")
  done
fi

multi_rows=()
if [ "$multi_ps" != none ]; then
  echo "== one worker driving both GPUs (--device=cuda:0,cuda:1) against 2 workers x 1 GPU and 1 x 1, $multi_ps ps"
  for model in $models; do
    for wire in $wires; do
      psflow "multi_${model}_${wire}_1x1" 1 cuda:0 "$multi_ps" "$wire" "$model" "$(steps_of "$model")"
      one_one=$rate
      psflow "multi_${model}_${wire}_2x1" 2 cuda:0,cuda:1 "$multi_ps" "$wire" "$model" "$(steps_of "$model")"
      two_one=$rate
      psflow "multi_${model}_${wire}_1x2" 1 cuda:0,cuda:1 "$multi_ps" "$wire" "$model" "$(steps_of "$model")"
      multi_rows+=("$model $wire $rate $one_one $(ratio "$rate" "$one_one") $two_one $(ratio "$rate" "$two_one") ${ddp_of[$model]} $(ratio "$rate" "${ddp_of[$model]}") $split")
    done
  done
fi

echo
echo "psflow (2 GPU workers, ps on the CPUs) against PyTorch DDP (2 GPUs); batch per GPU:" \
  "resnet 128, cnn 64; ratio = psflow / DDP"
printf '%-7s %-5s %3s %12s %9s %6s %8s %6s %8s %6s %6s\n' \
  model wire ps "psflow_ex/s" "ddp_ex/s" ratio step_ms pull compute push wait
for row in "${rows[@]}"; do
  # shellcheck disable=SC2086  # the row's fields, one argument each
  printf '%-7s %-5s %3s %12.0f %9.0f %6s %8s %6s %8s %6s %6s\n' $row
done
if [ ${#one_rows[@]} -gt 0 ]; then
  echo
  echo "resnet b128 on cuda:0: psflow alone ${alone} ex/s ($alone_mode step), PyTorch alone" \
    "$(printf '%.0f' "$torch_one") ex/s; PyTorch DDP on 2 GPUs" \
    "$(ratio "${ddp_of[resnet]}" "$torch_one")x its one GPU; ratio = through the ps / psflow alone"
  printf '%-5s %3s %12s %9s %6s %8s %6s %8s %6s %6s\n' \
    wire ps "psflow_ex/s" "alone_ex/s" ratio step_ms pull compute push wait
  for row in "${one_rows[@]}"; do
    # shellcheck disable=SC2086
    printf '%-5s %3s %12.0f %9.0f %6s %8s %6s %8s %6s %6s\n' $row
  done
fi
if [ ${#multi_rows[@]} -gt 0 ]; then
  echo
  echo "one worker x 2 GPUs (1x2) against one worker x 1 GPU (1x1), 2 workers x 1 GPU (2x1) and" \
    "DDP on 2 GPUs, $multi_ps ps; batch per GPU as above; step split of the 1x2 job"
  printf '%-7s %-5s %9s %9s %6s %9s %6s %9s %6s %8s %6s %8s %6s %6s\n' \
    model wire "1x2_ex/s" "1x1_ex/s" "÷1x1" "2x1_ex/s" "÷2x1" "ddp_ex/s" "÷ddp" step_ms pull compute push wait
  for row in "${multi_rows[@]}"; do
    # shellcheck disable=SC2086
    printf '%-7s %-5s %9.0f %9.0f %6s %9.0f %6s %9.0f %6s %8s %6s %8s %6s %6s\n' $row
  done
fi
echo "whole run: ${SECONDS} s"
