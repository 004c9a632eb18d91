"""Benchmarks that print ratios measured side by side in one run, one module of this folder each. Never part
of the tests (tests/test_bench.py only runs each mode at a trivial size); timings live in docs/benchmarks.md.

    python -m bench segments                    # 1/2/4/8 segments on the tiny task's long tail, interleaved
    python -m bench segments --task controlled  # 90% short responses, 10% that run to the cap
    python -m bench segments --task controlled --segments 1,4 --long-frac 0.3   # the speedup at a 30% long tail
    python -m bench trl                         # TRL's GRPOTrainer vs ulorl (1 and 4 segments), alternating
    python -m bench memory                      # chunked log-prob/entropy vs naive, forward + backward
    python -m bench memory --big                # ... plus the 8k x 151,936 point (naive needs ~15 GB)
    python -m bench sp                          # --sp 2 vs --sp 1 on 2 ranks: step time and memory at 2k-8k tokens
    python -m bench routing                     # MoE experts and log-prob gap, engine vs trainer, replay off/on
    python -m bench overlap                     # --overlap 1 vs 0: trainer and vLLM in two processes, a core each
    python -m bench decode                      # a decode step's cost against its busy rows, both engines, 2 sizes
    python -m bench seeds                       # vLLM with and without a seed on each request, 256 and 1024 rows
    python -m bench scale                       # 1/2/4/8 segments' rollout, random 85M model, long-tail lengths
    python -m bench gpu                         # the GPU cost model's UloRL Table 1 over its unknowns (arithmetic)
    python -m bench reward                      # the reward pool against a single-process loop, 1000 math answers
    python -m bench plan check                  # the memory plan against the measured peaks of short runs
    python -m bench rg                          # every Reasoning Gym dataset's probe: as is, full marks only, refused
    python -m bench offload                     # the offloaded optimizer step (AdamW on the CPU), 1 thread vs 2

Every mode prints a table and, last, one JSON line with its figures (`plan`: one a run, or a rank). Unknown
flags of `segments`, `trl` and `overlap` go to train.py (e.g. `--prompts-per-step 8`), so a benchmark runs
exactly what `python train.py` runs.

How the runs are interleaved (the machine is noisy, so nothing is compared across separate runs):
- segments: one training run per variant, advanced in chunks of --chunk steps in rotating order
  (1,2,4,8 / 2,4,8,1 / ...). Each chunk ends in a checkpoint and the next resumes from it (train.py's exact
  resume), so every variant is one continuous run and a slow minute of the machine hits all of them. A first
  round of --warmup steps per variant is not measured: with S segments the unfinished pool needs about S
  steps to fill, and 1 segment would otherwise look better than it is.
- trl: rounds of TRL chunk / ulorl 1-segment chunk / ulorl 4-segment chunk, in rotating order; the first
  step of every chunk (trainer construction, lazy init) is dropped for all of them.
- memory: every (variant, length) point runs in its own fresh process; peak = VmHWM - VmRSS right before
  the forward (the kernel's high-water mark, reset through /proc/self/clear_refs).
- overlap: as segments, one run per --overlap value advanced in chunks in rotating order (0,1 / 1,0 / ...);
  the trainer has one torch thread, vLLM's engine (its worker's one thread and its scheduler process, which
  polls the worker in a busy loop) core 1 (VLLM_CPU_OMP_THREADS_BIND); each chunk's first step is dropped for
  both (a fresh engine's first call warms it up).
- scale: one fresh process per engine, in which the segment variants take one step each in rotating order
  (rollout only: the engine's calls are timed, the weights never change); --warmup + S unmeasured steps each.
- decode: every (engine, model) point in a fresh process, each row count repeated --rounds times in turn
  (the median); a step's cost is the difference of a 17-token and a 1-token call over its 16 decode steps.
- routing: counts, not timings, so nothing to interleave: fixed seeds and sizes give the same figures run to
  run (bf16 sums could round otherwise at another thread count; 1 and 2 threads agreed here).

Decode-slot utilisation = generated tokens / (batch rows x decode steps) over every engine call, where a
call's decode steps are its longest generation: a static batch (the transformers engine) keeps every row's
slot busy until the last row stops. For vLLM's continuous batching the number is a lower bound.
"""
import argparse
import json

from bench import (decode, gpu, memory, memory_plan, moe_routing, offload, overlap, reward_pool, rg_probe, scale,
                   seeds, segments, sp, vs_trl)
from bench.common import clean

# in --help's order
MODES = (segments, vs_trl, memory, sp, overlap, gpu, decode, seeds, scale, moe_routing, reward_pool, memory_plan, rg_probe,
         offload)


def parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="python -m bench", description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    sub = p.add_subparsers(dest="mode", required=True)
    for mode in MODES:
        mode.add_parser(sub)  # each sets `run` (and `point_run`, `train_flags`) as the mode's defaults
    return p


def main(argv=None) -> None:
    p = parser()
    args, rest = p.parse_known_args(argv)
    if getattr(args, "point", ""):  # internal: one measurement in this fresh process
        print(json.dumps(args.point_run(args)), flush=True)
        return
    if rest and not getattr(args, "train_flags", False):  # only segments, trl and overlap pass flags to train.py
        p.error(f"unknown arguments: {' '.join(rest)}")
    result = args.run(args, rest)
    if result is not None:
        print(json.dumps(clean(result)), flush=True)


if __name__ == "__main__":  # not when multiprocessing's spawn imports this module in a worker (sp)
    main()
