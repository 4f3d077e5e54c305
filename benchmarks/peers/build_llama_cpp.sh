#!/usr/bin/env bash
# Build llama.cpp's llama-server and llama-bench from the source vendored in llama-cpp-python's
# sdist, into a cache folder (never into the project's .venv). Opt-in: `make bench-peers`.
#   PEERS_DIR (default ~/.cache/radixlm/peers) holds the source and the build.
#   PEERS_AVX2_ONLY=1 builds for AVX2 (no AVX-512), to compare on a CPU capped the same way
#   (radixlm: ATEN_CPU_CAPABILITY=avx2 ONEDNN_MAX_CPU_ISA=AVX2 RADIXLM_CPU_MARCH=haswell); give it
#   its own PEERS_DIR.
set -euo pipefail
here="$(cd "$(dirname "$0")" && pwd)"
root="$(cd "$here/../.." && pwd)"
PEERS_DIR="${PEERS_DIR:-$HOME/.cache/radixlm/peers}"
mkdir -p "$PEERS_DIR"
cd "$PEERS_DIR"
if [ -x llama.cpp/build/bin/llama-server ]; then
  echo "llama-server already built: $PEERS_DIR/llama.cpp/build/bin/llama-server"; exit 0
fi
if [ ! -d llama.cpp ]; then
  rm -rf sdist && mkdir sdist
  "$root/.venv/bin/python" -m pip download --no-binary :all: --no-deps -d sdist llama-cpp-python
  tar -xzf sdist/llama_cpp_python-*.tar.gz -C sdist
  mv sdist/llama_cpp_python-*/vendor/llama.cpp llama.cpp
fi
# -march=native turns on ggml's AMX kernels where the CPU reports AMX, and on the VMs this project
# runs on llama-server then dies at start-up (SIGILL on tilezero in tinygemm_kernel_amx) although
# the kernel grants the tile state; radixlm uses no AMX either. PEERS_AMX=1 keeps them.
no_amx="-mno-amx-tile -mno-amx-int8 -mno-amx-bf16"
if [ "${PEERS_AMX:-0}" = 1 ] || ! echo 'int main(){}' | c++ -x c++ $no_amx -o /dev/null - 2>/dev/null; then no_amx=""; fi
isa="-DGGML_NATIVE=ON"
if [ "${PEERS_AVX2_ONLY:-0}" = 1 ]; then
  isa="-DGGML_NATIVE=OFF -DGGML_AVX=ON -DGGML_AVX2=ON -DGGML_FMA=ON -DGGML_F16C=ON -DGGML_BMI2=ON -DGGML_AVX512=OFF"
  no_amx=""
fi
cmake -S llama.cpp -B llama.cpp/build -DCMAKE_BUILD_TYPE=Release $isa \
  -DCMAKE_C_FLAGS="$no_amx" -DCMAKE_CXX_FLAGS="$no_amx" \
  -DLLAMA_BUILD_SERVER=ON -DLLAMA_BUILD_TOOLS=ON -DLLAMA_CURL=OFF -DLLAMA_OPENSSL=OFF \
  -DLLAMA_USE_PREBUILT_UI=OFF -DLLAMA_BUILD_TESTS=OFF -DLLAMA_BUILD_EXAMPLES=OFF
cmake --build llama.cpp/build --target llama-server llama-bench llama-quantize -j "$(nproc)"
echo "built: $PEERS_DIR/llama.cpp/build/bin/llama-server"
