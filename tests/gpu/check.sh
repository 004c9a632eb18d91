#!/usr/bin/env bash
# The GPU check (tests/gpu/check.py): the headline run's placement at small size on the GPUs present (FSDP2
# ranks + a TP engine on 4+, a split engine on 2-3, colocated on 1), a 64-expert MoE by hub name with YaRN and
# a 32k engine; one JSON line per run and a summary, exit 1 if a run fails.
#   bash tests/gpu/check.sh [--gpus N] [--timeout S] [--work DIR]
#   bash tests/gpu/check.sh --dry-run --gpus N      # the commands it would run, without a GPU
set -euo pipefail
cd "$(dirname "$0")/../.."
exec python3 tests/gpu/check.py "$@"
