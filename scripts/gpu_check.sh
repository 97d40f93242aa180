#!/usr/bin/env bash
# The GPU check in one call: scripts/gpu_check.sh OUTDIR
#
# Installs the wheels carried in gpu_wheels/ (`make gpu-wheels` on a machine with PyPI) into a
# private folder (never into the machine's venv), then runs `python -m fastsync.gpu.check`,
# which writes OUTDIR/gpu_check.json; everything is logged to OUTDIR/gpu_check.log.
# Exit: 0 every part ran and passed and no GPU test skipped, 3 nothing failed but a part or a test
# was skipped (a skip is not a pass: the summary counts passed / skipped / failed apart and names
# what was skipped and why), 1 a part failed or timed out, 2 the check could not run (no CUDA
# device), 124 the outer deadline killed it.
#
# Settings (environment):
#   GPU_CHECK_DRY=1      install and check the device, run no part (on a CPU machine: exits 2,
#                        "no CUDA device", having exercised the install and report path)
#   GPU_CHECK_QUICK=1    smaller runs, shorter deadlines (a retry with little device time left)
#   GPU_CHECK_PYTHON     interpreter (default: /opt/torch/.venv/bin/python, else .venv/bin/python, else python3)
#   GPU_CHECK_WHEELS     wheel folder (default: gpu_wheels/ in the repo)
#   GPU_CHECK_SITE       install folder (default: $TMPDIR/fastsync-gpu-site)
#   GPU_CHECK_TIMEOUT_S  outer deadline of the python driver (default 450; its parts have their own)
set -uo pipefail

OUT=${1:?usage: scripts/gpu_check.sh OUTDIR}
ROOT=$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)
WHEELS=${GPU_CHECK_WHEELS:-$ROOT/gpu_wheels}
SITE=${GPU_CHECK_SITE:-${TMPDIR:-/tmp}/fastsync-gpu-site}
DEADLINE=${GPU_CHECK_TIMEOUT_S:-450}
mkdir -p "$OUT"
OUT=$(cd "$OUT" && pwd)
LOG=$OUT/gpu_check.log
: >"$LOG"
T0=$(date +%s)

log() { echo "gpu-check: $*" | tee -a "$LOG" >&2; }

if [[ -n ${GPU_CHECK_PYTHON:-} ]]; then PY=$GPU_CHECK_PYTHON
elif [[ -x /opt/torch/.venv/bin/python ]]; then PY=/opt/torch/.venv/bin/python
elif [[ -x $ROOT/.venv/bin/python ]]; then PY=$ROOT/.venv/bin/python
else PY=python3
fi
log "python $PY ($("$PY" -c 'import sys; print(sys.version.split()[0])' 2>&1)), repo $ROOT, out $OUT"

# 1. the carried wheels, into a private folder (pip when the interpreter has it, else unzip:
#    the wheels are plain purelib/platlib wheels). The target flags make the same install work
#    from a CPU machine's Python for the dry run.
rm -rf "$SITE" && mkdir -p "$SITE"
shopt -s nullglob
whls=("$WHEELS"/*.whl)
if ((${#whls[@]} == 0)); then
  log "no wheels in $WHEELS (run 'make gpu-wheels' where PyPI is reachable): NIXL parts will be skipped"
elif "$PY" -m pip --version >/dev/null 2>&1; then
  log "installing ${#whls[@]} wheel(s) from $WHEELS into $SITE"
  if ! "$PY" -m pip install --quiet --disable-pip-version-check --no-index --no-deps --no-compile \
      --only-binary=:all: --python-version 3.12 --implementation cp --platform manylinux_2_28_x86_64 \
      --target "$SITE" "${whls[@]}" >>"$LOG" 2>&1; then
    log "pip install failed (see the log); continuing: parts needing those wheels will say what is missing"
  fi
else
  log "no pip for $PY: unpacking ${#whls[@]} wheel(s) into $SITE"
  "$PY" - "$SITE" "${whls[@]}" >>"$LOG" 2>&1 <<'EOF' || log "unpacking failed (see the log)"
import sys, zipfile
for w in sys.argv[2:]:
    zipfile.ZipFile(w).extractall(sys.argv[1])
EOF
fi
# fastsync runs from the source tree; its built-in plugins are found through entry points,
# so their metadata goes beside the wheels.
PYTHONPATH=$ROOT "$PY" -c "import sys; from fastsync.gpu.report import write_entry_points; write_entry_points('$ROOT/pyproject.toml', sys.argv[1])" \
  "$SITE" >>"$LOG" 2>&1 || log "could not write fastsync's entry points (see the log)"
log "install step took $(($(date +%s) - T0)) s"

# 2. the driver, under an outer deadline (each part has its own, shorter one)
export PYTHONPATH=$ROOT:$ROOT/adapters/verl:$SITE${PYTHONPATH:+:$PYTHONPATH}
export GLOO_SOCKET_IFNAME=${GLOO_SOCKET_IFNAME:-lo}
export NIXL_LOG_LEVEL=${NIXL_LOG_LEVEL:-WARN}
args=("$OUT" --site "$SITE")
[[ ${GPU_CHECK_DRY:-0} != 0 ]] && args+=(--dry-run)
[[ ${GPU_CHECK_QUICK:-0} != 0 ]] && args+=(--quick)
cd "$ROOT" || exit 2
timeout -k 15 "$DEADLINE" "$PY" -m fastsync.gpu.check "${args[@]}" 2>&1 | tee -a "$LOG"
rc=${PIPESTATUS[0]}
if [[ ! -s $OUT/gpu_check.json ]]; then
  log "the driver wrote no JSON (exit $rc); writing one that says so"
  printf '{"schema": "fastsync-gpu-check/1", "ok": false, "verdict": "not_run", "error": "driver exited %s before writing a report; see gpu_check.log", "parts": {}}\n' "$rc" >"$OUT/gpu_check.json"
  ((rc == 0)) && rc=2
fi
((rc == 124 || rc == 137)) && log "the outer deadline ($DEADLINE s) stopped the driver; parts finished so far are in the JSON"
((rc == 3)) && log "nothing failed, but not everything ran: the skipped parts/tests above were not checked (exit 3)"
if ((rc != 0 && rc != 2 && rc != 3)); then
  echo "----- last lines of $LOG -----"
  tail -n 40 "$LOG"
fi
log "done in $(($(date +%s) - T0)) s, exit $rc; report: $OUT/gpu_check.json"
exit "$rc"
