# Shared by the bench scripts that set psflow on GPUs beside PyTorch DDP
# (sourced after lib.sh, not run). They set $bin, $tmp, $here (the bench
# directory), $data_dir (Fashion-MNIST), $resnet_steps and $cnn_steps before
# calling its functions.

# require_gpus SCRIPT N TOOL...: exits (naming SCRIPT) unless N GPUs are
# visible and every TOOL is an executable in $bin.
require_gpus() {
  local script=$1 need=$2 gpus tool
  shift 2
  gpus=$(nvidia-smi --list-gpus 2>/dev/null | wc -l) || gpus=0
  [ "$gpus" -ge "$need" ] || { echo "$script: needs $need GPUs, $gpus visible" >&2; exit 1; }
  for tool in "$@"; do
    [ -x "$bin/$tool" ] || { echo "$script: no $bin/$tool (give the binaries' directory)" >&2; exit 1; }
  done
}

# describe_machine SCRIPT: prints the GPUs, the CPU cores and PyTorch's
# version; exits (naming SCRIPT) when python3 cannot import torch.
describe_machine() {
  local torch
  torch=$(python3 -c 'import torch; print("torch", torch.__version__)' 2>/dev/null) \
    || { echo "$1: python3 cannot import torch (the DDP baseline needs it)" >&2; exit 1; }
  echo "GPUs: $(nvidia-smi --query-gpu=name --format=csv,noheader | paste -sd, - | sed 's/,/, /g');" \
    "$(nproc) CPU cores; $torch"
}

batch_of() { if [ "$1" = resnet ]; then echo 128; else echo 64; fi; }
steps_of() { if [ "$1" = resnet ]; then echo "$resnet_steps"; else echo "$cnn_steps"; fi; }

# ddp NAME GPUS MODEL STEPS: runs bench/pytorch_ddp.py; sets $ddp_rate.
ddp() {
  local name=$1 n=$2 model=$3 steps=$4
  python3 "$here/pytorch_ddp.py" --model="$model" --gpus="$n" --batch_size="$(batch_of "$model")" \
      --warmup=20 --steps="$steps" > "$tmp/$name.log" 2>&1 \
    || { echo "$name failed:" >&2; tail -30 "$tmp/$name.log" >&2; exit 1; }
  grep '^ddp ' "$tmp/$name.log" || true
  ddp_rate=$(sed -n 's/^ddp .* examples\/s=\([0-9.]*\).*/\1/p' "$tmp/$name.log")
  [ -n "$ddp_rate" ] || { echo "$name printed no examples/s:" >&2; tail -30 "$tmp/$name.log" >&2; exit 1; }
}

# psflow NAME WORKERS DEVICES PS WIRE MODEL STEPS: one psflow-launch job
# (its workers get $WORKER_ARGS as well, if set: psflow-launch --worker_args;
# its ps $PS_ARGS, e.g. "--apply_threads=4": --ps_args;
# its chief $CHIEF_ARGS, e.g. "--slice_mb=0"; psflow-launch itself
# $LAUNCH_ARGS, e.g. "--trace_dir=DIR --trace_steps=200:201");
# sets $rate (ex/s after the first interval) and $split ("step pull compute
# push wait", ms, of the last progress line).
psflow() {
  local name=$1 workers=$2 devices=$3 ps=$4 wire=$5 model=$6 steps=$7 data
  if [ "$model" = resnet ]; then
    data=(--data_format=synthetic --synthetic_examples=20000)
  else
    data=(--data_dir="$data_dir")
  fi
  launch_job "$name" --ps="$ps" --workers="$workers" --worker_devices="$devices" \
    --worker_args="${WORKER_ARGS:-}" --ps_args="${PS_ARGS:-}" ${LAUNCH_ARGS:-} -- \
    --model="$model" "${data[@]}" --batch_size="$(batch_of "$model")" --train_steps="$steps" \
    --log_every_steps=$((steps >= 8 ? steps / 8 : 1)) --optimizer=sgd --learning_rate=0.05 \
    --wire_dtype="$wire" ${CHIEF_ARGS:-}
  rate=$(ex_per_s "$tmp/$name.log")
  split=$(step_split "$tmp/$name.log")
  rate=${rate:-0} split=${split:-- - - - -}
  echo "$name: $rate ex/s, step $split (ms: step pull compute push wait)"
}

ratio() { awk -v a="$1" -v b="$2" 'BEGIN { if (b > 0) printf "%.2f", a / b; else printf "-" }'; }

