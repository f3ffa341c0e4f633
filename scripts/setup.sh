#!/usr/bin/env bash
# Create ./.venv and install prodip with everything it needs. Idempotent: a second run is quick.
#   scripts/setup.sh          runtime (train, export, serve, demo)
#   scripts/setup.sh --dev    + test tools (pytest, ruff, transformers, playwright, Debian chromium and
#                      fonts-noto-core: a Bengali font, so the browser test sees Bangla, not boxes), and
#                      SkyPilot (pinned) in its own venv, PRODIP_SKYPILOT_VENV (default
#                      ~/.cache/prodip/skypilot-venv): tests/test_skypilot.py validates deploy/skypilot/ with it
#                      and llama.cpp cross-built for aarch64 (scripts/build_llama_arm.sh, cached: the ARM rows).
#                      Every mode installs the browser runtimes `export web` copies (npm ci in export/site)
#   scripts/setup.sh --llama-tools  + llama.cpp's own programs (llama-cli, -server, -bench, -perplexity,
#                      -imatrix, -quantize), built once from the same pinned source with the same flags
# Environment knobs:
#   PRODIP_VENV        venv folder (default .venv)
#   PRODIP_TORCH       torch requirement (default torch==2.13.0; on a CUDA machine with torch already
#                      in the venv nothing is reinstalled)
#   PRODIP_LLAMA_CMAKE llama.cpp build flags. The default turns GGML_NATIVE off: some CPUs advertise
#                      AMX but fault on AMX instructions (SIGILL in ggml's AMX matmul on quantized
#                      models), and a native build would use them.
set -euo pipefail
usage() {  # the header comment above, as the --help text
  echo "usage: $1"
  sed -n '2,/^[^#]/{/^#/s/^# \{0,1\}//p}' "$0"
}
cd "$(dirname "$0")/.."

DEV=0
LLAMA_TOOLS=0
for a in "$@"; do
  case "$a" in
    --dev) DEV=1 ;;
    --llama-tools) LLAMA_TOOLS=1 ;;  # llama.cpp's own programs (scripts/build_llama_tools.sh)
    -h|--help) usage "scripts/setup.sh [--dev] [--llama-tools]"; exit 0 ;;
    *) echo "error: scripts/setup.sh: unknown option $a (use --dev, --llama-tools, --help)" >&2; exit 2 ;;
  esac
done
VENV=${PRODIP_VENV:-.venv}
TORCH=${PRODIP_TORCH:-torch==2.13.0}
LLAMA_VERSION=0.3.36
LLAMA_CMAKE=${PRODIP_LLAMA_CMAKE:--DGGML_NATIVE=OFF -DGGML_AVX=ON -DGGML_AVX2=ON -DGGML_FMA=ON -DGGML_F16C=ON}
WHEELS=${PRODIP_WHEEL_CACHE:-$HOME/.cache/prodip/wheels}
SKYPILOT_VERSION=0.14.1  # tests/test_skypilot.py checks the venv holds exactly this one
SKY_VENV=${PRODIP_SKYPILOT_VENV:-$HOME/.cache/prodip/skypilot-venv}

log() { printf '[setup] %s\n' "$*"; }

if [ ! -x "$VENV/bin/python" ]; then
  log "creating $VENV"
  python3 -m venv "$VENV"
fi
PY="$VENV/bin/python"
PIP=("$PY" -m pip install --disable-pip-version-check -q)

if ! "$PY" -c "import torch" 2>/dev/null; then
  log "installing $TORCH"
  "${PIP[@]}" "$TORCH"
fi

# llama-cpp-python: built from source once per flag set, the wheel cached outside the repo.
if ! "$PY" -c "import llama_cpp" 2>/dev/null; then
  key=$(printf '%s' "$LLAMA_VERSION $LLAMA_CMAKE" | sha256sum | cut -c1-12)
  dir="$WHEELS/llama-$key"
  if ! ls "$dir"/llama_cpp_python-*.whl >/dev/null 2>&1; then
    log "building llama-cpp-python $LLAMA_VERSION from source (several minutes) with: $LLAMA_CMAKE"
    mkdir -p "$dir"
    CMAKE_ARGS="$LLAMA_CMAKE" "$PY" -m pip wheel --disable-pip-version-check -q --no-deps --no-cache-dir \
      -w "$dir" "llama-cpp-python==$LLAMA_VERSION"
  fi
  "${PIP[@]}" "$dir"/llama_cpp_python-*.whl
