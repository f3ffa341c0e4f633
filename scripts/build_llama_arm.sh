#!/usr/bin/env bash
# Cross-build llama.cpp's CPU backend and prodip's parity runner (scripts/arm_runner) for aarch64,
# from the same llama.cpp tree the x86 tools and llama-cpp-python use (vendored in the pinned
# llama-cpp-python sdist that scripts/build_llama_tools.sh downloads), to run under qemu-aarch64.
#   scripts/build_llama_arm.sh           build once (cached), print the folder holding the runners
#   scripts/build_llama_arm.sh --print   print that folder if the runners are built; exit 1 if not
# Two runners, statically linked (qemu-aarch64 needs no sysroot), one thread, no OpenMP:
#   prodip-arm-runner-dotprod  -march=armv8.2-a+dotprod+fp16       (phones since ~2019: Cortex-A76)
#   prodip-arm-runner-i8mm     -march=armv8.6-a+dotprod+fp16+i8mm  (recent phones), built only when
#                              `qemu-aarch64 -cpu max` runs an int8 matrix-multiply probe
# The arch flags reach ggml's CPU backend through GGML_CPU_ARM_ARCH (GGML_NATIVE off); the second
# runner reconfigures the same build folder so only the CPU backend recompiles.
# The cache key is the llama-cpp-python version + the arch flags + the runner's sources.
# Environment knobs:
#   PRODIP_LLAMA_ARM_CACHE    cache root (default ~/.cache/prodip/llama-arm)
#   PRODIP_LLAMA_TOOLS_CACHE  where the sdist is kept, shared with build_llama_tools.sh (default
#                             ~/.cache/prodip/llama-tools; `pip download`ed there when missing)
#   PRODIP_LLAMA_SDIST        a local llama_cpp_python-<version>.tar.gz to use instead
#   PRODIP_BUILD_JOBS         parallel compile jobs (default 2)
set -euo pipefail
usage() {  # the header comment above, as the --help text
  echo "usage: $1"
  sed -n '2,/^[^#]/{/^#/s/^# \{0,1\}//p}' "$0"
}
case "${1:-}" in
  -h|--help) usage "scripts/build_llama_arm.sh [--print]"; exit 0 ;;
  ""|--print) ;;
  *) echo "error: scripts/build_llama_arm.sh: unknown option $1 (use --print, --help)" >&2; exit 2 ;;
esac
cd "$(dirname "$0")/.."

# the same llama.cpp as the x86 tools (their pin, read from the script that holds it: one place to change)
LLAMA_VERSION=$(sed -n 's/^LLAMA_VERSION=\([0-9.]*\).*/\1/p' scripts/build_llama_tools.sh)
ARCH_DOTPROD=armv8.2-a+dotprod+fp16
ARCH_I8MM=armv8.6-a+dotprod+fp16+i8mm
CACHE=${PRODIP_LLAMA_ARM_CACHE:-$HOME/.cache/prodip/llama-arm}
TOOLS_CACHE=${PRODIP_LLAMA_TOOLS_CACHE:-$HOME/.cache/prodip/llama-tools}
JOBS=${PRODIP_BUILD_JOBS:-2}
RUNNER_SRC=scripts/arm_runner
CC=aarch64-linux-gnu-gcc
CXX=aarch64-linux-gnu-g++
QEMU=qemu-aarch64
PY=${PRODIP_PYTHON:-.venv/bin/python}

log() { printf '[llama-arm] %s\n' "$*" >&2; }

runner_hash=$(cat "$RUNNER_SRC/CMakeLists.txt" "$RUNNER_SRC/runner.cpp" | sha256sum | cut -c1-12)
key=$(printf '%s' "$LLAMA_VERSION $ARCH_DOTPROD $ARCH_I8MM $runner_hash" | sha256sum | cut -c1-12)
dest="$CACHE/$LLAMA_VERSION-$key"
bin="$dest/bin"

complete() { [ -f "$bin/.complete" ] && [ -x "$bin/prodip-arm-runner-dotprod" ]; }

if [ "${1:-}" = "--print" ]; then
  complete && { echo "$bin"; exit 0; }
  log "not built: run scripts/build_llama_arm.sh"
  exit 1
fi

if complete; then
  ln -sfn "$bin" "$CACHE/latest"
  log "cached (llama-cpp-python $LLAMA_VERSION, $ARCH_DOTPROD / $ARCH_I8MM)"
  echo "$bin"
  exit 0
fi

for tool in cmake "$CC" "$CXX" "$QEMU"; do
  command -v "$tool" >/dev/null || {
    log "error: $tool not found (apt-get install cmake g++-aarch64-linux-gnu qemu-user)"; exit 2; }
