#!/usr/bin/env bash
# Builds llama.cpp's C++ `llama-server` from source as a benchmark peer. Idempotent: a second run
# only checks that the binary is there and runs.
#
#   benchmarks/peers/setup_llama_server.sh [DIR]     (default: $LLAMA_DIR, else ./.peers/llama.cpp)
#
# Why this way:
#  * the peer is the C++ server, not llama-cpp-python's Python server (which serializes requests);
#  * the llama-cpp-python sdist on PyPI carries the whole llama.cpp tree in vendor/llama.cpp,
#    and PyPI is a registry this project's machines reach;
#  * GGML_NATIVE=ON builds for this CPU (AVX-512, VNNI), as a user building it here would;
#    LLAMA_CURL=OFF: it loads the GGUF file from disk and fetches nothing;
#  * on a CPU that lists AMX, without AMX: this version's AMX matmul dies of SIGILL at its first
#    tile instruction on its worker threads (a known ggml bug: the tile configuration it loads is
#    not a valid one there; AMX itself runs on such a machine), so a user building here would turn
#    it off too.
# The binary ends up at DIR/build/bin/llama-server. Building takes about 10 minutes on 2 cores.
set -euo pipefail

DIR="${1:-${LLAMA_DIR:-.peers/llama.cpp}}"
VERSION="${LLAMA_CPP_PYTHON_VERSION:-0.3.36}"
PYTHON="${PYTHON:-python3}"
BIN="$DIR/build/bin/llama-server"

if [ ! -x "$BIN" ]; then
    if [ ! -f "$DIR/CMakeLists.txt" ]; then
        work="$(mktemp -d)"
        "$PYTHON" -m pip download -q --no-deps --no-binary :all: -d "$work" "llama-cpp-python==$VERSION"
        tar -xzf "$work"/llama_cpp_python-"$VERSION".tar.gz -C "$work"
        mkdir -p "$(dirname "$DIR")"
        rm -rf "$DIR"
        mv "$work/llama_cpp_python-$VERSION/vendor/llama.cpp" "$DIR"
        rm -rf "$work"
    fi
    generator=()
    if command -v ninja >/dev/null 2>&1; then generator=(-G Ninja); fi
    flags=""
    if grep -q amx_tile /proc/cpuinfo; then flags="-mno-amx-tile -mno-amx-int8 -mno-amx-bf16"; fi
    cmake -S "$DIR" -B "$DIR/build" "${generator[@]}" -DCMAKE_BUILD_TYPE=Release -DGGML_NATIVE=ON \
        -DCMAKE_C_FLAGS="$flags" -DCMAKE_CXX_FLAGS="$flags" \
        -DLLAMA_CURL=OFF -DLLAMA_BUILD_TESTS=OFF -DLLAMA_BUILD_EXAMPLES=OFF >/dev/null
    cmake --build "$DIR/build" -j"$(nproc)" --target llama-server
fi
"$BIN" --version 2>&1 | head -n 2
echo "llama-server ready: $BIN"