fi

if [ "$DEV" = 1 ]; then
  "${PIP[@]}" -e ".[dev,cluster]"
  # the browser test: Chromium, and a Bengali font (without one every Bangla glyph is a box; the test
  # fails on that). Debian's fonts-noto-core holds Noto Sans/Serif Bengali.
  need=()
  command -v chromium >/dev/null 2>&1 || need+=(chromium)
  if ! fc-list :lang=bn 2>/dev/null | grep -q .; then need+=(fonts-noto-core); fi
  # the ARM parity row: llama.cpp cross-built for aarch64 (scripts/build_llama_arm.sh), run under qemu-user
  command -v aarch64-linux-gnu-g++ >/dev/null 2>&1 || need+=(g++-aarch64-linux-gnu)
  command -v qemu-aarch64 >/dev/null 2>&1 || need+=(qemu-user)
  if [ "${#need[@]}" -gt 0 ]; then
    if [ "$(id -u)" = 0 ] && command -v apt-get >/dev/null 2>&1; then
      log "installing ${need[*]} (Debian) for the browser and ARM tests"
      apt-get update -qq && DEBIAN_FRONTEND=noninteractive apt-get install -y -qq "${need[@]}" >/dev/null
    else
      log "${need[*]} not installed and not root: the browser test will skip (no chromium) or fail (no Bengali font)"
    fi
  fi
  # SkyPilot in a venv of its own: installing it into .venv would downgrade uvicorn and click, which
  # serving and the demo need. Installed once (~2 min, ~460 MB), checked by version on every run.
  if ! "$SKY_VENV/bin/python" -c "import sky, sys; sys.exit(sky.__version__ != '$SKYPILOT_VERSION')" 2>/dev/null; then
    log "installing skypilot==$SKYPILOT_VERSION into $SKY_VENV (its own venv; a few minutes, once)"
    python3 -m venv --clear "$SKY_VENV"
    "$SKY_VENV/bin/python" -m pip install --disable-pip-version-check -q "skypilot==$SKYPILOT_VERSION"
  fi
else
  "${PIP[@]}" -e .
fi
# The browser runtimes `python -m export web` copies (wllama, onnxruntime-web; transformers.js for its test),
# pinned in export/site/package-lock.json: `npm ci` once per lock (--ignore-scripts: onnxruntime-node's
# postinstall would download). The page itself needs no npm; without npm only `export web` says what is missing.
if command -v npm >/dev/null 2>&1; then
  lock_sum=$(sha256sum export/site/package-lock.json | cut -c1-16)
  if [ "$(cat export/site/node_modules/.prodip-lock 2>/dev/null)" != "$lock_sum" ]; then
    log "installing the web export's pinned browser runtimes (npm ci in export/site, ~10 s, ~630 MB)"
    (cd export/site && npm ci --ignore-scripts --no-audit --no-fund --loglevel=error >/dev/null)
    echo "$lock_sum" > export/site/node_modules/.prodip-lock
  fi
else
  log "npm not found: python -m export web needs the pinned browser runtimes (install Node.js, rerun this script)"
fi
if [ "$LLAMA_TOOLS" = 1 ]; then
  PRODIP_PYTHON="$PY" PRODIP_LLAMA_CMAKE="$LLAMA_CMAKE" bash scripts/build_llama_tools.sh >/dev/null
  log "llama.cpp tools: $(PRODIP_PYTHON="$PY" PRODIP_LLAMA_CMAKE="$LLAMA_CMAKE" bash scripts/build_llama_tools.sh --print)"
fi
if [ "$DEV" = 1 ]; then  # the ARM parity rows' runners (tests/test_arm.py): cross-built once for aarch64, cached
  PRODIP_PYTHON="$PY" bash scripts/build_llama_arm.sh >/dev/null
  log "llama.cpp aarch64 runners: $(bash scripts/build_llama_arm.sh --print | tr '\n' ' ')"
fi
log "ready: $PY ($("$PY" -c 'import torch, llama_cpp; print("torch", torch.__version__, "| llama-cpp-python", llama_cpp.__version__)'))"
