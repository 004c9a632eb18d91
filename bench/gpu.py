"""`python -m bench gpu`: UloRL's Table 1 as the GPU cost model predicts it, over the unknowns it cannot
measure here (arithmetic over a simulated rollout: seconds, no model runs). segments.py prints its summary."""
from bench.common import PAPER, mean
from bench.gpu_cost import GPUCost, rl_step_seconds, rollout_seconds
from bench.simulate import long_tail, simulate_segments

# The unknowns gpu_table scans: the floor (seconds), rollout GPUs, the trainer's MFU, overlap; and the tails
# (medians in units of 256 tokens: 10k and 16k tokens).
FLOORS = (0.0, 0.003, 5.75e-3, 0.012)
REPLICAS = (1, 2, 4, 8, 16, 32, 64, 128)
MFUS = (0.2, 0.4)
TAILS = ((40, 0.9), (64, 0.8))


def gpu_table(segments: list[int], seed: int, steps: int = 6) -> list[dict]:
    """UloRL Table 1 as the cost model predicts it: 128 prompts x 8 a round, 128 groups trained per step,
    lognormal lengths to a 64k cap, for every combination of the unknowns above. The trainer has as many GPUs
    as the rollout (the same GPUs, time-shared, when not overlapped; a second pool of the same size when
    overlapped). Rows: {tail, floor_ms, replicas, mfu, overlap, and over `segments`: step_s, rollout_s,
    update_s (means over the steps), speedup}."""
    rows = []
    for median, sigma in TAILS:
        length = long_tail(seed, 256, median, sigma)
        at_cap = sum(length(u) == 256 for u in range(10_000)) / 10_000
        tail = f"median {median * 256} tokens, sigma {sigma}, {at_cap:.1%} at the cap"
        runs = [simulate_segments(s, length, 256, 128, 8, 128, steps, s + 2) for s in segments]
        for floor in FLOORS:
            for r in REPLICAS:
                roll = [rollout_seconds(GPUCost(step_floor=floor, replicas=r), run, 256) for run in runs]
                for mfu in MFUS:
                    train = GPUCost(train_gpus=r, train_mfu=mfu)
                    upd = [[train.update_seconds([n * 256 for n in lengths]) for _, lengths in run] for run in runs]
                    for overlap in (False, True):
                        step = [mean([rl_step_seconds(a, b, overlap) for a, b in zip(ro, up)])
                                for ro, up in zip(roll, upd)]
                        rows.append({"tail": tail, "floor_ms": round(floor * 1e3, 2), "replicas": r, "mfu": mfu,
                                     "overlap": overlap, "step_s": step, "rollout_s": [mean(x) for x in roll],
                                     "update_s": [mean(x) for x in upd], "speedup": [step[0] / x for x in step]})
    return rows


def matches_paper(row: dict, segments: list[int]) -> bool:
    """Within 10% of UloRL's Table 1: 1240 s a step with 1 segment and 1.6x / 2.06x with 2 / 4 segments."""
    ok = 1 in segments and abs(row["step_s"][segments.index(1)] / 1240 - 1) <= 0.1
    return ok and all(abs(x / PAPER[s] - 1) <= 0.1 for s, x in zip(segments, row["speedup"]) if s in PAPER)


def table_summary(rows: list[dict], segments: list[int]) -> dict:
    """gpu_table's rows in brief: the speedups' and the first variant's step time's ranges, overall and per
    replica count, and the settings within 10% of the paper."""
    def ranges(rs):
        return {"step_s_first": [min(x["step_s"][0] for x in rs), max(x["step_s"][0] for x in rs)],
                **{f"speedup_{s}": [min(x["speedup"][i] for x in rs), max(x["speedup"][i] for x in rs)]
                   for i, s in enumerate(segments) if i}}
    near = [{k: x[k] for k in ("tail", "floor_ms", "replicas", "mfu", "overlap", "step_s", "speedup")}
            for x in rows if matches_paper(x, segments)]
    return {**ranges(rows), "by_replicas": {r: ranges([x for x in rows if x["replicas"] == r]) for r in REPLICAS},
            "near_paper": near}


def print_gpu_table(rows: list[dict], segments: list[int], every_row: bool = True) -> dict:
    """The table (every row, or only those near the paper) and its summary; returns table_summary."""
    print(f"\nGPU cost model (GPUCost: {GPUCost.name}; a model, not a measurement), UloRL's setting: 128 prompts x 8, "
          f"64k cap; s / RL step (rollout + update) and speedup over {segments[0]} segment(s); GPUs = rollout "
          f"engines, one H200 each, and as many trainer GPUs:")
    print(f"{'tail':>47} | {'floor ms':>8} | {'GPUs':>4} | {'MFU':>4} | {'overlap':>7} | "
          + " | ".join(f"{s:>2} seg: s (roll+upd)" for s in segments) + " | speedups")
    for x in rows:
        if every_row or matches_paper(x, segments):
            cells = " | ".join(f"{t:6.0f} ({r:5.0f}+{u:4.0f})"
                               for t, r, u in zip(x["step_s"], x["rollout_s"], x["update_s"]))
            mark = "  <- paper" if matches_paper(x, segments) else ""
            print(f"{x['tail']:>47} | {x['floor_ms']:8.2f} | {x['replicas']:4d} | {x['mfu']:4.1f} | "
                  f"{str(x['overlap']):>7} | {cells} | " + " ".join(f"{v:.2f}x" for v in x["speedup"]) + mark)
    summary = table_summary(rows, segments)
    for r, v in summary["by_replicas"].items():
        print(f"  {r:3d} GPUs: {segments[0]} segment(s) {v['step_s_first'][0]:.0f}-{v['step_s_first'][1]:.0f} s a step; "
              + ", ".join(f"{s} segments {v[f'speedup_{s}'][0]:.2f}-{v[f'speedup_{s}'][1]:.2f}x" for s in segments[1:]))
    print("  over every setting: " + ", ".join(f"{s} segments {summary[f'speedup_{s}'][0]:.2f}-"
                                                 f"{summary[f'speedup_{s}'][1]:.2f}x" for s in segments[1:])
          + f"; UloRL Table 1 (measured): 1240 / 774 / 601 s, {PAPER[2]:.2f}x / {PAPER[4]:.2f}x; "
            f"{len(summary['near_paper'])} of {len(rows)} settings within 10% of its figures ('<- paper')")
    return summary


def bench_gpu(args, _unused: list[str]) -> dict:
    segments = [int(s) for s in args.segments.split(",")]
    rows = gpu_table(segments, args.seed, args.steps)
    summary = print_gpu_table(rows, segments)
    return {"bench": "gpu", "model": GPUCost.name, "segments": segments, "paper_step_s": [1240, 774, 601],
            "floors_ms": [f * 1e3 for f in FLOORS], "replicas": list(REPLICAS), "mfu": list(MFUS), **summary}


def add_parser(sub) -> None:
    g = sub.add_parser("gpu", help="the GPU cost model's UloRL Table 1 over its unknowns (arithmetic, seconds)")
    g.add_argument("--segments", default="1,2,4", help="comma-separated segment counts; the first is the baseline")
    g.add_argument("--seed", type=int, default=0, help="seed of the drawn response lengths")
    g.add_argument("--steps", type=int, default=6, help="measured RL steps per variant (after S + 2 warm-up steps)")
    g.set_defaults(run=bench_gpu)
