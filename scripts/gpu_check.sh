#!/usr/bin/env bash
# One command for a fresh GPU machine that has Python and torch, nothing else of prodip's:
#   bash scripts/gpu_check.sh --out DIR [--budget-s N] [--data DIR] [--wheelhouse DIR] [--dry-run] [-- GPU_VALIDATE_ARGS]
#
#   --out DIR         results: DIR/gpu_validate.json and .md, rewritten after every phase (a machine
#                     reclaimed mid-way keeps what finished), DIR/gpu_check.log (what was installed)
#   --budget-s N      the whole check, installs included (default 450 s); scripts/gpu_validate.py gets
#                     what the installs left and skips a phase that no longer fits
#   --data DIR        a data folder prepared elsewhere (`python -m training.prepare`, best on a CPU
#                     machine, with the 32768-piece vocabulary of the presets); without it the shipped
#                     corpus is prepared here (its vocabulary is smaller: another model's MFU)
#   --wheelhouse DIR  install the missing pure-Python needs from DIR only (an offline GPU box:
#                     `pip download -d DIR numpy safetensors ...` on a machine with internet); without
#                     it, from the package registry
#   --dry-run         CPU: the tiny preset at seq 64, no compile (this script's own logic, no GPU figure)
#   PYTHON            the interpreter (default: python3), the one whose torch is to be checked
# Everything after `--` goes to scripts/gpu_validate.py as it is (e.g. -- --batch-size 16 --skip-1b).
# Exit status: gpu_validate.py's (0: trained and measured), 2: a bad flag, no torch, an install failed.
set -euo pipefail
cd "$(dirname "$0")/.."
START=$(date +%s)

# what scripts/gpu_validate.py and train.py import beyond torch: import name=requirement
NEEDS="numpy=numpy>=1.26 safetensors=safetensors>=0.4 sentencepiece=sentencepiece>=0.2 tqdm=tqdm>=4.66
pydantic=pydantic>=2.6 datasketch=datasketch>=1.6 matplotlib=matplotlib>=3.8"

die() { echo "error: $*" >&2; exit 2; }

OUT="" BUDGET=450 DATA="" WHEELHOUSE="" DRY=0
PY=${PYTHON:-python3}
PASS=()
while [ $# -gt 0 ]; do
  case "$1" in
    --out) [ $# -ge 2 ] || die "--out needs a folder"; OUT=$2; shift 2 ;;
    --budget-s) [ $# -ge 2 ] || die "--budget-s needs seconds"; BUDGET=$2; shift 2 ;;
    --data) [ $# -ge 2 ] || die "--data needs a folder"; DATA=$2; shift 2 ;;
    --wheelhouse) [ $# -ge 2 ] || die "--wheelhouse needs a folder"; WHEELHOUSE=$2; shift 2 ;;
    --dry-run) DRY=1; shift ;;
    --) shift; PASS=("$@"); break ;;
    *) die "scripts/gpu_check.sh: unknown option $1 (use --out, --budget-s, --data, --wheelhouse, --dry-run, -- ARGS)" ;;
  esac
done
[ -n "$OUT" ] || die "--out DIR is required (the results folder)"
[[ "$BUDGET" =~ ^[1-9][0-9]*$ ]] || die "--budget-s $BUDGET: a whole number of seconds > 0"
[ -z "$DATA" ] || [ -f "$DATA/meta.json" ] || die "--data $DATA: not a prepared data folder (no meta.json)"
[ -z "$WHEELHOUSE" ] || [ -d "$WHEELHOUSE" ] || die "--wheelhouse $WHEELHOUSE: not a folder"
[ ! -e "$OUT" ] || [ -d "$OUT" ] || die "--out $OUT: exists and is not a folder"
command -v "$PY" >/dev/null || die "$PY not found (set PYTHON=/path/to/python, the one with torch)"
"$PY" -c "import torch" 2>/dev/null || die "$PY has no torch: install the CUDA build of torch first"
mkdir -p "$OUT"
LOG="$OUT/gpu_check.log"
"$PY" -c "import sys, torch; print('python', sys.version.split()[0], 'torch', torch.__version__, 'cuda', torch.version.cuda)" >"$LOG"

MISSING=()
for pair in $NEEDS; do
  "$PY" -c "import ${pair%%=*}" 2>/dev/null || MISSING+=("${pair#*=}")
done
"$PY" -c "import tomllib" 2>/dev/null || "$PY" -c "import tomli" 2>/dev/null || MISSING+=("tomli>=2.0")
if [ ${#MISSING[@]} -gt 0 ]; then
  echo "installing ${MISSING[*]}${WHEELHOUSE:+ from $WHEELHOUSE}" | tee -a "$LOG"
  FROM=()
  [ -z "$WHEELHOUSE" ] || FROM=(--no-index --find-links "$WHEELHOUSE")
  "$PY" -m pip install --quiet "${FROM[@]}" "${MISSING[@]}" >>"$LOG" 2>&1 \
    || die "could not install ${MISSING[*]}; see $LOG"
else
  echo "every pure-Python need is installed" >>"$LOG"
fi

LEFT=$(( BUDGET - ($(date +%s) - START) ))
[ "$LEFT" -ge 1 ] || LEFT=1  # gpu_validate.py still writes its results, every phase skipped
ARGS=(--out "$OUT" --budget-s "$LEFT")
[ -z "$DATA" ] || ARGS+=(--data "$DATA")
[ "$DRY" = 0 ] || ARGS+=(--device cpu --preset tiny --seq-len 64 --batch-size 2 --steps 4 --no-compile --skip-1b)
echo "$PY scripts/gpu_validate.py ${ARGS[*]} ${PASS[*]:-}" >>"$LOG"
exec "$PY" scripts/gpu_validate.py "${ARGS[@]}" "${PASS[@]}"
