"""`python -m bench segments`: 1/2/4/8 segments, one training run each, advanced in interleaved chunks; time per
step, trained samples per second, decode-slot utilisation, rewards, and the GPU cost model's replay of the
runs' own engine calls."""
import argparse
import json
import os
import random
import statistics
import tempfile

import torch

from bench.common import CALLS, COUNTS, PAPER, add_run_flags, chunk_rounds, div, load_train, mean, run_chunk, sem
from bench.gpu import gpu_table, print_gpu_table
from bench.gpu_cost import GPUCost, predicted_speedups


def bucketed_prefill(call) -> int:
    """Prefill positions (rows x width, padding included) of one recorded call under engine.length_buckets."""
    from systems.engine import length_buckets
    contexts = call[0]
    return sum(len(g) * max(contexts[i] for i in g) for g in length_buckets(contexts))


def controlled_data(path: str, n: int, seed: int, long_frac: float | None = None) -> str:
    """Tiny-task prompts with a controlled long tail: 2 terms (a 6-token response) or, with probability
    `long_frac`, 12 terms (~58 tokens: at the default 64-token cap)."""
    long_frac = 0.1 if long_frac is None else long_frac
    rng = random.Random(seed)
    with open(path, "w") as f:
        for _ in range(n):
            terms = [rng.randint(1, 9) for _ in range(12 if rng.random() < long_frac else 2)]
            f.write(json.dumps({"prompt": "+".join(map(str, terms)) + "=", "answer": str(sum(terms)),
                                "verifier": "tiny"}) + "\n")
    return path


def segment_rows(variants: list[str], recs: dict, counts: dict, calls: dict, by_round: dict) -> dict:
    """Each variant's measured numbers per optimizer step, printed as the segments table."""
    rows = {}
    for s in variants:
        rs = recs[s]
        t = sum(x["time/step_s"] for x in rs)
        rows[s] = {"step_s": mean([x["time/step_s"] for x in rs]),
                   "step_s_median": statistics.median(x["time/step_s"] for x in rs),
                   "rollout_s": mean([x["time/rollout_s"] for x in rs]),
                   "samples_per_s": sum(x["train/samples"] for x in rs) / t,
                   "tokens_per_s": sum(x["tokens/generated"] for x in rs) / t,
                   "utilisation": counts[s]["tokens"] / max(counts[s]["slots"], 1),
                   "decode_steps_per_step": counts[s]["decode_steps"] / len(rs),
                   "engine_calls_per_step": counts[s]["calls"] / len(rs),
                   "prefill_per_step": counts[s]["prefill"] / len(rs),
                   "prefill_bucketed_per_step": sum(bucketed_prefill(c) for c in calls[s]) / len(rs),
                   "generate_s": counts[s]["generate_s"] / len(rs),
                   "reward": mean([x["reward/mean"] for x in rs if x["reward/mean"] is not None]),
                   "reward_sem": sem([x["reward/mean"] for x in rs if x["reward/mean"] is not None]),
                   "trained_reward": mean([x["reward/trained_mean"] for x in rs]),
                   "mean_len": mean([x["response/mean_len"] for x in rs])}
    one = rows[variants[0]]
    print(f"\n{'segments':>8} | {'step s':>7} | {'rollout s':>9} | {'generate s':>10} | {'samples/s':>9} | "
          f"{'speedup':>7} | {'paper':>5} | {'util':>5} | {'calls':>5} | {'prefill tok':>11} | {'bucketed':>8} | {'decode steps':>12} | "
          f"{'fewer steps':>11} | {'reward':>14} | {'mean len':>8}")
    for s, x in rows.items():
        paper = f"{PAPER[int(s)]:.2f}" if s.isdigit() and int(s) in PAPER else "  -  "
        print(f"{s:>8} | {x['step_s']:7.2f} | {x['rollout_s']:9.2f} | {x['generate_s']:10.2f} | "
              f"{x['samples_per_s']:9.1f} | {x['samples_per_s'] / one['samples_per_s']:6.2f}x | {paper:>5} | "
              f"{x['utilisation']:5.2f} | {x['engine_calls_per_step']:5.1f} | {x['prefill_per_step']:11.0f} | "
              f"{x['prefill_bucketed_per_step']:8.0f} | "
              f"{x['decode_steps_per_step']:12.1f} | "
              f"{div(one['decode_steps_per_step'], x['decode_steps_per_step']):10.2f}x | "
              f"{x['reward']:.3f} +- {x['reward_sem']:.3f} | {x['mean_len']:8.1f}")
    print("(per optimizer step: step s = the whole step; rollout s = generation + rewards + pools; generate s = "
          "inside engine.generate; calls = engine calls; prefill tok = rows x longest context, summed over calls (bucketed: the same in the "
          "transformers engine's length buckets, what a bucketed variant computes); "
          "decode steps = the calls' longest generations, summed; fewer steps = 1 segment's decode steps / these: "
          "the rollout speedup where a decode step costs the same however many rows are busy, as in memory-bound "
          "GPU decoding: a count, not a timing)")
    print("reward by round (mean reward of the groups completed in each round's steps):")
    for s in variants:
        print(f"{s:>8} | " + " ".join(f"{v:.3f}" for v in by_round[s]))
    return rows


