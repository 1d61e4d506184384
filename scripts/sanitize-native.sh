#!/usr/bin/env bash
# The native kernels under AddressSanitizer and UndefinedBehaviorSanitizer, and the one pool
# under ThreadSanitizer (issue 53 item 5), run by scripts/test.sh: small builds of their own,
# without MLX. ASan and UBSan: each kernel with a driver that checks its products against a
# plain double-precision loop (skinny_matmul: tests/native/skinny_race.c; the quantized
# products' float loops: quant_sanitize.cpp; their 16-bit and tiled paths, dequantize_tiled
# and the dense path: quant_int16_sanitize.cpp), on every instruction set the processor runs,
# then once with a planted read and once with a planted write past a buffer, which ASan must
# report.
# TSan: tests/native/pool_tsan.cpp runs the pool (pool.c) with three helpers over
# skinny_matmul's products and the fast operations' loops from two callers at once, on every
# instruction set, then once with a planted race, which TSan must report. Any other report
# fails the run.
#   ./scripts/sanitize-native.sh [rounds] [pool rounds]   (400 and 150: TSan adds some 15 s)
set -euo pipefail
cd "$(dirname "$0")/.."
OPENBLAS=$(python3 -c "import sys; sys.path.insert(0, '.'); from appliance.backend.blas import openblas_lib; print(openblas_lib() or '')")
[ -n "$OPENBLAS" ] || { echo "Debian's libopenblas0-pthread is not installed" >&2; exit 1; }
out=$(mktemp -d)
trap 'rm -rf "$out"' EXIT
mkdir "$out/asan" "$out/tsan"
N=appliance/backend/native
SKINNY=("$N/skinny_matmul.c" "$N/skinny_avx2.c" "$N/skinny_avx512.c" "$N/simd.c" "$N/pool.c")
SAN=("-fsanitize=address,undefined" -fno-sanitize-recover=all -fno-omit-frame-pointer -Wno-psabi)
TSAN=(-fsanitize=thread -O1 -g -Wno-psabi)
gcc -O1 -g "${SAN[@]}" -o "$out/skinny" tests/native/skinny_race.c "${SKINNY[@]}" \
  "$OPENBLAS" -ldl -lpthread -lm &
pids=($!)
# The quantized loops at -O0: their templates took four times as long to compile at -O1.
# The variants' files with their instruction sets file-wide (simd.h's targets), here only:
# the 16-bit paths are `flatten`ed, -O0 inlines nothing, and their generic helpers passed
# vectors to the variant's under another calling convention (the sums came out wrong).
for src in tests/native/quant_sanitize.cpp tests/native/quant_int16_sanitize.cpp; do
  g++ -std=c++20 -O0 "${SAN[@]}" -c "$src" -o "$out/asan/$(basename "$src").o" &
  pids+=($!)
done
g++ -std=c++20 -O0 "${SAN[@]}" -mavx2 -mfma -mf16c -c $N/quant_avx2.cpp \
  -o "$out/asan/quant_avx2.o" &
pids+=($!)
g++ -std=c++20 -O0 "${SAN[@]}" -mavx512f -mavx512dq -mavx512bw -mavx512vl -mavx512vnni -mavx2 \
  -mfma -mf16c -c $N/quant_avx512.cpp -o "$out/asan/quant_avx512.o" &
pids+=($!)
for src in "${SKINNY[@]}"; do
  gcc "${TSAN[@]}" -c "$src" -o "$out/tsan/$(basename "$src").o" &
  pids+=($!)
done
for src in tests/native/pool_tsan.cpp $N/fast_loops.cpp $N/fast_avx2.cpp $N/fast_avx512.cpp; do
  g++ -std=c++20 "${TSAN[@]}" -c "$src" -o "$out/tsan/$(basename "$src").o" &
  pids+=($!)
done
for pid in "${pids[@]}"; do wait "$pid"; done  # each compile's status, not only the last's
# the driver, then AVX2's, then AVX-512's: the linker keeps the first copy of an inline
# function (std::min, ...) that they share, so none built for AVX-512 runs on AVX2 alone
VARIANTS=("$out/asan/quant_avx2.o" "$out/asan/quant_avx512.o")
g++ -fsanitize=address,undefined -o "$out/quant" "$out/asan/quant_sanitize.cpp.o" "${VARIANTS[@]}"
g++ -fsanitize=address,undefined -o "$out/quant_int16" "$out/asan/quant_int16_sanitize.cpp.o" \
  "${VARIANTS[@]}"
g++ -fsanitize=thread -o "$out/pool_tsan" "$out"/tsan/*.o "$OPENBLAS" -ldl -lpthread
# a sanitizer's runtime must be the first library loaded: none of the test command's
# preloads; leaks are not looked for (the pool's helpers live as long as the process)
export ASAN_OPTIONS=detect_leaks=0:abort_on_error=0 UBSAN_OPTIONS=print_stacktrace=1
export TSAN_OPTIONS=halt_on_error=1
for simd in avx512 avx2 portable; do
  env -u LD_PRELOAD APPLIANCE_SIMD=$simd "$out/skinny" "${1:-400}"
  env -u LD_PRELOAD APPLIANCE_SIMD=$simd APPLIANCE_QUANT_THREADS=4 "$out/pool_tsan" "${2:-150}"
done
env -u LD_PRELOAD "$out/quant"  # every variant the processor runs
env -u LD_PRELOAD "$out/quant_int16"
# the planted overflows (tiles a byte short, an output a float short) on the widest variant:
# a run that ASan does not stop means it could not see past a kernel's buffers. A 32-byte
# load that ends a byte past the buffer (AVX-512 VNNI's unpack) is an "unknown-crash" to
# ASan, at an address it places right after the buffer: that is the planted read too.
for plant in read write; do
  if env -u LD_PRELOAD "$out/quant_int16" "plant-$plant" >"$out/plant-$plant.log" 2>&1 \
     || ! grep -qE "AddressSanitizer: (heap-buffer-overflow|unknown-crash)" "$out/plant-$plant.log" \
     || ! grep -qE "located 0 bytes (to the right of|after) [0-9]+-byte region" "$out/plant-$plant.log"; then
    cat "$out/plant-$plant.log" >&2
    echo "sanitize-native: AddressSanitizer did not report the planted $plant" >&2
    exit 1
  fi
done
echo "sanitize-native: AddressSanitizer reported the planted read and write, as it must"
# the planted race: a run that TSan does not stop means it could not see one in the pool
if env -u LD_PRELOAD APPLIANCE_QUANT_THREADS=4 "$out/pool_tsan" 20 plant >"$out/plant.log" 2>&1 \
   || ! grep -q "ThreadSanitizer: data race" "$out/plant.log"; then
  cat "$out/plant.log" >&2
  echo "sanitize-native: ThreadSanitizer did not report the planted race" >&2
  exit 1
fi
echo "sanitize-native: ThreadSanitizer reported the planted race, as it must"
