#!/usr/bin/env bash
# The tests: set-up, build, the tests' Python venv, then every test with ctest.
set -euo pipefail
cd "$(dirname "$0")/.."
bash scripts/setup.sh
bash scripts/build.sh
# Python packages the tests take from PyPI (tensorboard, for the chief's event
# files) go into a venv of Debian's python3 in build/venv; one that works is kept.
if ! build/venv/bin/python -c "import tensorboard" 2>/dev/null; then
  echo "test: making build/venv with tensorboard from PyPI"
  /usr/bin/python3 -m venv --clear build/venv
  build/venv/bin/pip install --quiet --disable-pip-version-check tensorboard
fi
cd build
ctest --output-on-failure -j"${CTEST_JOBS:-1}" --timeout 600
