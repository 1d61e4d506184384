#!/usr/bin/env bash
# Builds llama.cpp's `llama-server` (the engine Ollama runs on, with parallel slots) and
# `llama-quantize` (bench/shapes.py's K-quant files) from the llama.cpp that the
# llama-cpp-python sdist on PyPI vendors, for the serving benchmark's llama_cpp peer
# (python -m bench.serve --servers ours,llama_cpp --gguf FILE).
#   bench/peers/build-llama-server.sh            build once; prints the binary's path
#   LLAMA_SERVER_DIR=DIR bench/peers/build-llama-server.sh
# The cache lives outside the repository (default ~/.cache/appliance-bench/llama-server).
# About 10 minutes on a quiet 2-core machine (50 at nice 19 beside other work).
# GGML_NATIVE stays OFF: a processor that advertises AMX inside a virtual machine that traps
# it dies with SIGILL on a -march=native build. Instead the widest instruction sets this
# processor lists are switched on one by one (AVX-512 and its VNNI/BF16/VBMI where present),
# so the peer is as fast as llama.cpp gets here. Built again when the flags change.
set -euo pipefail
VERSION=${LLAMA_CPP_PYTHON_VERSION:-0.3.36}
DIR=${LLAMA_SERVER_DIR:-${XDG_CACHE_HOME:-$HOME/.cache}/appliance-bench/llama-server}

# the x86 extensions llama.cpp can use that /proc/cpuinfo lists (none elsewhere: GGML's
# defaults for the architecture)
FLAGS=()
if [ -r /proc/cpuinfo ]; then
  have() { grep -m1 '^flags' /proc/cpuinfo | tr ' ' '\n' | grep -qx "$1"; }
  for pair in avx2:AVX2 fma:FMA f16c:F16C avx512f:AVX512 avx512_vnni:AVX512_VNNI \
              avx512_bf16:AVX512_BF16 avx512vbmi:AVX512_VBMI avx_vnni:AVX_VNNI; do
    have "${pair%%:*}" && FLAGS+=("-DGGML_${pair#*:}=ON")
  done
fi
TAG=$(printf '%s' "${FLAGS[*]}" | sha256sum | cut -c1-8)
BIN="$DIR/bin/llama-server"
JOBS=${JOBS:-2}
PYTHON=${PYTHON:-python3}

# a binary built for other flags (another processor, an older script) is built again
if [ -x "$BIN" ] && [ "$(cat "$DIR/bin/flags" 2>/dev/null)" = "$TAG" ]; then
  echo "$BIN"
  exit 0
fi
mkdir -p "$DIR/src"
cd "$DIR/src"
if ! ls llama_cpp_python-"$VERSION".tar.gz >/dev/null 2>&1; then
  # the sdist only (its build requirements as wheels: pip reads the sdist's metadata)
  "$PYTHON" -m pip download -q --disable-pip-version-check --no-deps \
    --no-binary llama-cpp-python -d . "llama-cpp-python==$VERSION"
fi
[ -d "llama_cpp_python-$VERSION" ] || tar xzf "llama_cpp_python-$VERSION.tar.gz"
cd "llama_cpp_python-$VERSION/vendor/llama.cpp"
cmake -B "build-$TAG" -DCMAKE_BUILD_TYPE=Release -DLLAMA_BUILD_SERVER=ON -DLLAMA_CURL=OFF \
  -DGGML_NATIVE=OFF "${FLAGS[@]}" >/dev/null
cmake --build "build-$TAG" --target llama-server llama-quantize -j"$JOBS" >/dev/null
rm -rf "${DIR:?}/bin"
mkdir -p "$DIR/bin"
# the server links llama.cpp's shared libraries: keep them beside it
cp "build-$TAG/bin/llama-server" "build-$TAG/bin/llama-quantize" "$DIR/bin/"
find "build-$TAG" -name '*.so*' -exec cp -P {} "$DIR/bin/" \; 2>/dev/null || true
echo "$TAG" > "$DIR/bin/flags"
echo "$BIN"