def bench_segments(args, train_flags: list[str]) -> dict:
    work = args.dir or tempfile.mkdtemp(prefix="bench_segments_")
    os.makedirs(work, exist_ok=True)
    base = ["--preset", "tiny",  # the tiny task's settings for any --model (a hub name alone would take UloRL's)
            "--eval-data", "", "--dump-samples", "0", "--save-every", "0", "--keep-last", "1", "--seed", str(args.seed)]
    if args.task == "controlled":
        base += ["--data", controlled_data(os.path.join(work, "controlled.jsonl"), 20_000, args.seed, args.long_frac)]
    elif args.long_frac is not None:
        raise SystemExit("--long-frac sets the controlled task's share of long responses: add --task controlled")
    variants = args.segments.split(",")  # "4u": 4 segments, the transformers engine's prefill not bucketed
    recs = {s: [] for s in variants}
    counts = {s: dict.fromkeys(COUNTS, 0) for s in variants}
    by_round = {s: [] for s in variants}  # mean reward of each measured round
    calls = {s: [] for s in variants}  # the measured rounds' engine calls
    log = open(os.path.join(work, "train_stdout.log"), "a")
    print(f"segments bench in {work}: variants {variants}, warm-up {args.warmup} steps, then {args.rounds} "
          f"rounds x {args.chunk} steps, torch threads {torch.get_num_threads()}", flush=True)
    for r, s, target in chunk_rounds(variants, args):
        before, first_call = dict(COUNTS), len(CALLS)
        got = run_chunk(base + train_flags + ["--segments", s.rstrip("u")], os.path.join(work, f"seg{s}"), target,
                        log, bucket=not s.endswith("u"))
        if r == 0:
            continue
        calls[s] += CALLS[first_call:]
        recs[s] += got
        for k in COUNTS:
            counts[s][k] += COUNTS[k] - before[k]
        by_round[s].append(mean([x["reward/mean"] for x in got if x["reward/mean"] is not None]))

    rows = segment_rows(variants, recs, counts, calls, by_round)
    one = rows[variants[0]]
    gpu = gpu_predictions(calls, recs, load_train().parse_config(base + train_flags).max_response_len, args.seed)
    return {"bench": "segments", "task": args.task, "long_frac": args.long_frac, "segments": variants,
            "speedup": [round(rows[s]["samples_per_s"] / one["samples_per_s"], 3) for s in variants],
            "utilisation": [round(rows[s]["utilisation"], 3) for s in variants],
            "reward": [round(rows[s]["reward"], 3) for s in variants],
            "reward_sem": [round(rows[s]["reward_sem"], 3) for s in variants],
            "step_s": [round(rows[s]["step_s"], 3) for s in variants],
            "rollout_s": [round(rows[s]["rollout_s"], 3) for s in variants],
            "generate_s": [round(rows[s]["generate_s"], 3) for s in variants],
            "decode_steps": [round(rows[s]["decode_steps_per_step"], 1) for s in variants],
            "decode_step_ratio": [div(one["decode_steps_per_step"], rows[s]["decode_steps_per_step"])
                                  for s in variants],
            "prefill_tokens": [round(rows[s]["prefill_per_step"]) for s in variants],
            "reward_by_round": {str(s): [round(v, 3) for v in by_round[s]] for s in variants},
            "prefill_tokens_bucketed": [round(rows[s]["prefill_bucketed_per_step"]) for s in variants],
            "steps_measured": len(recs[variants[0]]), "threads": torch.get_num_threads(),
            "paper_speedup": {str(k): round(v, 2) for k, v in PAPER.items()}, "gpu_model": gpu}


def gpu_predictions(calls: dict, recs: dict, cap: int, seed: int) -> dict:
    """The cost model's predictions (GPUCost, a model and not a measurement): (a) the runs' own engine calls
    replayed with every length scaled so that their cap becomes 64k tokens, rollout only, on one H200 with the
    calibrated floor; (b) gpu_table: UloRL's setting over the unknowns, against its Table 1."""
    cost = GPUCost()
    plain = [s for s in calls if s.isdigit()]
    replay = predicted_speedups(cost, {int(s): (calls[s], sum(x["train/samples"] for x in recs[s])) for s in plain},
                                65536 / cap)
    print(f"\nGPU cost model ({cost.name}; a model, not a measurement: bench/gpu_cost.py), this run's engine "
          f"calls, lengths x {65536 / cap:.0f} (cap -> 64k tokens), rollout on one GPU, trained samples per second "
          f"relative to {plain[0]} segment(s): " + ", ".join(f"{v:.2f}x" for v in replay.values()))
    segments = [int(s) for s in plain]
    summary = print_gpu_table(gpu_table(segments, seed), segments, every_row=False)
    print("  (every setting: python -m bench gpu)")
    return {"model": cost.name, "segments": segments, "replay_of_this_run": [round(v, 3) for v in replay.values()],
            "table1": summary}


def share(text: str) -> float:
    x = float(text)
    if not 0 <= x <= 1:
        raise argparse.ArgumentTypeError(f"{text}: a share, from 0 to 1")
    return x


def add_parser(sub) -> None:
    s = sub.add_parser("segments", help="time per step and trained samples/s for 1, 2, 4, 8 segments",
                       description="Any other flag goes to train.py (python train.py --help).")
    s.add_argument("--segments", default="1,2,4,8", help="comma-separated segment counts; the first is the baseline")
    s.add_argument("--task", default="tiny", choices=["tiny", "controlled"],
                   help="tiny: the built-in task (P(k) ~ k^-1.5 terms); controlled: 90%% 6-token and 10%% "
                        "~58-token responses")
    s.add_argument("--long-frac", type=share, default=None,
                   help="controlled: the share of 12-term problems, the rest 2 terms (default 0.1)")
    s.add_argument("--warmup", type=int, default=8, help="unmeasured steps per variant before the first round")
    s.add_argument("--rounds", type=int, default=6, help="measured rounds")
    s.add_argument("--chunk", type=int, default=4, help="steps per variant per round")
    add_run_flags(s)
    s.set_defaults(run=bench_segments, train_flags=True)
