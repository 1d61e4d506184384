#!/usr/bin/env bash
# Build the compiled parts (setup.py) again against the MLX installed in the virtual
# environment $1: appliance/backend/native/mlx_fast.cpp is an MLX extension and must match the MLX
# that runs it, which pip's isolated build environment does not have. Called by install.sh
# and scripts/test.sh after the package and its dependencies are installed.
set -euo pipefail
VENV=$1
shift
"$VENV/bin/python" -m pip install -q --disable-pip-version-check "$@" 'nanobind>=3,<4' setuptools wheel
"$VENV/bin/python" -m pip install -q --disable-pip-version-check "$@" --no-build-isolation --no-deps \
  -e "$(dirname "$0")/.."
"$VENV/bin/python" -c "from appliance.backend import fast_ops; why = fast_ops.available(); print('    fast CPU ops:', why or 'built')"
