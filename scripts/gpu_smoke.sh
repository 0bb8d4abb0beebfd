#!/usr/bin/env bash
# GPU smoke run of the local engine (no vLLM, no network): a few bfloat16 steps of the demo
# task on one CUDA GPU; prints, per step, how far the logprobs the update recomputes are from
# the sampling logprobs the OpenAI server returned, PASS/FAIL against bf16 tolerance, and the
# step times. Bounded to 4 minutes (expected: well under 1 minute after imports).
#
#   scripts/gpu_smoke.sh                       # 4 bf16 steps + a 1-step float32 reference
#   scripts/gpu_smoke.sh --steps 8 --max-diff 0.3
#   PYTHON=/path/to/python scripts/gpu_smoke.sh
#
# Needs torch (CUDA build), transformers and agl_lab's dependencies, verl 0.9.1 included
# (agl_lab's learning core is verl code); it installs nothing and lists what is missing.
# Exit codes: 0 PASS · 1 FAIL · 2 missing packages · 3 no CUDA device · 124 over time.
set -euo pipefail
cd "$(dirname "$0")/.."
if [[ -z "${PYTHON:-}" ]]; then
  if [[ -x .venv/bin/python ]]; then PYTHON=.venv/bin/python; else PYTHON=python3; fi
fi
if ! command -v "$PYTHON" >/dev/null 2>&1; then
  echo "gpu_smoke: FAIL — no Python interpreter '$PYTHON' (set PYTHON=/path/to/python3.11)" >&2
  exit 2
fi
status=0
timeout --kill-after=10 "${GPU_SMOKE_TIMEOUT:-230}" "$PYTHON" scripts/gpu_smoke.py "$@" || status=$?
if [[ $status -eq 124 || $status -eq 137 ]]; then
  echo "gpu_smoke: FAIL — did not finish within ${GPU_SMOKE_TIMEOUT:-230} s" >&2
fi
exit $status
