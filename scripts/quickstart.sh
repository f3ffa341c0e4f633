#!/usr/bin/env bash
# Set up everything (scripts/setup.sh), then: train the `small` preset on the corpus that ships with
# prodip, fine-tune it on the shipped chat set, export every format, check parity, open the demo.
# A second run reuses what the first one made. Arguments go to `python -m demo.quickstart`.
set -euo pipefail
cd "$(dirname "$0")/.."
bash scripts/setup.sh
export GRADIO_ANALYTICS_ENABLED=False
exec "${PRODIP_VENV:-.venv}/bin/python" -m demo.quickstart "$@"
