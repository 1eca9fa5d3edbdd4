#!/usr/bin/env bash
# psflow without ps (two GPU workers that all-reduce their gradients, each
# holding a replica) against PyTorch DistributedDataParallel over NCCL on
# the same two GPUs of one host, in one run:
#   1. PyTorch DDP over NCCL on cuda:0 and cuda:1 (bench/pytorch_ddp.py): the
#      resnet at batch 128 per GPU and the cnn at 64, fp32, SGD;
#   2. psflow, 2 GPU workers and no ps (psflow-launch --ps=0; a chief process
#      coordinates), the same models and batches, SGD, fp32 and bf16 as the
#      wire dtype (the dtype the gradients' NCCL average runs in):
#      examples/s, the ratio to DDP, and the step split of the last progress
#      line (compute = the step's CUDA graph; push = the NCCL average, the
#      count of non-finite values and the optimizer on the GPU);
#   3. psflow with the same 2 workers through REF_PS ps (fp32), for reference.
# Usage: bench/gpu_allreduce.sh [build/bin]
#   MODELS ("resnet cnn"), WIRES ("fp32 bf16"), RESNET_STEPS (240),
#   CNN_STEPS (1600), REF_PS (8; "none" leaves part 3 out), DATA_DIR.
set -euo pipefail
bin=${1:-build/bin}
here=$(cd "$(dirname "$0")" && pwd)
models=${MODELS:-resnet cnn}
wires=${WIRES:-fp32 bf16}
resnet_steps=${RESNET_STEPS:-240}
cnn_steps=${CNN_STEPS:-1600}
ref_ps=${REF_PS:-8}
data_dir=${DATA_DIR:-/usr/share/datasets/fashion-mnist}
export NCCL_NVLS_ENABLE=0  # NCCL's NVLink multicast stays off

source "$(dirname "${BASH_SOURCE[0]}")/lib.sh"
source "$(dirname "${BASH_SOURCE[0]}")/gpu_lib.sh"
require_gpus gpu_allreduce.sh 2 psflow-launch
tmp=$(mktemp -d)
trap 'rm -rf "$tmp"' EXIT

describe_machine gpu_allreduce.sh
for model in $models; do
  steps=$(steps_of "$model")
  echo "== $model, batch $(batch_of "$model") per GPU, $steps steps"
  ddp "ddp_$model" 2 "$model" "$steps"
  base=$ddp_rate
  for wire in $wires; do
    psflow "ar_${model}_$wire" 2 "cuda:0;cuda:1" 0 "$wire" "$model" "$steps"
    echo "  psflow all-reduce $wire / DDP: $(ratio "$rate" "$base")"
  done
  if [ "$ref_ps" != none ]; then
    psflow "ps_${model}_fp32" 2 "cuda:0;cuda:1" "$ref_ps" fp32 "$model" "$steps"
    echo "  psflow $ref_ps ps fp32 / DDP: $(ratio "$rate" "$base")"
  fi
done
