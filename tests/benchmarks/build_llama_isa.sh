#!/usr/bin/env bash
# Build llama.cpp's llama-bench for one x86 instruction set, from the same pinned llama.cpp source as
# scripts/build_llama_tools.sh (the tree vendored in the llama-cpp-python sdist it caches), so the only
# difference from the tools build is the SIMD the CPU kernels are compiled for (issue #44's speed question:
# how much of wllama's gap to native is SIMD width, how much WebAssembly).
#   tests/benchmarks/build_llama_isa.sh sse42   SSE4.2 only: no AVX at all
#   tests/benchmarks/build_llama_isa.sh avx     AVX without AVX2/FMA/F16C: 128-bit integer SIMD
#   tests/benchmarks/build_llama_isa.sh avx2    the tools build's flags (AVX/AVX2/FMA/F16C)
# Prints the llama-bench path, cached as ~/.cache/prodip/llama-isa/ISA/bin/llama-bench (PRODIP_LLAMA_ISA_CACHE).
# One build folder serves every ISA: only ggml's CPU backend depends on the flags, so a second ISA
# recompiles that library alone (minutes, not the 10-25 of a full build on 2 cores).
# GGML_NATIVE stays off in every build: some CPUs advertise AMX but raise SIGILL on it.
set -euo pipefail
case "${1:-}" in
  -h|--help) sed -n '2,/^[^#]/{/^#/s/^# \{0,1\}//p}' "$0"; exit 0 ;;
  sse42) flags="-DGGML_AVX=OFF -DGGML_AVX2=OFF -DGGML_FMA=OFF -DGGML_F16C=OFF -DGGML_BMI2=OFF" ;;
  avx) flags="-DGGML_AVX=ON -DGGML_AVX2=OFF -DGGML_FMA=OFF -DGGML_F16C=OFF -DGGML_BMI2=OFF" ;;
  avx2) flags="-DGGML_AVX=ON -DGGML_AVX2=ON -DGGML_FMA=ON -DGGML_F16C=ON -DGGML_BMI2=ON" ;;
  *) echo "error: build_llama_isa.sh: give one of sse42, avx, avx2 (got '${1:-}')" >&2; exit 2 ;;
esac
isa=$1
version=0.3.36  # scripts/build_llama_tools.sh's LLAMA_VERSION
sdist=${PRODIP_LLAMA_TOOLS_CACHE:-$HOME/.cache/prodip/llama-tools}/src/llama_cpp_python-$version.tar.gz
cache=${PRODIP_LLAMA_ISA_CACHE:-$HOME/.cache/prodip/llama-isa}
[ -f "$sdist" ] || { echo "error: $sdist missing: run scripts/build_llama_tools.sh first" >&2; exit 2; }
if [ -x "$cache/$isa/bin/llama-bench" ]; then echo "$cache/$isa/bin/llama-bench"; exit 0; fi
src=$cache/src/llama_cpp_python-$version/vendor/llama.cpp
[ -d "$src" ] || { mkdir -p "$cache/src"; tar -xzf "$sdist" -C "$cache/src" "llama_cpp_python-$version/vendor/llama.cpp"; }
build=$cache/build
# shellcheck disable=SC2086
cmake -S "$src" -B "$build" -G Ninja -DCMAKE_BUILD_TYPE=Release -DBUILD_SHARED_LIBS=OFF \
  -DLLAMA_BUILD_TESTS=OFF -DLLAMA_BUILD_EXAMPLES=OFF -DLLAMA_BUILD_TOOLS=ON -DLLAMA_BUILD_SERVER=OFF \
  -DLLAMA_CURL=OFF -DLLAMA_OPENSSL=OFF -DLLAMA_BUILD_UI=OFF -DLLAMA_USE_PREBUILT_UI=OFF \
  -DGGML_NATIVE=OFF -DGGML_SSE42=ON -DGGML_AVX512=OFF -DGGML_AVX_VNNI=OFF -DGGML_AMX_TILE=OFF \
  -DGGML_AMX_INT8=OFF -DGGML_AMX_BF16=OFF -DGGML_CPU_REPACK=ON $flags >"$cache/$isa.configure.log" 2>&1 \
  || { tail -20 "$cache/$isa.configure.log" >&2; echo "error: cmake configure failed" >&2; exit 2; }
cmake --build "$build" -j "${PRODIP_BUILD_JOBS:-2}" --target llama-bench >"$cache/$isa.build.log" 2>&1 \
  || { tail -30 "$cache/$isa.build.log" >&2; echo "error: build failed ($cache/$isa.build.log)" >&2; exit 2; }
mkdir -p "$cache/$isa/bin" && cp "$build/bin/llama-bench" "$cache/$isa/bin/llama-bench"
echo "$cache/$isa/bin/llama-bench"
