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
#   --dry-run         CPU: the tiny preset at seq 64, grad-accum 2, no compile (this script's own logic and
#                     every phase, the SIGTERM-and-resume one included; no GPU figure)
#   PYTHON            the interpreter (default: python3), the one whose torch is to be checked
# Everything after `--` goes to scripts/gpu_validate.py as it is (e.g. -- --batch-size 16 --skip-1b).
# Exit status: gpu_validate.py's (0: trained, measured, preempted and resumed; 1: a phase failed), 2: a bad
# flag, no torch, an install failed.
set -euo pipefail
usage() {  # the header comment above, as the --help text
  echo "usage: $1"
  sed -n '2,/^[^#]/{/^#/s/^# \{0,1\}//p}' "$0"
}
cd "$(dirname "$0")/.."
START=$(date +%s)

# what scripts/gpu_validate.py and train.py import beyond torch: import name=requirement. protobuf: train.py
# reads tokenizer.model through sentencepiece's sentencepiece_model_pb2, which sentencepiece does not require
NEEDS="numpy=numpy>=1.26 safetensors=safetensors>=0.4 sentencepiece=sentencepiece>=0.2 tqdm=tqdm>=4.66
pydantic=pydantic>=2.6 datasketch=datasketch>=1.6 matplotlib=matplotlib>=3.8 google.protobuf=protobuf>=3.20"

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
    -h|--help) usage "bash scripts/gpu_check.sh --out DIR [options] [-- GPU_VALIDATE_ARGS]"; exit 0 ;;
    --) shift; PASS=("$@"); break ;;
    *) die "scripts/gpu_check.sh: unknown option $1 (use --out, --budget-s, --data, --wheelhouse, --dry-run, --help, -- ARGS)" ;;
  esac
done
[ -n "$OUT" ] || die "--out DIR is required (the results folder)"
[[ "$BUDGET" =~ ^[1-9][0-9]*$ ]] || die "--budget-s $BUDGET: a whole number of seconds > 0"
[ -z "$DATA" ] || [ -f "$DATA/meta.json" ] || die "--data $DATA: not a prepared data folder (no meta.json)"
[ -z "$WHEELHOUSE" ] || [ -d "$WHEELHOUSE" ] || die "--wheelhouse $WHEELHOUSE: not a folder"
[ ! -e "$OUT" ] || [ -d "$OUT" ] || die "--out $OUT: exists and is not a folder"
if [ -n "$DATA" ]; then  # outputs never overlap inputs (training/runfiles/file_ops.py: check_apart, for every command)
  o=$(realpath -m "$OUT") d=$(realpath -m "$DATA")
  case "$o/" in "$d"/*) die "--out $OUT is (or is inside) --data $DATA: choose another --out" ;; esac
  case "$d/" in "$o"/*) die "--out $OUT holds --data $DATA: choose another --out" ;; esac
fi
command -v "$PY" >/dev/null || die "$PY not found (set PYTHON=/path/to/python, the one with torch)"
VERSIONS=$("$PY" -c "import sys, torch; print('python', sys.version.split()[0], 'torch', torch.__version__, 'cuda', torch.version.cuda)" 2>/dev/null) \
  || die "$PY has no torch: install the CUDA build of torch first"
mkdir -p "$OUT"
LOG="$OUT/gpu_check.log"
echo "$VERSIONS" >"$LOG"

# one interpreter tries every import (a start each would cost seconds): the requirements of those that fail
mapfile -t MISSING < <("$PY" - $NEEDS <<'PY'
import importlib, sys
for pair in sys.argv[1:]:
    name, _, req = pair.partition("=")
    try:
        importlib.import_module(name)
    except Exception:  # missing, or there and broken (a binary built for another Python): reinstall it
        print(req)
try:
    import tomllib  # noqa: F401  (3.11+; tomli before)
except ImportError:
    try:
        import tomli  # noqa: F401
    except ImportError:
        print("tomli>=2.0")
PY
)
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
# an explicit grad-accum: small whatever tiny's recipe says, and > 1 so that accumulation runs too
[ "$DRY" = 0 ] || ARGS+=(--device cpu --preset tiny --seq-len 64 --batch-size 2 --grad-accum 2 --steps 4 --no-compile --skip-1b)
echo "$PY scripts/gpu_validate.py ${ARGS[*]} ${PASS[*]:-}" >>"$LOG"
exec "$PY" scripts/gpu_validate.py "${ARGS[@]}" "${PASS[@]}"
