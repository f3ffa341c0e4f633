#!/usr/bin/env bash
# Set up everything (scripts/setup.sh --dev), then lint and run the whole test suite on CPU.
# Extra arguments go to pytest, e.g. scripts/test.sh -k parity. The suite runs on PRODIP_TEST_WORKERS
# pytest-xdist workers (default 2; 0: one process), a test file per worker at a time (--dist loadfile: a
# module's fixtures are built once), the longest files first (conftest.SLOW_MODULES); the session fixtures'
# files are built once for both (conftest.built_once).
set -euo pipefail
usage() {  # the header comment above, as the --help text
  echo "usage: $1"
  sed -n '2,/^[^#]/{/^#/s/^# \{0,1\}//p}' "$0"
}
if [[ "${1:-}" == -h || "${1:-}" == --help ]]; then  # before the setup: --help changes nothing (pytest's own: -- --help)
  usage "scripts/test.sh [PYTEST_ARGS ...]"
  exit 0
fi
[[ "${1:-}" != -- ]] || shift
cd "$(dirname "$0")/.."
bash scripts/setup.sh --dev --llama-tools
PY=${PRODIP_VENV:-.venv}/bin/python
export HF_HUB_OFFLINE=1 TRANSFORMERS_OFFLINE=1 GRADIO_ANALYTICS_ENABLED=False TOKENIZERS_PARALLELISM=false
"$PY" -m ruff check .
set +e
WORKERS=${PRODIP_TEST_WORKERS:-2}
[[ "$WORKERS" =~ ^[0-9]+$ ]] || { echo "error: PRODIP_TEST_WORKERS=$WORKERS: a whole number (0: no workers)" >&2; exit 2; }
"$PY" -m pytest -q -n "$WORKERS" --dist loadfile --no-loadscope-reorder "$@"
rc=$?
set -e
if [ "$rc" = 5 ]; then
  echo "error: pytest collected no tests" >&2
  exit 1
fi
exit "$rc"
