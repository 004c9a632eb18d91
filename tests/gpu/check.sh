#!/usr/bin/env bash
# The GPU check (tests/gpu/check.py): a few bf16 RL steps with vLLM colocated (1 GPU) and split (2+ GPUs),
# dense and Mixture-of-Experts; prints one JSON line and exits non-zero if a run fails its checks.
set -euo pipefail
cd "$(dirname "$0")/../.."
python3 tests/gpu/check.py "$@"
