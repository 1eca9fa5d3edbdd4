#!/usr/bin/env bash
# The tests: set-up, build, then every test with ctest.
set -euo pipefail
cd "$(dirname "$0")/.."
bash scripts/setup.sh
bash scripts/build.sh
cd build
ctest --output-on-failure -j"${CTEST_JOBS:-1}" --timeout 600
