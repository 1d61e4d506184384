#!/usr/bin/env bash
# The test command. Installs what a fresh machine lacks, then lint, types and the suite.
#   ./scripts/test.sh              everything
#   ./scripts/test.sh tests/unit   a subset (arguments go to pytest)
set -euo pipefail
cd "$(dirname "$0")/.."

# Debian packages: OpenBLAS (fast CPU matmuls for MLX), Chromium (browser tests) and systemd
# (only its `systemd-analyze verify`, which checks our unit file; nothing starts systemd).
if command -v apt-get >/dev/null 2>&1 && [ "$(id -u)" = 0 ]; then
  missing=()
  dpkg -s libopenblas0-pthread >/dev/null 2>&1 || missing+=(libopenblas0-pthread)
  dpkg -s chromium >/dev/null 2>&1 || missing+=(chromium)
  dpkg -s systemd >/dev/null 2>&1 || missing+=(systemd)
  command -v gcc >/dev/null 2>&1 || missing+=(gcc libc6-dev)  # appliance/native/skinny_matmul.c
  command -v g++ >/dev/null 2>&1 || missing+=(g++)              # appliance/native/mlx_fast.cpp
  if [ ${#missing[@]} -gt 0 ]; then
    apt-get update -qq && DEBIAN_FRONTEND=noninteractive apt-get install -y -qq "${missing[@]}"
  fi
fi

VENV=${APPLIANCE_VENV:-.venv}
[ -x "$VENV/bin/python" ] || python3 -m venv "$VENV"
"$VENV/bin/python" -m pip install -q --disable-pip-version-check -e '.[test]'
./scripts/build-native.sh "$VENV"

export HF_HUB_OFFLINE=1 PYTHONUNBUFFERED=1
# The same BLAS libraries the daemon preloads (appliance.cli.use_openblas: skinny_matmul, then
# OpenBLAS) and OpenBLAS's spin as the daemon sets it (appliance.blas.SPIN_EXPONENT), for the
# tests' own MLX work and the daemons they start.
PRELOAD=$("$VENV/bin/python" -c "from appliance.blas import wanted_preload; print(':'.join(wanted_preload('auto', True)))")
if [ -n "$PRELOAD" ]; then
  export LD_PRELOAD="$PRELOAD${LD_PRELOAD:+:$LD_PRELOAD}"
  export OPENBLAS_THREAD_TIMEOUT=${OPENBLAS_THREAD_TIMEOUT:-$("$VENV/bin/python" -c "from appliance.blas import SPIN_EXPONENT; print(SPIN_EXPONENT)")}
fi

"$VENV/bin/ruff" check appliance web migrations tests
"$VENV/bin/mypy" --no-error-summary appliance web migrations
"$VENV/bin/python" -m pytest -q "$@"
