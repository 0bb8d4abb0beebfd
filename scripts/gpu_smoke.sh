#!/usr/bin/env bash
# The prepared GPU check (scripts/gpu_smoke.py): one PASS/FAIL/SKIP line per check, non-zero exit on failure.
#
#   scripts/gpu_smoke.sh --tier A              # bare GPU machine: torch (CUDA build) + transformers, no network
#   scripts/gpu_smoke.sh --tier B              # the README's GPU environment: start-up check, config tests, 2 steps
#   scripts/gpu_smoke.sh --tier A --dry-run    # any machine: what each check would check
#   PYTHON=/path/to/python GPU_SMOKE_TIMEOUT=600 scripts/gpu_smoke.sh --tier AB
#
# Tier A expected: ~1 min after imports; tier B: ~5-10 min (Ray, verl workers, vLLM start-up).
# Default timeout: the tier's WRAPPER_TIMEOUT in gpu_smoke.py (A 590 s, B 1440 s: more than the sum
# of its checks' own timeouts), which `gpu_smoke.py --wrapper-timeout` prints.
# Installs nothing. Exit codes: 0 PASS · 1 FAIL · 2 bad arguments · 3 no CUDA device · 124 over time.
set -euo pipefail
cd "$(dirname "$0")/.."
if [[ -z "${PYTHON:-}" ]]; then
  if [[ -x .venv-gpu/bin/python ]]; then PYTHON=.venv-gpu/bin/python
  elif [[ -x .venv/bin/python ]]; then PYTHON=.venv/bin/python
  else PYTHON=python3; fi
fi
if ! command -v "$PYTHON" >/dev/null 2>&1; then
  echo "FAIL gpu_smoke: no Python interpreter '$PYTHON' (set PYTHON=/path/to/python3)" >&2
  exit 2
fi
limit="${GPU_SMOKE_TIMEOUT:-}"
if [[ -z "$limit" ]]; then
  limit=$("$PYTHON" scripts/gpu_smoke.py --wrapper-timeout "$@" 2>/dev/null) || limit=590
fi
status=0
timeout --kill-after=10 "$limit" "$PYTHON" scripts/gpu_smoke.py "$@" || status=$?
if [[ $status -eq 124 || $status -eq 137 ]]; then
  echo "FAIL gpu_smoke: did not finish within $limit s" >&2
fi
exit $status
