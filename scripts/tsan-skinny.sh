#!/usr/bin/env bash
# ThreadSanitizer over skinny_matmul's caller/helper hand-off (not part of the test command:
# a TSan build is slow, and its result is recorded in docs/backends.md). Needs gcc and
# Debian's OpenBLAS (the kernel hands what it does not take to OpenBLAS's gemm and gemv).
#   ./scripts/tsan-skinny.sh [rounds]
set -euo pipefail
cd "$(dirname "$0")/.."
OPENBLAS=$(python3 -c "import sys; sys.path.insert(0, '.'); from appliance.backend.blas import openblas_lib; print(openblas_lib() or '')")
[ -n "$OPENBLAS" ] || { echo "Debian's libopenblas0-pthread is not installed" >&2; exit 1; }
out=$(mktemp -d)
trap 'rm -rf "$out"' EXIT
gcc -O1 -g -fsanitize=thread -Wno-psabi -o "$out/skinny_race" tests/native/skinny_race.c \
  appliance/backend/native/skinny_matmul.c "$OPENBLAS" -ldl -lpthread -lm
for simd in avx512 avx2 portable; do
  TSAN_OPTIONS="halt_on_error=1" APPLIANCE_SIMD=$simd "$out/skinny_race" "${1:-2000}"
done
