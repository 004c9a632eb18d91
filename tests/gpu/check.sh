#!/usr/bin/env bash
# The GPU check (tests/gpu/check.py): first the attention kernels on packed rows (varlen against sdpa, and
# varlen at 131072 tokens), on one GPU; then the headline run's placement at small size on the GPUs present (FSDP2
# ranks + a TP engine on 4+, packed rows, then again with --sp 2 and the optimizer offloaded; a split engine on
# 2-3, colocated on 1), a 64-expert MoE by hub name with YaRN and a 32k engine; then that MoE colocated for 3
# steps twice, --routing-replay true and record (rollout routing replay against the routing only measured; the two
# at once on GPUs the last phase leaves idle or after it, one after the other on 1); last, on 2+ GPUs, that MoE for
# 3 steps with --overlap 1, one trainer process and on GPUs of their own two vLLM replicas of TP 1 (one engine on
# 2 GPUs; in the last phase where it leaves those GPUs idle, else after it): engine_lag at most 1 and 1 after step 1,
# rollout/replica_idle on every step with replicas; one JSON line for the kernels and one per run, a summary with
# the pair's routing mismatch and engine/trainer gap side by side and the overlap run's figures, exit 1 if anything
# fails.
#   bash tests/gpu/check.sh [--gpus N] [--timeout S] [--work DIR]
#   bash tests/gpu/check.sh --kernel                # the kernel check alone
#   bash tests/gpu/check.sh --dry-run --gpus N      # the commands it would run, without a GPU
# PYTHON names the interpreter (default: python3 on the PATH); the tests pass their own.
set -euo pipefail
cd "$(dirname "$0")/../.."
exec "${PYTHON:-python3}" tests/gpu/check.py "$@"
