#!/usr/bin/env bash
# Builds llama.cpp's `llama-server` (the engine Ollama runs on, with parallel slots) from the
# llama.cpp that the llama-cpp-python sdist on PyPI vendors, for the serving benchmark's
# llama_cpp peer (python -m bench.serve --servers ours,llama_cpp --gguf FILE).
#   bench/peers/build-llama-server.sh            build once; prints the binary's path
#   LLAMA_SERVER_DIR=DIR bench/peers/build-llama-server.sh
# The cache lives outside the repository (default ~/.cache/appliance-bench/llama-server).
# About 10 minutes on a quiet 2-core machine (50 at nice 19 beside other work).
# GGML_NATIVE stays OFF: a processor that advertises AMX inside a virtual machine that traps
# it dies with SIGILL on a -march=native build.
set -euo pipefail
VERSION=${LLAMA_CPP_PYTHON_VERSION:-0.3.36}
DIR=${LLAMA_SERVER_DIR:-${XDG_CACHE_HOME:-$HOME/.cache}/appliance-bench/llama-server}
BIN="$DIR/bin/llama-server"
JOBS=${JOBS:-2}
PYTHON=${PYTHON:-python3}

if [ -x "$BIN" ]; then
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
cmake -B build -DCMAKE_BUILD_TYPE=Release -DLLAMA_BUILD_SERVER=ON -DLLAMA_CURL=OFF \
  -DGGML_NATIVE=OFF -DGGML_AVX2=ON -DGGML_FMA=ON -DGGML_F16C=ON >/dev/null
cmake --build build --target llama-server -j"$JOBS" >/dev/null
mkdir -p "$DIR/bin"
# the server links llama.cpp's shared libraries: keep them beside it
cp build/bin/llama-server "$DIR/bin/"
find build -name '*.so*' -exec cp -P {} "$DIR/bin/" \; 2>/dev/null || true
echo "$BIN"
