#!/usr/bin/env bash
# Training-step time on a GPU, psflow beside PyTorch eager, in one run:
# forward, backward and SGD update, fp32, inputs on the GPU, no parameter
# server (psflow-bench-step and bench/pytorch_step.py). cnn at batch 64, 512
# and 4096; resnet at 128 and 512. psflow runs each size op by op (eager)
# and as one recorded CUDA graph per step (graph).
# Usage: bench/gpu_step.sh [build/bin] [cuda:0]     (STEPS, REPEATS to change)
set -euo pipefail
bin=${1:-build/bin}
device=${2:-cuda:0}
steps=${STEPS:-200}
repeats=${REPEATS:-5}
here=$(cd "$(dirname "$0")" && pwd)
out=$(mktemp)
trap 'rm -f "$out"' EXIT

run() {  # model batches
  python3 "$here/pytorch_step.py" --model="$1" --batch_sizes="$2" --device="$device" \
      --steps="$steps" --repeats="$repeats" | tee -a "$out"
  "$bin/psflow-bench-step" --model="$1" --batch_sizes="$2" --device="$device" \
      --steps="$steps" --repeats="$repeats" | tee -a "$out"
}
nvidia-smi --query-gpu=name,driver_version --format=csv,noheader || true
python3 -c 'import torch; print("torch", torch.__version__, "cudnn", torch.backends.cudnn.version())'
run cnn 64,512,4096
run resnet 128,512

echo
printf '%-7s %6s %10s %10s %10s %9s %9s\n' model batch "torch ms" "eager ms" "graph ms" "eager x" "graph x"
awk '
  { for (i = 1; i <= NF; ++i) { split($i, kv, "="); f[kv[1]] = kv[2] }
    key = f["model"] " " f["batch"]; if (!(key in seen)) { seen[key] = 1; order[n++] = key }
    ms[key, f["mode"]] = f["ms"] }
  END { for (i = 0; i < n; ++i) { k = order[i]; split(k, mb, " ")
          t = ms[k, "torch"]; e = ms[k, "eager"]; g = ms[k, "graph"]
          printf "%-7s %6s %10.3f %10.3f %10.3f %9.2f %9.2f\n", mb[1], mb[2], t, e, g,
                 (e > 0 ? t / e : 0), (g > 0 ? t / g : 0) } }' "$out"
echo "(x = PyTorch ms / psflow ms: above 1 means psflow is faster)"