done
sdist=${PRODIP_LLAMA_SDIST:-$TOOLS_CACHE/src/llama_cpp_python-$LLAMA_VERSION.tar.gz}
if [ ! -f "$sdist" ]; then  # the same file, fetched the same way and kept in the same place as build_llama_tools.sh's
  log "downloading the llama-cpp-python $LLAMA_VERSION sdist (llama.cpp is vendored in it)"
  mkdir -p "$(dirname "$sdist")"
  tmpd=$(mktemp -d "$(dirname "$sdist")/dl.XXXXXX")
  "$PY" -m pip download --disable-pip-version-check -q --no-deps --no-binary :all: \
    -d "$tmpd" "llama-cpp-python==$LLAMA_VERSION"
  mv "$tmpd"/llama_cpp_python-"$LLAMA_VERSION".tar.gz "$sdist"
  rm -rf "$tmpd"
fi
generator=()
command -v ninja >/dev/null && generator=(-G Ninja)

# Build in a scratch folder beside the destination and rename into place only at the end, so an
# interrupted build never leaves a cache entry that looks complete. An interrupted build's folder (same
# key: same sources and flags) is resumed: ninja recompiles only what is missing.
work="$dest.build"
mkdir -p "$work/bin"
work=$(cd "$work" && pwd -P)  # absolute: CMake gets LLAMA_SRC from outside the runner's folder
src="$work/llama_cpp_python-$LLAMA_VERSION/vendor/llama.cpp"
if [ ! -f "$work/.extracted" ]; then
  rm -rf "$work/llama_cpp_python-$LLAMA_VERSION" "$work/build"
  tar -xzf "$sdist" -C "$work" "llama_cpp_python-$LLAMA_VERSION/vendor/llama.cpp"
  touch "$work/.extracted"
fi

# $1: the -march value; configures (or reconfigures) the one build folder and builds the runner.
build_runner() {
  log "configuring for -march=$1"
  cmake -S "$RUNNER_SRC" -B "$work/build" "${generator[@]}" -DLLAMA_SRC="$src" \
    -DCMAKE_BUILD_TYPE=Release -DCMAKE_SYSTEM_NAME=Linux -DCMAKE_SYSTEM_PROCESSOR=aarch64 \
    -DCMAKE_C_COMPILER="$CC" -DCMAKE_CXX_COMPILER="$CXX" -DCMAKE_EXE_LINKER_FLAGS=-static \
    -DBUILD_SHARED_LIBS=OFF -DGGML_NATIVE=OFF -DGGML_CPU_ARM_ARCH="$1" -DGGML_OPENMP=OFF \
    -DGGML_CCACHE=OFF -DLLAMA_CURL=OFF -DLLAMA_OPENSSL=OFF \
    >"$work/configure.log" 2>&1 || { tail -30 "$work/configure.log" >&2; log "error: cmake configure failed"; exit 2; }
  cmake --build "$work/build" -j "$JOBS" --target prodip-arm-runner >"$work/build.log" 2>&1 \
    || { tail -40 "$work/build.log" >&2; log "error: build failed (full log: $work/build.log)"; exit 2; }
}

# Does the emulator execute int8 matrix multiply (FEAT_I8MM)? A static probe using vmmlaq_s32.
i8mm_runs() {
  printf '%s\n' '#include <arm_neon.h>' \
    'int main() { int8x16_t a = vdupq_n_s8(1); int32x4_t s = vmmlaq_s32(vdupq_n_s32(0), a, a);' \
    '  return vgetq_lane_s32(s, 0) == 8 ? 0 : 1; }' >"$work/i8mm.c"
  "$CC" -O1 -march="$ARCH_I8MM" -static "$work/i8mm.c" -o "$work/i8mm" 2>/dev/null && "$QEMU" -cpu max "$work/i8mm"
}

start=$(date +%s)
log "building prodip-arm-runner with $JOBS jobs (~260 CPU-seconds: a few minutes on 2 idle cores)"
build_runner "$ARCH_DOTPROD"
cp "$work/build/prodip-arm-runner" "$work/bin/prodip-arm-runner-dotprod"
note="i8mm: not built (qemu-aarch64 -cpu max refused the probe)"
if i8mm_runs; then
  build_runner "$ARCH_I8MM"
  cp "$work/build/prodip-arm-runner" "$work/bin/prodip-arm-runner-i8mm"
  note="i8mm: built"
fi
secs=$(( $(date +%s) - start ))
printf 'llama-cpp-python %s\narch %s %s\n%s\nbuilt %s in %ss\n' "$LLAMA_VERSION" "$ARCH_DOTPROD" "$ARCH_I8MM" \
  "$note" "$(date -u +%FT%TZ)" "$secs" >"$work/bin/.complete"
rm -rf "$dest"
mkdir -p "$dest"
mv "$work/bin" "$bin"
rm -rf "$work"
ln -sfn "$bin" "$CACHE/latest"
log "built in $secs s ($note)"
echo "$bin"
