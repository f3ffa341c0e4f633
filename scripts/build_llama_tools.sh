#!/usr/bin/env bash
# Build llama.cpp's own command-line tools from the llama.cpp tree vendored in the pinned
# llama-cpp-python sdist, so the tools and our Python binding run the same llama.cpp code.
#   scripts/build_llama_tools.sh           build once (cached), print the folder holding the tools
#   scripts/build_llama_tools.sh --print   print that folder if the tools are built; exit 1 if not
# Only these six are built: llama-cli llama-server llama-bench llama-perplexity llama-imatrix
# llama-quantize. The cache key is the llama-cpp-python version + the CMake flags, so a new
# version or flag set builds afresh and the old build stays usable until removed.
# Environment knobs (shared with scripts/setup.sh):
#   PRODIP_LLAMA_CMAKE  ggml flags. Default: GGML_NATIVE off (some CPUs advertise AMX but raise
#                       SIGILL on AMX instructions) with AVX/AVX2/FMA/F16C, as the wheel is built.
#   PRODIP_LLAMA_TOOLS_CACHE  cache root (default ~/.cache/prodip/llama-tools)
#   PRODIP_LLAMA_SDIST  a local llama_cpp_python-<version>.tar.gz to use instead of `pip download`
#   PRODIP_BUILD_JOBS   parallel compile jobs (default 2)
# The folder `$CACHE/latest` always points at the most recently built tools; prodip's Python code
# (export/gguf/llama_tools.py) looks there after $PRODIP_LLAMA_TOOLS and $PATH.
set -euo pipefail
usage() {  # the header comment above, as the --help text
  echo "usage: $1"
  sed -n '2,/^[^#]/{/^#/s/^# \{0,1\}//p}' "$0"
}
case "${1:-}" in
  -h|--help) usage "scripts/build_llama_tools.sh [--print]"; exit 0 ;;
  ""|--print) ;;
  *) echo "error: scripts/build_llama_tools.sh: unknown option $1 (use --print, --help)" >&2; exit 2 ;;
esac
cd "$(dirname "$0")/.."

LLAMA_VERSION=0.3.36
LLAMA_CMAKE=${PRODIP_LLAMA_CMAKE:--DGGML_NATIVE=OFF -DGGML_AVX=ON -DGGML_AVX2=ON -DGGML_FMA=ON -DGGML_F16C=ON}
CACHE=${PRODIP_LLAMA_TOOLS_CACHE:-$HOME/.cache/prodip/llama-tools}
JOBS=${PRODIP_BUILD_JOBS:-2}
PY=${PRODIP_PYTHON:-.venv/bin/python}
TOOLS=(llama-cli llama-server llama-bench llama-perplexity llama-imatrix llama-quantize)

log() { printf '[llama-tools] %s\n' "$*" >&2; }

key=$(printf '%s' "$LLAMA_VERSION $LLAMA_CMAKE" | sha256sum | cut -c1-12)
dest="$CACHE/$LLAMA_VERSION-$key"
bin="$dest/bin"

complete() {
  [ -f "$bin/.complete" ] || return 1
  local t
  for t in "${TOOLS[@]}"; do [ -x "$bin/$t" ] || return 1; done
}

if [ "${1:-}" = "--print" ]; then
  complete && { echo "$bin"; exit 0; }
  log "not built: run scripts/build_llama_tools.sh"
  exit 1
fi

if complete; then
  ln -sfn "$bin" "$CACHE/latest"
  log "cached (llama-cpp-python $LLAMA_VERSION, $LLAMA_CMAKE)"
  echo "$bin"
  exit 0
fi

command -v cmake >/dev/null || { log "error: cmake not found (apt-get install cmake)"; exit 2; }
command -v c++ >/dev/null || { log "error: a C++ compiler is needed (apt-get install g++)"; exit 2; }
generator=()
command -v ninja >/dev/null && generator=(-G Ninja)

mkdir -p "$CACHE/src"
sdist=${PRODIP_LLAMA_SDIST:-$CACHE/src/llama_cpp_python-$LLAMA_VERSION.tar.gz}
if [ ! -f "$sdist" ]; then
  log "downloading the llama-cpp-python $LLAMA_VERSION sdist (llama.cpp is vendored in it)"
  tmpd=$(mktemp -d "$CACHE/src/dl.XXXXXX")
  "$PY" -m pip download --disable-pip-version-check -q --no-deps --no-binary :all: \
    -d "$tmpd" "llama-cpp-python==$LLAMA_VERSION"
  mv "$tmpd"/llama_cpp_python-"$LLAMA_VERSION".tar.gz "$sdist"
  rm -rf "$tmpd"
fi

# Build in a scratch folder beside the destination and rename into place only when every tool
# exists, so an interrupted build never leaves a half-filled cache entry that looks complete.
work="$dest.build"
rm -rf "$work"
mkdir -p "$work"
tar -xzf "$sdist" -C "$work" "llama_cpp_python-$LLAMA_VERSION/vendor/llama.cpp"
src="$work/llama_cpp_python-$LLAMA_VERSION/vendor/llama.cpp"

log "configuring with: $LLAMA_CMAKE"
# Static libraries: the tools are self-contained files a user can copy to another machine.
# No curl/OpenSSL (no model downloads), no npm or Hugging Face web-UI download at build time.
# shellcheck disable=SC2086
cmake -S "$src" -B "$work/build" "${generator[@]}" -DCMAKE_BUILD_TYPE=Release \
  -DBUILD_SHARED_LIBS=OFF -DLLAMA_BUILD_TESTS=OFF -DLLAMA_BUILD_EXAMPLES=OFF \
  -DLLAMA_BUILD_TOOLS=ON -DLLAMA_BUILD_SERVER=ON -DLLAMA_BUILD_APP=OFF \
  -DLLAMA_BUILD_UI=OFF -DLLAMA_USE_PREBUILT_UI=OFF -DLLAMA_OPENSSL=OFF -DLLAMA_CURL=OFF \
  -DLLAMA_BUILD_NUMBER=0 -DLLAMA_BUILD_COMMIT="llama-cpp-python-$LLAMA_VERSION" \
  $LLAMA_CMAKE >"$work/configure.log" 2>&1 || { tail -30 "$work/configure.log" >&2; log "error: cmake configure failed"; exit 2; }

start=$(date +%s)
log "building ${TOOLS[*]} with $JOBS jobs (10-25 minutes on 2 cores)"
cmake --build "$work/build" --config Release -j "$JOBS" --target "${TOOLS[@]}" >"$work/build.log" 2>&1 \
  || { tail -40 "$work/build.log" >&2; log "error: build failed (full log: $work/build.log)"; exit 2; }

mkdir -p "$work/bin"
for t in "${TOOLS[@]}"; do
  cp "$work/build/bin/$t" "$work/bin/$t"
done
printf 'llama-cpp-python %s\nflags %s\nbuilt %s in %ss\n' "$LLAMA_VERSION" "$LLAMA_CMAKE" \
  "$(date -u +%FT%TZ)" "$(( $(date +%s) - start ))" >"$work/bin/.complete"
rm -rf "$dest"
mkdir -p "$dest"
mv "$work/bin" "$bin"
rm -rf "$work"
ln -sfn "$bin" "$CACHE/latest"
log "built in $(( $(date +%s) - start )) s"
echo "$bin"
