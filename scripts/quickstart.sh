#!/usr/bin/env bash
# Set up everything (scripts/setup.sh), then: train the `small` preset on the corpus that ships with
# prodip, fine-tune it on the shipped chat set, export every format, check parity, open the demo.
# A second run reuses what the first one made. Arguments go to `python -m demo.quickstart`.
set -euo pipefail
usage() {  # the header comment above, as the --help text
  echo "usage: $1"
  sed -n '2,/^[^#]/{/^#/s/^# \{0,1\}//p}' "$0"
}
cd "$(dirname "$0")/.."
for a in "$@"; do  # before the setup: --help changes nothing
  if [[ "$a" == -h || "$a" == --help ]]; then
    usage "scripts/quickstart.sh [ARGS of python -m demo.quickstart]"
    if [ -x "${PRODIP_VENV:-.venv}/bin/python" ]; then
      echo
      exec "${PRODIP_VENV:-.venv}/bin/python" -m demo.quickstart --help
    fi
    exit 0
  fi
done
bash scripts/setup.sh
export GRADIO_ANALYTICS_ENABLED=False
exec "${PRODIP_VENV:-.venv}/bin/python" -m demo.quickstart "$@"
