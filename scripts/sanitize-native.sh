#!/usr/bin/env bash
# The native kernels under AddressSanitizer and UndefinedBehaviorSanitizer (issue 53 item 5),
# run by scripts/test.sh: a small build of their own, without MLX, of each kernel with a
# driver that checks its products against a plain double-precision loop (skinny_matmul:
# tests/native/skinny_race.c; the quantized products' float loops: quant_sanitize.cpp), on
# every instruction set the processor runs; any report fails the run. ThreadSanitizer over
# skinny_matmul's hand-off is scripts/tsan-skinny.sh.
#   ./scripts/sanitize-native.sh [rounds]
set -euo pipefail
cd "$(dirname "$0")/.."
OPENBLAS=$(python3 -c "import sys; sys.path.insert(0, '.'); from appliance.backend.blas import openblas_lib; print(openblas_lib() or '')")
[ -n "$OPENBLAS" ] || { echo "Debian's libopenblas0-pthread is not installed" >&2; exit 1; }
out=$(mktemp -d)
trap 'rm -rf "$out"' EXIT
N=appliance/backend/native
SAN=("-fsanitize=address,undefined" -fno-sanitize-recover=all -fno-omit-frame-pointer -Wno-psabi)
gcc -O1 -g "${SAN[@]}" -o "$out/skinny" tests/native/skinny_race.c $N/skinny_matmul.c \
  "$OPENBLAS" -ldl -lpthread -lm &
pids=($!)
# the quantized loops at -O0: their templates took four times as long to compile at -O1
for src in tests/native/quant_sanitize.cpp $N/quant_avx2.cpp $N/quant_avx512.cpp; do
  g++ -std=c++20 -O0 "${SAN[@]}" -c "$src" -o "$out/$(basename "$src").o" &
  pids+=($!)
done
for pid in "${pids[@]}"; do wait "$pid"; done  # each compile's status, not only the last's
g++ -fsanitize=address,undefined -o "$out/quant" "$out"/*.o
# ASan must be the first library loaded: none of the test command's preloads; leaks are not
# looked for (the kernel's helper thread lives as long as the process, by design)
export ASAN_OPTIONS=detect_leaks=0:abort_on_error=0 UBSAN_OPTIONS=print_stacktrace=1
for simd in avx512 avx2 portable; do
  env -u LD_PRELOAD APPLIANCE_SIMD=$simd "$out/skinny" "${1:-400}"
done
env -u LD_PRELOAD "$out/quant"  # every variant the processor runs
