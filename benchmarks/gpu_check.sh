#!/usr/bin/env bash
# The GPU check (issue 28): the CUDA tests, the DP-SGD / DP-LoRA / non-private / Opacus ghost
# step times on MiniLM and the Llama config in fp32 and bf16, the quickstart and a 1-epoch
# SST-2 subset with training.use_gpu: true; one table at the end (benchmarks/gpu_check.py).
#
#   bash benchmarks/gpu_check.sh              on a machine with one GPU (under 8 minutes)
#   bash benchmarks/gpu_check.sh --dry-run    anywhere: the same checks on the CPU, shrunk
#
# PYTHON picks the interpreter (default: the project's .venv, made by `make setup`).
set -euo pipefail
cd "$(dirname "$0")/.."
case "${1:-}" in
  ""|--dry-run) ;;
  *) echo "usage: bash benchmarks/gpu_check.sh [--dry-run]" >&2; exit 2 ;;
esac
PYTHON="${PYTHON:-.venv/bin/python}"
if [ ! -x "$PYTHON" ]; then
  make setup
fi
export PATH="$(dirname "$PYTHON"):$PATH"
# The GPU machine's minutes are counted; a dry run's CPUs may be a shared 2-core machine's.
LIMIT=480
if [ "${1:-}" = "--dry-run" ]; then LIMIT=1500; fi
exec timeout "$LIMIT" "$PYTHON" benchmarks/gpu_check.py "$@"
