#!/usr/bin/env bash
# Images/s of psflow's input pipeline (psflow-bench-input, data/pipeline.h)
# beside tf.data (bench/input_tf.py) on the same TFRecord shards of real
# photos, on this machine, in one run: 224x224x3 floats in [0, 1], batches of
# 64, after one warm-up batch, records through a shuffle buffer of 1000.
#   psflow augment  DataConfig.augment: RandomResizedCrop (torchvision's
#                   draw) decoded as a crop window, resized, flipped half
#   psflow center   resize_shorter=256, central 224x224, one resampling
#   tf fused        sample_distorted_bounding_box + decode_and_crop_jpeg
#                   (the usual TF recipe), resize bilinear, random flip
#   tf fused_tv     the same with psflow's (torchvision's) window draw
#   tf naive        decode_jpeg whole, then the fused crop
#   tf center       decode_jpeg, shorter side to 256, central 224x224
# psflow decodes on THREADS threads (default: the cores) with 4 batches read
# ahead; tf.data maps with AUTOTUNE and prefetches AUTOTUNE. Each is run
# ROUNDS times (default 3), alternating; the table gives the medians of
# images/s and of the process' CPU ms per image (all its threads, over the
# timed batches: the figure that holds when other work shares the cores), the
# ratios psflow / tf.data, then the time of each stage on one thread
# (psflow-bench-input --profile, input_tf.py profile).
# The shards: IMAGES (default 2000) distinct JPEGs of about 500x375 at
# quality 90 cut from scikit-image's bundled photographs, 8 shards written by
# tf.io.TFRecordWriter into SHARDS (default <build>/input-bench-shards, kept
# and reused). The venv <build>/venv-tf (tensorflow-cpu, scikit-image,
# pillow from PyPI) is made or reused, as scripts/check-tfrecord-tf.sh does.
# Usage: bench/input_pipeline.sh [build]   (BATCHES: timed batches, 60)
set -euo pipefail
cd "$(dirname "$0")/.."
build=${1:-build}
venv=$build/venv-tf
rounds=${ROUNDS:-3}
batches=${BATCHES:-60}
images=${IMAGES:-2000}
threads=${THREADS:-$(nproc)}
shards=${SHARDS:-$build/input-bench-shards}

if ! "$venv/bin/python" -c "import tensorflow, skimage, PIL" 2>/dev/null; then
  [ -x "$venv/bin/python" ] || python3 -m venv "$venv"
  "$venv/bin/pip" install -q --upgrade pip
  "$venv/bin/pip" install -q tensorflow-cpu scikit-image pillow
fi
[ -x "$build/bin/psflow-bench-input" ] ||
  flock /tmp/psflow-build.lock cmake --build "$build" -j2 --target psflow-bench-input >/dev/null
export TF_CPP_MIN_LOG_LEVEL=2
if [ "$(cat "$shards/images" 2>/dev/null)" != "$images" ]; then
  rm -rf "$shards"
  "$venv/bin/python" bench/input_tf.py make --output="$shards" --images="$images" --shards=8 \
    2> >(grep -v "^WARNING: All log\|^I0000" >&2)
  echo "$images" > "$shards/images"
fi
files="$shards/train-*"

# Each prints "images/s cpu_ms_per_image".
figures() { sed -n 's/.*images_per_s=\([0-9.]*\) cpu_ms_per_image=\([0-9.]*\).*/\1 \2/p'; }
psflow() {  # mode
  "$build/bin/psflow-bench-input" --files="$files" --mode="$1" --batches="$batches" \
    --threads="$threads" --prefetch=4 --shuffle_buffer=1000 | figures
}
tfdata() {  # recipe
  "$venv/bin/python" bench/input_tf.py run --files="$files" --recipe="$1" --batches="$batches" \
    2>/dev/null | figures
}

configs=("psflow augment" "psflow center" "tf fused" "tf fused_tv" "tf naive" "tf center")
declare -A runs cpus
load_before=$(cut -d' ' -f1-3 /proc/loadavg)
for ((r = 1; r <= rounds; r++)); do
  for c in "${configs[@]}"; do
    set -- $c
    if [ "$1" = psflow ]; then v=$(psflow "$2"); else v=$(tfdata "$2"); fi
    [ -n "$v" ] || { echo "$c failed" >&2; exit 1; }
    runs[$c]="${runs[$c]:-} ${v% *}"
    cpus[$c]="${cpus[$c]:-} ${v#* }"
    echo "round $r: $c ${v% *} images/s, ${v#* } CPU ms per image"
  done
done

median() { tr ' ' '\n' | grep . | sort -g | awk '{a[NR] = $1} END {print (NR % 2) ? a[(NR + 1) / 2] : (a[NR / 2] + a[NR / 2 + 1]) / 2}'; }
declare -A med medcpu
echo
echo "machine: $(nproc) cores, $(lscpu | sed -n 's/^Model name: *//p'); $(tf_version=$("$venv/bin/python" -c 'import tensorflow as t; print(t.__version__)' 2>/dev/null); echo "TensorFlow $tf_version")"
echo "load average (1, 5, 15 min) before: $load_before, after: $(cut -d' ' -f1-3 /proc/loadavg)"
echo "images: $images JPEGs in 8 shards; batch 64, $batches timed batches; psflow threads=$threads"
printf '%-16s %10s %12s   %s\n' "pipeline" "images/s" "CPU ms/img" "(images/s of each round)"
for c in "${configs[@]}"; do
  med[$c]=$(echo "${runs[$c]}" | median)
  medcpu[$c]=$(echo "${cpus[$c]}" | median)
  printf '%-16s %10.1f %12.3f   %s\n' "$c" "${med[$c]}" "${medcpu[$c]}" "${runs[$c]# }"
done
# images/s: psflow / tf. CPU: tf's CPU per image / psflow's (over 1: psflow needs less).
ratio() {
  awk -v a="${med[$1]}" -v b="${med[$2]}" -v ca="${medcpu[$1]}" -v cb="${medcpu[$2]}" \
    'BEGIN {printf "images/s %.2f, CPU per image %.2f", a / b, cb / ca}'
}
echo
echo "psflow / tf.data (images/s ratio; tf's CPU per image over psflow's):"
echo "  augment vs tf fused:    $(ratio "psflow augment" "tf fused")   (each its own usual crop draw)"
echo "  augment vs tf fused_tv: $(ratio "psflow augment" "tf fused_tv")   (the same crop draw)"
echo "  augment vs tf naive:    $(ratio "psflow augment" "tf naive")"
echo "  center  vs tf center:   $(ratio "psflow center" "tf center")"
echo "(images/s only compare on an idle machine: with other work on the cores each process gets"
echo " a share by its runnable threads, and tf.data runs more of them than psflow's $threads)"
echo
echo "one thread, CPU time per stage:"
"$build/bin/psflow-bench-input" --files="$files" --mode=augment --batches=4 --profile | grep profile
"$build/bin/psflow-bench-input" --files="$files" --mode=center --batches=4 --profile | grep profile
"$venv/bin/python" bench/input_tf.py profile --files="$files" 2>/dev/null
