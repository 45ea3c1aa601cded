#!/usr/bin/env bash
# disttrain on one CUDA GPU: one PASS/FAIL line per check, exit 1 if any failed (docs/gpu.md).
#
#   scripts/gpu_check.sh                  # a machine with one CUDA GPU: under 6 minutes
#   scripts/gpu_check.sh --cpu-dry-run    # the same checks on the CPU
#
# It needs the torch already installed there (no network) and disttrain's own source: run it
# from a checkout; disttrain need not be installed (pip install --no-deps -e . also works).
set -u
cd "$(dirname "$0")/.."
export PYTHONPATH="$PWD${PYTHONPATH:+:$PYTHONPATH}"
exec "${PYTHON:-python3}" scripts/gpu_check.py "$@"
