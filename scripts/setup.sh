#!/usr/bin/env bash
# Installs what psflow needs to build and run on Debian 12, skipping packages
# that are already installed. Idempotent; run as root.
set -euo pipefail

packages=(
  build-essential cmake ccache pkg-config
  libgrpc++-dev protobuf-compiler-grpc libprotobuf-dev protobuf-compiler
  libabsl-dev libdnnl-dev ocl-icd-opencl-dev
  libgtest-dev libgmock-dev zlib1g-dev libmicrohttpd-dev
  libjpeg62-turbo-dev libpng-dev
  python3 python3-venv python3-yaml python3-jsonschema python3-prometheus-client
  clang-14 clang-format-14
  dataset-fashion-mnist
)

missing=()
for p in "${packages[@]}"; do
  if ! dpkg-query -W -f='${Status}' "$p" 2>/dev/null | grep -q "install ok installed"; then
    missing+=("$p")
  fi
done

if [ ${#missing[@]} -eq 0 ]; then
  echo "setup: every package is installed"
  exit 0
fi
if [ "$(id -u)" != 0 ]; then
  echo "setup: missing packages: ${missing[*]}; run as root (or install them) first" >&2
  exit 1
fi
echo "setup: installing ${missing[*]}"
export DEBIAN_FRONTEND=noninteractive
apt-get update -qq
apt-get install -y -qq --no-install-recommends "${missing[@]}"
