#!/usr/bin/env bash
# Set up everything (scripts/setup.sh --dev), then lint and run the whole test suite on CPU.
# Extra arguments go to pytest, e.g. scripts/test.sh -k parity
set -euo pipefail
cd "$(dirname "$0")/.."
bash scripts/setup.sh --dev --llama-tools
PY=${PRODIP_VENV:-.venv}/bin/python
export HF_HUB_OFFLINE=1 TRANSFORMERS_OFFLINE=1 GRADIO_ANALYTICS_ENABLED=False TOKENIZERS_PARALLELISM=false
"$PY" -m ruff check .
set +e
"$PY" -m pytest -q "$@"
rc=$?
set -e
if [ "$rc" = 5 ]; then
  echo "error: pytest collected no tests" >&2
  exit 1
fi
exit "$rc"
